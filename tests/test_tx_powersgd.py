"""transforms.powersgd: PyTorch powerSGD_hook semantics, error feedback, state, NaN policy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms
from tests.helpers import count_primitives, mesh_of, pmap_train, sharded_update, train_sharded

N = 8
DIM, OUT, BATCH = 32, 16, 64


# ---------------------------------------------------------------- helpers

def _problem(n=N, seed=0):
    """Per-device least-squares data with a shared true solution."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, BATCH, DIM)).astype(np.float32)
    w_true = rng.standard_normal((DIM, OUT)).astype(np.float32)
    y = x @ w_true + 0.01 * rng.standard_normal((n, BATCH, OUT)).astype(np.float32)
    params = {"w": jnp.zeros((DIM, OUT)), "b": jnp.zeros((OUT,))}
    return params, x, y


def _loss(p, x, y):
    return jnp.mean(jnp.sum((x @ p["w"] + p["b"] - y) ** 2, axis=-1))


def _pmean_tx():
    return optax.GradientTransformation(lambda p: optax.EmptyState(),
                                        lambda g, s, p=None: (lax.pmean(g, "d"), s))


def _train(tx, steps, n=N, seed=0):
    """Trains on n devices (jitted shard_map step); returns params, state, losses."""
    params, x, y = _problem(n, seed)
    return train_sharded(tx, _loss, params, x, y, steps, n)


def _init(tx, template, n=N):
    return transforms.init_sharded(tx, template, mesh_of(n), "d")


def _abstract_state(tx, template, n=N):
    """The shapes, dtypes and shardings of `_init`'s state, traced (not compiled):
    enough to compile a step for `qcollect.wire_bytes` without initialising
    (PowerSGD's jitted init, its first Q, compiles for seconds)."""
    abstract = jax.eval_shape(tx.init, template)
    mesh = mesh_of(n)
    return jax.tree.map(lambda a, spec: jax.ShapeDtypeStruct(
        a.shape if spec == P() else (n,) + a.shape, a.dtype, sharding=NamedSharding(mesh, spec)),
        abstract, transforms.state_specs(abstract, "d"))


SHAPES = {"a": (6, 10), "c": (12, 4), "k": (3, 2, 2, 5), "v": (7,)}


def _grads(seed, n=N, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((n,) + s).astype(np.float32) for name, s in shapes.items()}


def _template(shapes=SHAPES):
    return {name: jnp.zeros(s) for name, s in shapes.items()}


# ---------------------------------------------------------------- tests

def test_before_compress_after_equals_optax_with_pmean():
    inner = optax.adam(0.05)
    tx = optax.chain(transforms.powersgd("d", rank=1, key=jax.random.key(0), compress_after=100),
                     inner)
    ours, state, l1 = _train(tx, 12)
    theirs, _, l2 = _train(optax.chain(_pmean_tx(), inner), 12)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    ps_state = state[0]
    np.testing.assert_array_equal(np.asarray(ps_state.residuals["w"]), 0.0)  # untouched
    assert int(ps_state.count) == 12


