"""compressed_all_reduce: every algorithm, against psum and its own invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
from qcollect.collectives._layout import plan_segments
from tests.helpers import mesh_of, per_device


def _reduce(n, compressor, algorithm, **kw):
    def fn(x, key):
        return qc.compressed_all_reduce(x, "d", compressor, key, algorithm=algorithm, **kw)
    return per_device(fn, n)


def _keys(n, seed=0):
    # The same key on every device: compressed_all_reduce folds in the index.
    return jnp.stack([jax.random.key(seed)] * n)


def _normal(seed, shape):
    """Standard normal float32 values: NumPy's draws (a `jax.random` draw compiles
    a program per shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def _covering(cases, sizes, default):
    """``pytest.param(*case, n, id=f"{name}-{n}")`` for every ``name: case``
    of ``cases`` and device count ``n`` of ``sizes``, in that order: the
    counts ``default[name]`` run by default, the rest of the cross product
    under ``-m slow``. The defaults take every case and every count at least
    once; another count runs the same code."""
    assert set(default) == set(cases) and set(sizes) == {n for c in default.values() for n in c}
    return [pytest.param(*case, n, id=f"{name}-{n}",
                         marks=() if n in default[name] else pytest.mark.slow)
            for name, case in cases.items() for n in sizes]


@settings(max_examples=12)  # a compile per example
@given(n=st.sampled_from([1, 2, 3, 4, 8]), length=st.integers(1, 200),
       algorithm=st.sampled_from(qc.ALGORITHMS), seed=st.integers(0, 99))
def test_identity_equals_psum(n, length, algorithm, seed):
    x = _normal(seed, (n, length))
    out = _reduce(n, qc.identity(), algorithm)(x, _keys(n))
    want = np.broadcast_to(np.asarray(x, np.float64).sum(0), x.shape)  # lax.psum's, per device
    np.testing.assert_allclose(np.asarray(out.value), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.contributed), np.asarray(x))


@pytest.mark.parametrize("algorithm", qc.ALGORITHMS)
def test_identity_pytree_mean_fused_and_separate(algorithm):
    n = 4
    tree = {"w": _normal(0, (n, 5, 3)),
            "b": _normal(1, (n, 7)).astype(jnp.bfloat16),
            "s": _normal(2, (n,))}
    for fuse in (True, False):
        out = _reduce(n, qc.identity(), algorithm, mean=True, fuse=fuse)(tree, _keys(n))
        for name, leaf in tree.items():
            got = np.asarray(out.value[name], np.float32)
            assert out.value[name].dtype == leaf.dtype and got.shape == leaf.shape
            want = np.asarray(leaf, np.float32).mean(0)
            tol = 3e-2 if leaf.dtype == jnp.bfloat16 else 1e-5
            np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=tol, atol=tol)


@pytest.mark.parametrize("algorithm", ["pairwise", "ring_requantize"])
@pytest.mark.parametrize("compressor", [qc.qsgd(bits=4), qc.onebit(), qc.qsgd(bits=2)],
                         ids=lambda c: c.name)
def test_replicas_agree(algorithm, compressor):
    n = 4
    x = _normal(3, (n, 333))
    value = np.asarray(_reduce(n, compressor, algorithm)(x, _keys(n)).value)
    for i in range(1, n):
        np.testing.assert_array_equal(value[i], value[0])


def test_qsgd_pairwise_is_unbiased():
    n, length, draws = 4, 64, 300
    x = _normal(4, (n, length))
    run = _reduce(n, qc.qsgd(bits=2, bucket_size=16), "pairwise")
    values = np.stack([np.asarray(run(x, _keys(n, seed)).value)[0] for seed in range(draws)])
    want = np.asarray(x).sum(0)
    std_err = values.std(0) / np.sqrt(draws)
    assert np.all(np.abs(values.mean(0) - want) <= 5 * std_err + 1e-6)
    assert np.abs(values[0] - want).max() > 0.01  # each draw is lossy


