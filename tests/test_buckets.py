"""Batched buckets: equal buckets share one traced copy of the algorithm.

A tree of small leaves (a fused segment of many equal buckets and a shorter
last one) and two equal large leaves (reduced alone, stacked into one batch)
is reduced with 1 KiB buckets and as one bucket: the results are the
same, the program does not grow with the number of buckets once they run
as a batch (``batch_buckets="always"``), and the wire bytes count every
bucket, batched or traced once per bucket (``batch_buckets="never"``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcollect as qc
from qcollect.bench.compile import kernel_counts
from qcollect.collectives._layout import plan_segments
from qcollect.collectives._offsets import runtime_offsets, runtime_slices
from tests.helpers import normal, per_device

N = 2
SMALL = [(40,), (3, 50), (130,), (7, 7), (64,), (2, 64)]
LARGE = [(600,), (600,)]
CAP = 1024
ONEBIT = qc.onebit(bucket_size=16)


def _tree(shapes, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    # leaves of different scales, so a bucket spanning two leaves would show
    return [jax.random.normal(k, (N,) + s) * 10.0 ** (i % 4 - 2)
            for i, (k, s) in enumerate(zip(keys, shapes, strict=True))]


def _reduced(tree, compressor, kw):
    out = qc.compressed_all_reduce(tree, "d", compressor, jax.random.key(0), **kw)
    return out.value, out.contributed, out.owner_error


def _reduce(compressor, cap, **kw):
    return per_device(lambda t: _reduced(t, compressor, dict(bucket_bytes=cap, **kw)), N)


def _reductions(compressor, *variants):
    """One program (one compile) reducing the tree once per variant, each a dict of
    `compressed_all_reduce` keywords."""
    return per_device(lambda t: [_reduced(t, compressor, kw) for kw in variants], N)


def test_the_layout_has_a_class_of_equal_buckets_and_a_class_of_equal_leaves():
    leaves = [jnp.zeros(s) for s in SMALL + LARGE]
    segments = plan_segments(leaves, ONEBIT.grouping, ONEBIT.block, N, bucket_bytes=CAP)
    assert [seg.members for seg in segments] == [(0, 1, 2, 3, 4, 5), (6,), (7,)]
    assert segments[0].parts == ((2, 8), (1, 3))  # 38 rows of 16 values, 16 a bucket
    assert segments[1].parts == segments[2].parts == ((1, 19),)


def test_buckets_give_the_results_of_one_bucket():
    """1-bit statistics are per 16-value group: where a group lands (which
    bucket, which device, batched or traced once per bucket) changes nothing
    but the order in which the owner adds the decoded payloads (rounding)."""
    single, batch, unrolled = _reductions(
        ONEBIT, {"bucket_bytes": None, "algorithm": "pairwise"},
        *({"bucket_bytes": CAP, "algorithm": "pairwise", "batch_buckets": b}
          for b in ("always", "never"))
    )(_tree(SMALL + LARGE))
    # value and contributed per device; the owner errors sit at the chunks
    # each device owns, which the layout decides: their sum over devices.
    for unroll, bucketed in (("batch", batch), ("unrolled", unrolled)):
        for k, (a_tree, b_tree) in enumerate(zip(bucketed, single, strict=True)):
            for a, b in zip(a_tree, b_tree, strict=True):
                a, b = np.asarray(a), np.asarray(b)
                if k == 2:
                    a, b = a.sum(0), b.sum(0)
                # 8 payloads added in another order: a few float32 units of the
                # largest value, also where the sum cancels to near zero
                scale = float(np.max(np.abs(b), initial=1.0))
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale, err_msg=unroll)


def _pca16():
    basis = np.linalg.qr(np.random.default_rng(0).standard_normal((16, 4)))[0]
    return qc.pca(basis.astype(np.float32), np.full(16, 0.1, np.float32), num_workers=N)


@pytest.mark.parametrize("compressor, algorithm, dtype", [
    (qc.qsgd(bits=2, bucket_size=16), "pairwise", jnp.float32),
    (qc.qsgd(bits=4, bucket_size=16), "ring_requantize", jnp.float32),
    (qc.identity(), "ring", jnp.float32),
    (_pca16(), "ring", jnp.float32),
    (qc.onebit(grouping="column"), "pairwise", jnp.float32),
    (qc.onebit(bucket_size=16), "pairwise", jnp.bfloat16),
], ids=["qsgd-pairwise", "qsgd-ring_requantize", "identity-ring", "pca-ring",
        "onebit-column-pairwise", "onebit-pairwise-bf16"])
def test_the_batch_computes_what_the_unrolled_program_computes(compressor, algorithm, dtype):
    """Every algorithm: a bucket's random stream and its decode do not depend
    on whether its class runs as a batch, so both programs give the same
    value, contributed and owner error (up to rounding)."""
    tree = [leaf.astype(dtype) for leaf in _tree(SMALL + LARGE)]
    settings = ({"bucket_bytes": CAP, "algorithm": algorithm, "batch_buckets": b}
                for b in ("always", "never"))
    batch, unrolled = _reductions(compressor, *settings)(tree)
    for a, b in zip(jax.tree.leaves(batch), jax.tree.leaves(unrolled), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-5, atol=1e-6)
    assert len(jax.tree.leaves(batch)) == len(tree) * (3 if algorithm == "pairwise" else 2)


# QSGD at layer size under -m slow: the batch's layout does not depend on the
# compressor (one-bit's here), and QSGD's batch against its traced program
# runs on the small trees above (its random streams in the test below).
@pytest.mark.parametrize("compressor", [
    pytest.param(qc.onebit(), id="onebit"),
    pytest.param(qc.qsgd(bits=4), id="qsgd", marks=pytest.mark.slow)])
def test_the_batch_of_layer_sized_leaves_computes_what_the_traced_program_computes(compressor):
    """The MNIST MLP's gradient at width 2048 on 4 devices with the default
    4 MiB buckets: its two (2048, 2048) kernels (scales 100x apart) are one
    class; batched and traced, the values, contributions and owner errors
    agree, and every leaf stays finite."""
    n = 4
    shapes = [(784, 2048), (2048,), (2048, 2048), (2048,), (2048, 2048), (2048,), (2048, 10)]
    tree = [normal((5, i), (n,) + s) * 10.0 ** (-(i % 3) - 2) for i, s in enumerate(shapes)]
    batch, traced = per_device(lambda t: [_reduced(t, compressor, {"batch_buckets": u})
                                          for u in ("always", "never")], n)(tree)
    for a, b in zip(jax.tree.leaves(batch), jax.tree.leaves(traced), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-9)


def test_stochastic_buckets_draw_independent_streams_and_stay_unbiased():
    """QSGD through a batch: equal data in two buckets is coded with
    different random draws; averaged over keys the sum is unbiased."""
    row = normal(3, (N, 64))
    tree = [row, row]  # two equal leaves: two equal large-leaf buckets in one batch
    c = qc.qsgd(bits=2, bucket_size=16)
    fn = per_device(lambda t, k: qc.compressed_all_reduce(t, "d", c, k, bucket_bytes=128,
                                                          batch_buckets="always").value, N)
    outs = [fn(tree, jnp.stack([k] * N)) for k in jax.random.split(jax.random.key(1), 40)]
    assert not np.array_equal(np.asarray(outs[0][0]), np.asarray(outs[0][1]))
    mean = np.mean([np.asarray(o[0])[0] for o in outs], axis=0)
    exact = np.asarray(row.sum(0))
    assert np.abs(mean - exact).mean() < 0.25 * np.abs(exact).mean()


def _collective_ops(fn, tree) -> int:
    text = jax.jit(fn.mapped).lower(*fn.shard(tree)).compile().as_text()
    return sum(text.count(f" {op}(") for op in ("collective-permute", "all-gather"))


def test_the_program_does_not_grow_with_the_buckets_of_a_batch():
    # 2 full buckets and a last one, or 7 and a last one of the same shape
    batch = _reduce(ONEBIT, CAP, algorithm="pairwise", batch_buckets="always")
    ops = _collective_ops(batch, _tree(SMALL))
    assert ops == _collective_ops(batch, _tree(SMALL * 3)) > 0
    # a class of up to batch_buckets is traced once per bucket: 7 full buckets
    # are, with batch_buckets=7, and run as one batch with 6
    unrolled = _reduce(ONEBIT, CAP, algorithm="pairwise", batch_buckets=7)
    assert _collective_ops(unrolled, _tree(SMALL * 3)) > _collective_ops(unrolled, _tree(SMALL))
    six = _reduce(ONEBIT, CAP, algorithm="pairwise", batch_buckets=6)
    assert _collective_ops(six, _tree(SMALL * 3)) == ops


def _kernels(fn, tree) -> tuple[int, int]:
    return kernel_counts(jax.jit(fn.mapped).lower(*fn.shard(tree)).compile().as_text())


@pytest.mark.parametrize("compressor", [ONEBIT, qc.qsgd(bits=4)], ids=["onebit", "qsgd"])
def test_leaves_of_one_shape_share_their_kernels(compressor):
    """Each output leaf is its own kernel (its slice of the decoded batch), but
    the leaves of one shape are one program: XLA generates its code once. With
    the slices at static offsets the distinct kernels grew from 72 to 132
    (1-bit) and from 78 to 136 (QSGD) between these two trees."""
    fn = per_device(lambda t: qc.compressed_all_reduce(t, "d", compressor, jax.random.key(0),
                                                       bucket_bytes=CAP).value, N)
    small = _kernels(fn, _tree(SMALL * 3 + LARGE))
    large = _kernels(fn, _tree(SMALL * 12 + LARGE * 4))
    assert large[0] > small[0] + 40  # one kernel per leaf at least
    assert large[1] <= small[1] + 2  # a last bucket of another length may add one


def test_runtime_offsets_are_exact_and_not_folded():
    def fn(x):
        at = runtime_offsets(x, [0, 5, 5, 2**31 + 7])
        return jnp.stack([at[o] for o in (0, 5, 2**31 + 7)])

    x = jnp.arange(6.0)
    np.testing.assert_array_equal(jax.jit(fn)(x), np.array([0, 5, 2**31 + 7], np.uint32))
    assert " sort(" in jax.jit(fn).lower(x).compile().as_text()  # not constant-folded
    # NaN keys, bool and one-value anchors, and a batch
    np.testing.assert_array_equal(fn(jnp.full(3, jnp.nan)), [0, 5, 2**31 + 7])
    np.testing.assert_array_equal(fn(jnp.ones(2, bool)), [0, 5, 2**31 + 7])
    np.testing.assert_array_equal(fn(jnp.ones(1)), [0, 5, 2**31 + 7])
    np.testing.assert_array_equal(jax.vmap(fn)(jnp.ones((3, 4))), [[0, 5, 2**31 + 7]] * 3)


def test_runtime_slices_cut_what_static_slices_cut():
    x = jnp.arange(2 * 96.0).reshape(2, 96)
    starts, sizes = [0, 24, 48, 48], [24, 24, 48, 0]
    got = jax.jit(lambda x: runtime_slices(x, starts, sizes, axis=1))(x)
    for g, s, n in zip(got, starts, sizes, strict=True):
        np.testing.assert_array_equal(g, x[:, s:s + n])


def test_ring_all_reduce_of_many_buckets():
    """ring_all_reduce batches equal buckets too (the fused stream's, and the
    equal large leaves reduced alone): exact sums either way."""
    tree = _tree(SMALL * 3 + LARGE)
    for unroll in ("always", "never"):
        fn = per_device(lambda t, u=unroll: qc.ring_all_reduce(t, "d", bucket_bytes=CAP,
                                                               batch_buckets=u), N)
        for got, leaf in zip(fn(tree), tree, strict=True):
            np.testing.assert_allclose(np.asarray(got)[0], np.asarray(leaf).sum(0),
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [-1, 1.5, True, None, "16", "Auto", "batch"])
def test_batch_buckets_is_checked(value):
    with pytest.raises(ValueError,
                       match="batch_buckets must be 'auto', 'always', 'never' or an integer"):
        _reduce(ONEBIT, CAP, batch_buckets=value)(_tree(SMALL))


def _ppermutes(shapes, **kwargs) -> int:
    """ppermutes in the traced 1-bit all-reduce of float32 leaves ``shapes`` on 2
    devices (abstract: nothing is allocated)."""
    from tests.helpers import count_primitives, mesh_of

    fn = jax.shard_map(lambda t: qc.compressed_all_reduce(t, "d", ONEBIT, **kwargs).value,
                       mesh=mesh_of(N), in_specs=jax.sharding.PartitionSpec(),
                       out_specs=jax.sharding.PartitionSpec())
    tree = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return count_primitives(jax.make_jaxpr(fn)(tree).jaxpr, "ppermute")


def test_auto_batches_small_buckets_and_large_leaves_one_by_one():
    """``batch_buckets="auto"`` (the default): equal buckets of at most 4 MiB
    run as one batch; leaves over 4 MiB reduced alone are traced one by one,
    up to 16 of one shape, and batched beyond that."""
    small, large = (1 << 20,), (3 << 20,)            # 4 MiB and 12 MiB of float32
    one = _ppermutes([small])
    assert one > 0
    assert _ppermutes([small] * 6) == one                        # one batch
    assert _ppermutes([large] * 3) == 3 * one                    # one by one
    assert _ppermutes([large] * 16) == 16 * one
    assert _ppermutes([large] * 17) == one                       # one batch
    assert _ppermutes([large] * 3, batch_buckets="always") == one
    assert _ppermutes([small] * 6, batch_buckets="never") == 6 * one
    assert qc.runs_batched(2, qc.AUTO_BATCH_BYTES) and not qc.runs_batched(
        2, qc.AUTO_BATCH_BYTES + 1)
    assert qc.runs_batched(qc.AUTO_TRACE_LIMIT + 1, 1 << 30)


@pytest.mark.parametrize("unroll", ["always", "never"], ids=["batch", "unrolled"])
@pytest.mark.parametrize("compressor", [ONEBIT, qc.qsgd(bits=4, bucket_size=16)])
def test_wire_bytes_count_every_bucket(compressor, unroll):
    tree = _tree(SMALL + LARGE)
    fn = _reduce(compressor, CAP, algorithm="pairwise", batch_buckets=unroll)
    sent = qc.wire_bytes(fn.mapped, *fn.shard(tree))
    want = 0
    for seg in plan_segments([leaf[0] for leaf in tree], compressor.grouping,
                             compressor.block, N, bucket_bytes=CAP):
        for count, per_chunk in seg.parts:
            layout = seg.layout(per_chunk)
            kwargs = ({"valid": jnp.zeros(per_chunk, jnp.int32)}
                      if compressor.masks_padding and seg.bucket_valid() is not None else {})
            payload = jax.eval_shape(functools.partial(compressor.encode, **kwargs),
                                     jnp.zeros(layout.chunk_shape), jax.random.key(0))
            want += count * 2 * (N - 1) * qc.payload_bytes(payload)
    assert sent == want