@pytest.mark.parametrize("warm_start", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_full_rank_equals_uncompressed_mean(warm_start):
    tx = transforms.powersgd("d", rank=12, key=jax.random.key(1), compress_after=0,
                             warm_start=warm_start, min_compression_rate=1e-3)
    state = _init(tx, _template())
    assert all(state.residuals[k].shape[1:] == SHAPES[k] for k in "ack")
    run = sharded_update(tx, N, state)
    for t in range(3):
        grads = _grads(t)
        updates, state = run(grads, state)
        for name, g in grads.items():
            want = np.mean(np.asarray(g), axis=0)
            np.testing.assert_allclose(np.asarray(updates[name]), want, atol=2e-5,
                                       err_msg=f"{name} step {t}")


def test_error_feedback_telescopes():
    """Steps 0-1 uncompressed, 2-5 rank 1: sum of updates + mean residual == sum of means."""
    tx = transforms.powersgd("d", rank=1, key=jax.random.key(2), compress_after=2)
    state = _init(tx, _template())
    run = sharded_update(tx, N, state)
    total_update = jax.tree.map(lambda a: np.zeros(a.shape, np.float64), _template())
    total_mean = jax.tree.map(lambda a: np.zeros(a.shape, np.float64), _template())
    for t in range(6):
        grads = _grads(10 + t)
        updates, state = run(grads, state)
        for name in grads:
            total_update[name] += np.asarray(updates[name])
            total_mean[name] += np.mean(np.asarray(grads[name], np.float64), axis=0)
    for name in "ack":  # the compressed leaves
        res = np.mean(np.asarray(state.residuals[name], np.float64), axis=0)
        assert np.abs(res).max() > 0.1  # compression really lost something
        np.testing.assert_allclose(total_update[name] + res, total_mean[name], atol=1e-4)
    np.testing.assert_allclose(total_update["v"], total_mean["v"], atol=1e-5)


def _primitives(shapes, name, **kwargs):
    """``name`` primitives in the traced update of ``shapes`` (rank 2, compressed from step 0)."""
    tx = transforms.powersgd("d", rank=2, key=jax.random.key(4), compress_after=0, **kwargs)
    state = _abstract_state(tx, _template(shapes))  # traced only: no state to compute
    run = sharded_update(tx, N, state)
    grads = jax.device_put(_grads(0, shapes=shapes), NamedSharding(mesh_of(N), P("d")))
    return count_primitives(jax.make_jaxpr(run.mapped)(grads, state).jaxpr, name)


@pytest.mark.parametrize("warm_start", [True, False])
def test_leaves_of_one_shape_share_one_program(warm_start):
    """Leaves of one matrix shape form a class: its Gram-Schmidt and overflow
    paths are traced once, so the program grows with the shapes; per leaf it
    adds only the three plain products on the leaf's own matrix (P, Q and
    the decode), which read no stack of the large matrices."""
    def count(shapes):
        return [_primitives(shapes, p, warm_start=warm_start) for p in ("dot_general", "cond")]

    one_dots, one_conds = count({"a": (16, 12)})
    assert one_dots > 0 and one_conds > 0
    assert count({f"a{i}": (16, 12) for i in range(5)}) == [one_dots + 4 * 3, one_conds]
    two_shapes = {**{f"a{i}": (16, 12) for i in range(5)}, "c": (24, 8), "v": (7,)}
    assert count(two_shapes) == [2 * one_dots + 4 * 3, 2 * one_conds]


def _leaf_by_leaf(grads, state, steps, n):
    """PowerSGD leaf by leaf in float64 (Vogels et al. Alg. 1, warm start, error
    feedback, as PyTorch's hook): ``grads(t)`` gives step ``t``'s ``(n, ...)``
    gradients; the first ``Q`` is the transform's own from ``state``. Yields
    each step's ``(updates, q, residuals)`` per compressed leaf and the mean
    of every other leaf."""
    q = {k: np.asarray(v, np.float64) for k, v in state.q.items()
         if not isinstance(v, optax.MaskedNode)}
    errors = {k: 0.0 for k in q}
    for t in range(steps):
        g = grads(t)
        updates, residuals = {}, {}
        for name, leaf in g.items():
            if name not in q:
                updates[name] = np.mean(np.asarray(leaf, np.float64), axis=0)
                continue
            m = np.asarray(leaf, np.float64).reshape(n, -1, leaf.shape[-1]) + errors[name]
            total = m.sum(axis=0)                                # sum_i M_i: P and Q are linear
            p, r = np.linalg.qr(total @ q[name])
            p = p * np.sign(np.diag(r))                          # Gram-Schmidt's signs
            q[name] = total.T @ p / n
            updates[name] = p @ q[name].T
            errors[name] = residuals[name] = m - updates[name]
        yield updates, dict(q), residuals


def _assert_close(got, want, tol, what):
    """``|got - want| <= tol * max|want|`` everywhere (a vectorized check: the
    arrays here hold millions of values)."""
    got = np.asarray(got, np.float64).reshape(want.shape)
    error, scale = np.abs(got - want).max(), np.abs(want).max()
    assert error <= tol * scale, f"{what}: max error {error:.3g} against scale {scale:.3g}"


def _assert_step_matches(updates, new, want, tol, step):
    want_updates, want_q, want_residuals = want
    for name, value in want_updates.items():
        _assert_close(updates[name], value, tol, f"update of {name}, step {step}")
    for name, value in want_q.items():
        _assert_close(new.q[name], value, tol, f"Q of {name}, step {step}")
        _assert_close(new.residuals[name], want_residuals[name], tol,
                      f"local error of {name}, step {step}")


def test_leaves_of_one_shape_are_reduced_each_on_its_own():
    """Three steps on three (16, 12) leaves of different scales, one (24, 8) and
    a vector equal float64 leaf-by-leaf PowerSGD from the same first Q (no
    leaf of a class leaks into another)."""
    shapes = {"a": (16, 12), "b": (16, 12), "c": (24, 8), "e": (16, 12), "v": (7,)}
    tx = transforms.powersgd("d", rank=2, key=jax.random.key(7), compress_after=0)
    state = _init(tx, _template(shapes))

    def grads(t):
        g = _grads(8 + t, shapes=shapes)
        return {name: g[name] * np.float32(10.0 ** (2 * i - 4)) for i, name in enumerate(shapes)}

    run = sharded_update(tx, N, state)
    for t, want in enumerate(_leaf_by_leaf(grads, state, 3, N)):
        updates, state = run(grads(t), state)
        _assert_step_matches(updates, state, want, 1e-4, t)


# The MNIST MLP at width 2048: two leaves of one large shape, the first layer
# and the output layer alone in their classes, a bias; scales apart.
MLP_SHAPES = {"l0": (784, 2048), "l1": (2048, 2048), "l2": (2048, 2048), "out": (2048, 10),
              "b1": (2048,)}
MLP_SCALES = {"l0": 1e-3, "l1": 1e-2, "l2": 3e-4, "out": 1e-1, "b1": 1.0}


@functools.partial(jax.jit, static_argnums=(1, 2))
def _gradient_like(seed, shape, n, scale):
    """A shared rank-8 part plus per-device noise, scaled: one compiled
    program per shape, not one per operation and shape."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    shared = (jax.random.normal(k1, (rows, 8)) @ jax.random.normal(k2, (8, cols)))
    noise = jax.random.normal(k3, (n,) + shape)
    return scale * (shared.reshape(shape) + 0.5 * noise)


def _mlp_grads(t, n):
    """Gradient-like leaves: a shared rank-8 part plus per-device noise, scaled."""
    return {name: np.asarray(_gradient_like(100 * t + i, shape, n, MLP_SCALES[name]))
            for i, (name, shape) in enumerate(MLP_SHAPES.items())}


def test_stacked_step_equals_leaf_by_leaf_at_mlp_size():
    """Three steps (warm start, error feedback) on the MLP's leaves at width 2048
    on 4 devices equal float64 leaf-by-leaf PowerSGD within float32 rounding.
    At these sizes a class of one leaf went through XLA:CPU's miscompiled
    size-1 batch (`qcollect.orthogonalize`): the output layer's update was off
    by 94% at the first step and training diverged."""
    n = 4
    tx = transforms.powersgd("d", rank=4, key=jax.random.key(0), compress_after=0)
    state = _init(tx, _template(MLP_SHAPES), n)
    run = sharded_update(tx, n, state)
    grads = [_mlp_grads(t, n) for t in range(3)]
    for t, want in enumerate(_leaf_by_leaf(grads.__getitem__, state, 3, n)):
        updates, state = run(grads[t], state)
        _assert_step_matches(updates, state, want, 1e-4, t)


def test_least_squares_converges_like_uncompressed():
    """Rank-2 PowerSGD of a 32 x 16 weight on 8 devices reaches the uncompressed loss.

    After 120 SGD steps (lr 0.1, 20 uncompressed steps first) the loss is
    within 10% of the uncompressed run's (measured: 1.49e-3 both, the noise
    floor) and 100x below the start (519.7).
    """
    tx = optax.chain(transforms.powersgd("d", rank=2, key=jax.random.key(3), compress_after=20),
                     optax.sgd(0.1))
    _, state, losses = _train(tx, 120)
    _, _, ref = _train(optax.chain(_pmean_tx(), optax.sgd(0.1)), 120)
    assert state[0].q["w"].shape == (OUT, 2)     # replicated
    assert state[0].residuals["w"].shape == (N, DIM, OUT)     # per device
    assert losses[-1] < 1.1 * ref[-1], (losses[-1], ref[-1])
    assert losses[-1] < 0.01 * losses[0]


def test_state_structure_shapes_and_dtypes_unchanged():
    shapes = dict(SHAPES, h=(8, 9))
    tx = transforms.powersgd("d", rank=2, key=jax.random.key(4), compress_after=1)
    template = dict(_template(shapes), h=jnp.zeros((8, 9), jnp.bfloat16))
    state0 = _init(tx, template)
    run = sharded_update(tx, N, state0)
    grads = _grads(5, shapes=shapes)
    grads["h"] = jnp.asarray(grads["h"], jnp.bfloat16)
    state = state0
    for _ in range(2):  # one uncompressed step, one compressed
        updates, state = run(grads, state)
        assert jax.tree.structure(state) == jax.tree.structure(state0)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state0), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
        assert updates["h"].dtype == jnp.bfloat16
    # Only h pays at rank 2: (8 + 9) * 2 * 2 < 72; a, c, k and v stay uncompressed.
    assert state0.q["h"].shape == (9, 2) and isinstance(state0.q["a"], optax.MaskedNode)
    assert state0.residuals["h"].shape == (N, 8, 9)
    assert state0.residuals["h"].dtype == jnp.float32


def test_bfloat16_matrix_gradients_keep_their_dtype_in_both_phases():
    """A bfloat16 matrix in the gradients: both phases return the gradients'
    dtypes (the exact steps' mean once came back float32 where the
    compressed branch casts back, and lax.cond refused the step). Integer
    leaves are refused by name (`tests/test_faults.py`)."""
    tx = transforms.powersgd("d", rank=1, key=jax.random.key(7), compress_after=1)
    template = {"a": jnp.zeros((6, 10)), "h": jnp.zeros((6, 10), jnp.bfloat16)}
    state = _init(tx, template)
    run = sharded_update(tx, N, state)
    grads = {"a": _grads(8)["a"], "h": jnp.full((N, 6, 10), 3, jnp.bfloat16)}
    for _ in range(2):  # one uncompressed step, one compressed
        updates, state = run(grads, state)
        assert updates["h"].dtype == jnp.bfloat16 and updates["a"].dtype == jnp.float32
        # A constant matrix is rank 1: PowerSGD reconstructs it up to bfloat16 rounding.
        assert np.abs(np.asarray(updates["h"], np.float32) - 3).max() <= 3 * 2 ** -7


def test_nan_step_keeps_q_and_residuals():
    tx = transforms.powersgd("d", rank=1, key=jax.random.key(5), compress_after=1)
    state = _init(tx, _template())
    run = sharded_update(tx, N, state)
    for t in range(2):
        _, state = run(_grads(20 + t), state)
    before = state
    bad = _grads(30)
    bad["a"][3, 1, 2] = np.nan
    updates, state = run(bad, state)
    assert not np.isfinite(np.asarray(updates["a"])).all()
    for name in "ack":
        np.testing.assert_array_equal(np.asarray(state.residuals[name]),
                                      np.asarray(before.residuals[name]))
        np.testing.assert_array_equal(np.asarray(state.q[name]), np.asarray(before.q[name]))
    assert int(state.count) == 3
    updates, state = run(_grads(31), state)
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
    assert all(np.isfinite(np.asarray(s)).all() for s in jax.tree.leaves(state.q))


def test_wire_bytes_versus_uncompressed():
    """Bytes per device per step on 8 devices, measured from the compiled HLO."""
    shapes = {"w1": (256, 128), "w2": (128, 64), "b": (64,)}
    rank = 4
    mesh = mesh_of(N)

    template = _template(shapes)
    grads = jax.device_put(_grads(40, shapes=shapes), NamedSharding(mesh, P("d")))
    tx = transforms.powersgd("d", rank=rank, key=jax.random.key(6), compress_after=0)
    state = _abstract_state(tx, template)
    ours = qc.wire_bytes(sharded_update(tx, N, state).mapped, grads, state)
    plain = _pmean_tx()
    plain_state = _init(plain, template)
    base = qc.wire_bytes(sharded_update(plain, N, plain_state).mapped, grads, plain_state)
    # Two fused float32 rings (P: sum n r values, Q: sum m r values), each
    # N - 1 shifts and an all-gather of a ceil(K / N) chunk, plus the bias all-reduce.
    ring = lambda k: 2 * (N - 1) * -(-k // N) * 4  # noqa: E731
    expected = ring((256 + 128) * rank) + ring((128 + 64) * rank) + 2 * (N - 1) / N * 64 * 4
    assert base == pytest.approx(2 * (N - 1) / N * 4 * (256 * 128 + 128 * 64 + 64))
    assert ours == pytest.approx(expected)
    print(f"powersgd rank {rank}: {ours:.0f} B/device/step; pmean {base:.0f}; "
          f"ratio {ours / base:.4f}")
    assert ours / base < 0.06


def test_flax_conv_kernel_is_compressed_with_the_default_view():
    """A channels-last (3, 3, 8, 16) kernel is (72, 16) by default: compressed at rank 2.

    PyTorch's view would be (3, 48), where rank 2 does not pay: (3 + 48) 2 2 > 144.
    """
    shapes = {"conv": (3, 3, 8, 16), "b": (16,)}
    rank = 2
    mesh = mesh_of(N)
    template = _template(shapes)

    @jax.jit
    def init_first(p):
        return transforms.powersgd("d", rank=rank, key=jax.random.key(8), compress_after=0,
                                   matrix_view="first").init(p)
    assert isinstance(init_first(template).q["conv"], optax.MaskedNode)

    tx = transforms.powersgd("d", rank=rank, key=jax.random.key(8), compress_after=0)
    state = _init(tx, template)
    assert state.q["conv"].shape == (16, rank) and isinstance(state.q["b"], optax.MaskedNode)
    assert state.residuals["conv"].shape == (N, 3, 3, 8, 16)
    grads = jax.device_put(_grads(50, shapes=shapes), NamedSharding(mesh, P("d")))
    updates, new_state = sharded_update(tx, N, state).mapped(grads, state)
    u = np.asarray(updates["conv"])
    assert u.shape == (3, 3, 8, 16) and np.isfinite(u).all()
    assert np.abs(np.asarray(new_state.residuals["conv"])).max() > 0.1  # really low rank
    ours = qc.wire_bytes(sharded_update(tx, N, state).mapped, grads, state)
    plain = _pmean_tx()
    plain_state = _init(plain, template)
    base = qc.wire_bytes(sharded_update(plain, N, plain_state).mapped, grads, plain_state)
    # Two float32 rings, P (72 r values) then Q (16 r values), plus the bias all-reduce.
    ring = lambda k: 2 * (N - 1) * -(-k // N) * 4  # noqa: E731
    assert base == pytest.approx(2 * (N - 1) / N * 4 * (3 * 3 * 8 * 16 + 16))
    assert ours == pytest.approx(ring(72 * rank) + ring(16 * rank) + 2 * (N - 1) / N * 16 * 4)
    assert ours < 0.5 * base


def test_first_view_equals_default_on_matrices():
    """For 2-D leaves (and vectors) both views are the same matrix: identical steps."""
    shapes = {"a": (6, 10), "c": (12, 4), "h": (8, 9), "v": (7,)}
    txs = [transforms.powersgd("d", rank=2, key=jax.random.key(9), compress_after=1, **kw)
           for kw in ({}, {"matrix_view": "first"})]
    states = [_init(tx, _template(shapes))
              for tx in txs]
    for a, b in zip(jax.tree.leaves(states[0]._replace(key=None)),
                    jax.tree.leaves(states[1]._replace(key=None)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    runs = [sharded_update(tx, N, s) for tx, s in zip(txs, states, strict=True)]
    for t in range(3):
        grads = _grads(60 + t, shapes=shapes)
        (u0, s0), (u1, s1) = (run(grads, s) for run, s in zip(runs, states, strict=True))
        for a, b in zip(jax.tree.leaves((u0, s0._replace(key=None))),
                        jax.tree.leaves((u1, s1._replace(key=None))), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        states = [s0, s1]
    assert states[0].q["h"].shape == (9, 2)  # h is compressed, so the views were exercised


def test_pmap_matches_shard_map():
    n = 4
    tx = optax.chain(transforms.powersgd("i", rank=2, key=jax.random.key(7), compress_after=3),
                     optax.sgd(0.1))
    params, x, y = _problem(n, seed=1)
    ps, st, losses = pmap_train(tx, _loss, params, x, y, 15, n)
    assert losses[-1] < 0.2 * losses[0]
    np.testing.assert_array_equal(np.asarray(ps["w"][0]), np.asarray(ps["w"][3]))
    tx_sm = optax.chain(transforms.powersgd("d", rank=2, key=jax.random.key(7), compress_after=3),
                        optax.sgd(0.1))
    ref, _, ref_losses = _train(tx_sm, 15, n=n, seed=1)
    np.testing.assert_allclose(np.asarray(ps["w"][0]), np.asarray(ref["w"]), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)


@pytest.mark.parametrize("kwargs", [dict(rank=0), dict(rank=2.0), dict(rank=1, compress_after=-1),
                                    dict(rank=1, min_compression_rate=0),
                                    dict(rank=1, matrix_view="rows")])
def test_invalid_settings_raise(kwargs):
    name = next((k for k in kwargs if k != "rank"), "rank")
    with pytest.raises(ValueError, match=name):
        transforms.powersgd("d", key=jax.random.key(0), **kwargs)


def test_numpy_numbers_are_settings_like_python_ones():
    python = transforms.powersgd("d", rank=2, key=jax.random.key(0), compress_after=3,
                                 min_compression_rate=2)
    numpy = transforms.powersgd("d", rank=np.int64(2), key=jax.random.key(0),
                                compress_after=np.int64(3), min_compression_rate=np.float32(2))
    template = _template()
    assert (jax.tree.map(jnp.shape, numpy.init(template))
            == jax.tree.map(jnp.shape, python.init(template)))


@pytest.mark.parametrize("kwargs, shapes, match", [
    ({}, {**SHAPES, "z": (4,)}, r"not the one init saw.*\['z'\]"),         # extra leaf
    ({}, {"a": (6, 10), "k": (3, 2, 2, 5)}, r"not the one init saw.*\['c'\]"),  # missing leaf
    ({}, {**SHAPES, "a": (6, 11)},
     r"local error of \['a'\] has shape \(1, 6, 10\), expected \(6, 11\)"),
    (dict(error_feedback=None), {**SHAPES, "a": (6, 11)},
     r"Q memory of \['a'\] has shape \(10, 1\), expected \(11, 1\)"),
    ({}, {**SHAPES, "v": (8, 16)}, r"leaf \['v'\] of shape \(8, 16\) is compressed, but init"),
])
def test_update_on_another_tree_names_the_leaf(kwargs, shapes, match):
    """An update on a tree other than init's raises at trace time, naming the leaf."""
    tx = transforms.powersgd("d", rank=1, key=jax.random.key(0), compress_after=0, **kwargs)
    abstract = jax.eval_shape(tx.init, _template())  # nothing compiles: all abstract
    mesh = mesh_of(2)
    state = jax.tree.map(lambda a, spec: jax.ShapeDtypeStruct(
        a.shape if spec == P() else (2,) + a.shape, a.dtype, sharding=NamedSharding(mesh, spec)),
        abstract, transforms.state_specs(abstract, "d"))
    grads = {k: jax.ShapeDtypeStruct((2,) + s, jnp.float32, sharding=NamedSharding(mesh, P("d")))
             for k, s in shapes.items()}
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(sharded_update(tx, 2, state).mapped, grads, state)