@pytest.mark.parametrize("compressor, n", _covering(
    {c.name: (c,) for c in (qc.qsgd(bits=4), qc.onebit())}, [2, 3, 8],
    {"qsgd/b4/512/max": (3,), "onebit/bucket/64": (2, 8)}))
def test_pairwise_error_feedback_identity(n, compressor):
    """sum of contributions == value + sum of owner errors (nothing is lost)."""
    x = _normal(5, (n, 1000))
    out = _reduce(n, compressor, "pairwise")(x, _keys(n))
    lhs = np.asarray(out.contributed, np.float64).sum(0)
    rhs = np.asarray(out.value, np.float64)[0] + np.asarray(out.owner_error, np.float64).sum(0)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-4, atol=1e-4)
    # Each device's owner error is zero outside its own chunk.
    # Chunks hold whole buckets of the leaf.
    (segment,) = plan_segments([x[0]], compressor.grouping, compressor.block, n)
    chunk = segment.chunk_shape[0]
    assert chunk % compressor.block == 0
    owner_error = np.asarray(out.owner_error)
    for i in range(n):
        err = owner_error[i].copy()
        err[i * chunk:(i + 1) * chunk] = 0
        assert np.all(err == 0)


def test_owner_residual_is_fed_back():
    n = 4
    x = _normal(6, (n, 100))
    c = qc.qsgd(bits=8, stochastic=False)
    residual = jnp.zeros((n, 100)).at[:, :].set(0.25)
    run = per_device(lambda v, r: qc.compressed_all_reduce(
        v, "d", c, algorithm="pairwise", owner_residual=r), n)
    base = np.asarray(_reduce(n, c, "pairwise")(x, _keys(n)).value)[0]
    # Only the owner's chunk of the residual counts: 0.25 per element in total.
    fed = np.asarray(run(x, residual).value)[0]
    np.testing.assert_allclose(fed - base, 0.25, atol=0.05)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_pca_ring_equals_decoded_psum_of_encodings(n):
    k, d = 16, 4
    length = k * 3 * n  # whole slices per device chunk, as GradiVeQ's segments
    basis, _ = jnp.linalg.qr(_normal(7, (k, d)))
    mean = _normal(8, (k,))
    c = qc.pca(basis, mean, num_workers=n)
    x = _normal(9, (n, length))
    ring = _reduce(n, c, "ring")(x, _keys(n)).value
    want = per_device(lambda v: c.decode(lax.psum(c.encode(v), "d")), n)(x)
    np.testing.assert_allclose(np.asarray(ring), np.asarray(want), rtol=1e-4, atol=1e-4)
    # A ragged length still works; only the padded last slice is compressed differently.
    ragged = _normal(9, (n, length + 5))
    out = np.asarray(_reduce(n, c, "ring")(ragged, _keys(n)).value)
    want = np.asarray(per_device(lambda v: c.decode(lax.psum(c.encode(v), "d")), n)(ragged))
    np.testing.assert_allclose(out[:, :length - k], want[:, :length - k], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("algorithm", ["pairwise", "ring_requantize"])
def test_pca_requantizing_algorithms_exact_in_span(algorithm):
    n, k, d = 4, 16, 4
    basis, _ = jnp.linalg.qr(_normal(7, (k, d)))
    c = qc.pca(basis, jnp.zeros(k), num_workers=n)  # a mean: the payload carries a weight
    coeffs = _normal(11, (n, 6 * n, d))
    x = (coeffs @ basis.T).reshape(n, -1)  # every slice in the span of the basis
    out = np.asarray(_reduce(n, c, algorithm)(x, _keys(n)).value)
    np.testing.assert_allclose(out, np.broadcast_to(np.asarray(x).sum(0), out.shape),
                               rtol=1e-4, atol=1e-4)


def test_ring_requantize_error_grows_with_devices():
    c, errs = qc.qsgd(bits=4), {}
    for n in (2, 8):
        x = _normal(10, (n, 4096))
        value = np.asarray(_reduce(n, c, "ring_requantize")(x, _keys(n)).value)[0]
        want = np.asarray(x).sum(0)
        errs[n] = np.linalg.norm(value - want) / np.linalg.norm(want)
    pair = {}
    for n in (2, 8):
        x = _normal(10, (n, 4096))
        value = np.asarray(_reduce(n, c, "pairwise")(x, _keys(n)).value)[0]
        want = np.asarray(x).sum(0)
        pair[n] = np.linalg.norm(value - want) / np.linalg.norm(want)
    assert errs[8] > 1.3 * errs[2]
    assert errs[8] > pair[8]


def test_bad_arguments():
    run = lambda **kw: per_device(  # noqa: E731
        lambda v: qc.compressed_all_reduce(v, "d", **kw).value, 2)(jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="linear"):
        run(compressor=qc.qsgd(), key=jax.random.key(0), algorithm="ring")
    with pytest.raises(ValueError, match="algorithm"):
        run(compressor=qc.identity(), algorithm="tree")
    with pytest.raises(ValueError, match="key"):
        run(compressor=qc.qsgd())
    with pytest.raises(ValueError, match="owner_residual"):
        run(compressor=qc.identity(), algorithm="ring", owner_residual=jnp.ones(4))
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="pipeline"):
            run(compressor=qc.identity(), pipeline=bad)
    with pytest.raises(ValueError, match="exchange"):
        run(compressor=qc.identity(), exchange="broadcast")


# Deterministic compressors, so that every pipeline count draws nothing random.
PIPELINED = [(qc.identity(), "ring"), (qc.cast("bfloat16"), "ring"),
             (qc.onebit(), "pairwise"), (qc.qsgd(bits=4, stochastic=False), "pairwise"),
             (qc.qsgd(bits=8, stochastic=False), "ring_requantize"),
             (qc.onebit(grouping="column"), "pairwise")]


@pytest.mark.parametrize("compressor, algorithm", PIPELINED, ids=lambda v: getattr(v, "name", v))
def test_pipeline_pieces_give_the_same_reduction(compressor, algorithm):
    """Cutting each chunk into runs of whole groups (2 or 64 runs) changes which
    collectives move the words, not the sum, what each device contributed or the
    owner errors; a count above a chunk's groups is capped. A tree of odd sizes, one
    bfloat16 leaf."""
    n = 3
    x = {"w": _normal((7, 0), (n, 301, 7)), "b": _normal((7, 1), (n, 5)),
         "h": _normal((7, 2), (n, 1000)).astype(jnp.bfloat16)}
    pipelines = (1, 2, 64)

    def reductions(x, key):  # one program: the unpipelined reference and the pipelines
        return [qc.compressed_all_reduce(x, "d", compressor, key, algorithm=algorithm,
                                         pipeline=pipeline) for pipeline in pipelines]
    base, *piped = per_device(reductions, n)(x, _keys(n))
    for pipeline, result in zip(pipelines[1:], piped, strict=True):
        _assert_same_reduction(x, base, result, pipeline)


def _assert_same_reduction(x, base, piped, pipeline):
    for name in x:
        for field in ("value", "contributed", "owner_error"):
            a, b = getattr(base, field), getattr(piped, field)
            if a is None:
                assert b is None
                continue
            a, b = np.asarray(a[name], np.float32), np.asarray(b[name], np.float32)
            # Sums may round in another order (a different fusion), nothing more.
            scale = np.abs(np.asarray(x[name], np.float32)).sum(0).max()
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * scale + 1e-6,
                                       err_msg=f"pipeline={pipeline} {name} {field}")


EXCHANGED = [(qc.identity(), "ring"), (qc.cast("bfloat16"), "ring"),
             (qc.onebit(), "pairwise"), (qc.qsgd(bits=4), "pairwise"),
             (qc.onebit(grouping="column"), "pairwise"), (qc.cast("bfloat16"), "pairwise")]