def test_each_phase_is_measured_by_name_and_the_schedule_says_how_many_steps():
    """Leaves of several shapes and scales: the exact steps send what an
    uncompressed all-reduce of every leaf sends, the compressed phase what
    PowerSGD alone (``compress_after=0``) sends, exactly; ``compress_after``
    moves steps between the phases, not bytes."""
    shapes = {"w1": (256, 128), "w2": (128, 64), "conv": (3, 3, 8, 16), "b": (64,)}
    rank = 4
    rng = np.random.default_rng(0)
    grads = jax.device_put({k: (10.0 ** (3 * i - 4) * rng.standard_normal((N,) + s))
                            .astype(np.float32) for i, (k, s) in enumerate(shapes.items())},
                           NamedSharding(mesh_of(N), P("d")))

    def stepped(tx):
        state = _abstract_state(tx, _template(shapes))
        return sharded_update(tx, N, state).mapped, state

    def measured(tx, by_phase=True):
        step, state = stepped(tx)
        return (qc.wire_bytes_by_phase if by_phase else qc.wire_bytes)(step, grads, state)

    plain = measured(_pmean_tx(), by_phase=False)
    alone_step, alone_state = stepped(transforms.powersgd("d", rank=rank, key=jax.random.key(0),
                                                          compress_after=0))
    alone = qc.wire_bytes(alone_step, grads, alone_state)
    ring = lambda k: 2 * (N - 1) * -(-k // N) * 4  # noqa: E731
    # P and Q of each compressed leaf in one fused ring per round; the bias averaged.
    assert alone == (ring((256 + 128 + 72) * rank) + ring((128 + 64 + 16) * rank)
                     + 2 * (N - 1) / N * 4 * 64)
    assert plain == 2 * (N - 1) / N * 4 * sum(int(np.prod(s)) for s in shapes.values())
    for first in (30, None):
        kwargs = {} if first is None else {"compress_after": first}
        tx = transforms.powersgd("d", rank=rank, key=jax.random.key(0), **kwargs)
        assert measured(tx) == {"compressed": alone, "exact": plain}
    # A count and its CompressAfter are one schedule: one program, the same bytes.
    count, schedule = (stepped(transforms.powersgd("d", rank=rank, key=jax.random.key(0),
                                                   compress_after=first))
                       for first in (30, transforms.CompressAfter(30)))
    assert str(jax.make_jaxpr(count[0])(grads, count[1])) == str(
        jax.make_jaxpr(schedule[0])(grads, schedule[1]))
    # By phase, the program compiled for `alone`: one phase.
    assert qc.wire_bytes_by_phase(alone_step, grads, alone_state) == {"compressed": alone}
    # What 300 steps send: the default's 10 exact steps first; PyTorch's 1000 never compresses.
    for warm in (10, 30, 1000):
        spans = transforms.CompressAfter(warm).spans(300)
        exact = min(warm, 300)
        assert transforms.steps_per_phase(spans) == {
            k: v for k, v in {"exact": exact, "compressed": 300 - exact}.items() if v}
        per_phase = {"compressed": alone, "exact": plain}
        assert sum((s.stop - s.start) * per_phase[s.name] for s in spans) == (
            exact * plain + (300 - exact) * alone)


def test_default_compress_after_is_short():
    """Ten uncompressed steps by default (PyTorch's hook waits 1000), then
    rank-``r`` updates."""
    default = 10   # compress_after=None: the documented default
    tx = transforms.powersgd("d", rank=1, key=jax.random.key(0))
    state = _init(tx, _template())
    run = sharded_update(tx, N, state)
    grads = _grads(3)
    for _ in range(default):  # uncompressed: the mean of every leaf
        update, state = run(grads, state)
        for name in SHAPES:
            np.testing.assert_allclose(np.asarray(update[name]), grads[name].mean(0),
                                       rtol=1e-5, atol=1e-6)
    update, _ = run(grads, state)  # the first compressed step: rank 1
    assert np.linalg.matrix_rank(np.asarray(update["a"]), tol=1e-5) == 1