# The ring (sums in another order) at an odd and the largest count; every
# other pair once, each count in turn.
@pytest.mark.parametrize("compressor, algorithm, n", _covering(
    {f"{c.name}-{a}": (c, a) for c, a in EXCHANGED}, [2, 3, 8],
    {"identity-ring": (3, 8), "cast/bfloat16-ring": (2,), "onebit/bucket/64-pairwise": (8,),
     "qsgd/b4/512/max-pairwise": (2,), "onebit/column-pairwise": (3,),
     "cast/bfloat16-pairwise": (3,)}))
def test_all_to_all_exchange_gives_the_permute_reduction(n, compressor, algorithm):
    """exchange="all_to_all" moves the payloads of the ring and pairwise algorithms in
    one all-to-all: pairwise gives bit for bit the values, contributions and owner
    errors of the N - 1 shifts (the owner adds the same payloads in the same order);
    the ring adds its payloads at the owner, so only the order of its sums differs.
    A tree of odd sizes, a bfloat16 and an empty leaf."""
    x = {"w": _normal((3, 0), (n, 301, 7)),
         "b": 10.0 * _normal((3, 1), (n, 5)),
         "h": _normal((3, 2), (n, 1000)).astype(jnp.bfloat16),
         "e": jnp.zeros((n, 0))}

    def reductions(x, key):  # one program, both exchanges
        return [qc.compressed_all_reduce(x, "d", compressor, key, algorithm=algorithm,
                                         exchange=exchange)
                for exchange in ("permute", "all_to_all")]
    shifted, exchanged = per_device(reductions, n)(x, _keys(n))
    if algorithm == "pairwise":
        equal = lambda a, b: np.testing.assert_array_equal(  # noqa: E731
            np.asarray(a, np.float32), np.asarray(b, np.float32))
        jax.tree.map(equal, shifted, exchanged)
        return
    for name in x:  # each sum rounds n times in the payload's dtype (bfloat16: 2^-8)
        narrow = compressor.name.startswith("cast") or x[name].dtype == jnp.bfloat16
        scale = np.abs(np.asarray(x[name], np.float32)).sum(0).max(initial=0.0)
        np.testing.assert_allclose(
            np.asarray(exchanged.value[name], np.float32),
            np.asarray(shifted.value[name], np.float32),
            rtol=0, atol=n * (2.0 ** -8 if narrow else 1e-6) * scale + 1e-6, err_msg=name)


def _program(compressor, algorithm, exchange, n=4):
    mesh = mesh_of(n)
    fn = jax.jit(jax.shard_map(lambda v: qc.compressed_all_reduce(
        jax.tree.map(lambda a: a[0], v), "d", compressor, jax.random.key(0), algorithm=algorithm,
        exchange=exchange).value, mesh=mesh, in_specs=P("d"), out_specs=P()))
    x = jax.device_put({"w": jnp.ones((n, 4, 1000)), "h": jnp.ones((n, 300), jnp.bfloat16)},
                       NamedSharding(mesh, P("d")))
    return fn, x


@pytest.mark.parametrize("compressor, algorithm", [
    (qc.onebit(), "pairwise"), (qc.cast("bfloat16"), "pairwise"), (qc.identity(), "ring")],
    ids=["onebit", "bf16-pairwise", "identity-ring"])
def test_all_to_all_exchange_moves_the_same_bytes_in_one_collective(compressor, algorithm):
    """The same wire bytes (16-bit floats as 16-bit words); the N - 1 shifts (pairwise)
    or ring hops of a segment become one all-to-all of all its payloads' arrays;
    the default is the shifts."""
    fn, x = _program(compressor, algorithm, "all_to_all")
    shifts, _ = _program(compressor, algorithm, "permute")
    default = jax.jit(jax.shard_map(lambda v: qc.compressed_all_reduce(
        jax.tree.map(lambda a: a[0], v), "d", compressor, jax.random.key(0),
        algorithm=algorithm).value, mesh=mesh_of(4), in_specs=P("d"), out_specs=P()))
    assert qc.wire_bytes(fn, x) == qc.wire_bytes(shifts, x) == qc.wire_bytes(default, x)
    ops = qc.wire_report(fn, x)
    count = lambda ops, op: sum(o.multiplicity for o in ops if o.op == op)  # noqa: E731
    assert count(ops, "all-to-all") == 2  # one per segment: float32, bfloat16
    assert count(ops, "collective-permute") == 0
    assert count(qc.wire_report(shifts, x), "all-to-all") == 0
    assert count(qc.wire_report(default, x), "collective-permute") > 0
    # The payload's arrays packed: one piece per device (XLA's tuple all-to-all).
    assert [o.arrays for o in ops if o.op == "all-to-all"] == [4, 4]


def test_pipeline_cuts_the_collectives_not_the_bytes():
    """pipeline=4: four chains of collectives for a 4-bucket chunk; wire bytes equal
    up to nothing (1-bit's means are per bucket, so the runs add none)."""
    n = 2
    x = jax.device_put(jnp.ones((n, n * 4 * 64)), NamedSharding(mesh_of(n), P("d")))

    def reduce(pipeline):
        fn = jax.shard_map(lambda v: qc.compressed_all_reduce(
            v[0], "d", qc.onebit(), algorithm="pairwise", pipeline=pipeline).value,
            mesh=mesh_of(n), in_specs=P("d"), out_specs=P())
        return jax.jit(fn)

    one, four = (qc.wire_report(reduce(p), x) for p in (1, 4))
    assert qc.wire_bytes(reduce(1), x) == qc.wire_bytes(reduce(4), x)
    gathers = lambda ops: sum(op.multiplicity for op in ops if op.op == "all-gather")  # noqa: E731
    assert gathers(four) == 4 * gathers(one)


def test_under_pmap():
    n = 4
    x = _normal(11, (n, 50))
    out = jax.pmap(lambda v: qc.compressed_all_reduce(v, "i", qc.identity(),
                                                      algorithm="pairwise").value,
                   axis_name="i", devices=jax.devices()[:n])(x)
    np.testing.assert_allclose(np.asarray(out)[2], np.asarray(x).sum(0), rtol=1e-5, atol=1e-5)


INVARIANT = {"identity": (qc.identity(), "ring"), "bf16": (qc.cast("bfloat16"), "ring"),
             "qsgd4": (qc.qsgd(bits=4), "pairwise"),
             "onebit-requantize": (qc.onebit(), "ring_requantize")}


@pytest.mark.parametrize("compressor, algorithm, n", _covering(
    INVARIANT, [1, 3, 4],
    {"identity": (1, 4), "bf16": (3,), "qsgd4": (4,), "onebit-requantize": (3,)}))
def test_results_are_invariant_and_leave_shard_map_replicated(n, compressor, algorithm):
    """value and ring_all_reduce are typed invariant: out_specs=P() holds them."""
    mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])
    tree = {"odd": _normal(0, (n * 7, 5)),
            "half": jnp.ones((n * 3,), jnp.bfloat16), "empty": jnp.zeros((0,))}
    tree = jax.device_put(tree, NamedSharding(mesh, P("d")))

    def both(t):
        value = qc.compressed_all_reduce(t, "d", compressor, jax.random.key(1),
                                         algorithm=algorithm).value
        return value, qc.ring_all_reduce(t, "d")

    value, ring = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P("d"),
                                        out_specs=P()))(tree)
    exact = jax.tree.map(lambda a: np.asarray(a, np.float32).reshape(
        (n, -1) + a.shape[1:]).sum(0), tree)
    for name in tree:
        assert value[name].shape == ring[name].shape == exact[name].shape
        np.testing.assert_allclose(np.asarray(ring[name], np.float32),
                                   np.asarray(exact[name]), rtol=1e-2, atol=1e-2)
