"""Seide 1-bit quantization against a numpy reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qcollect as qc
from tests.helpers import normal


def reference(x, grouping, bucket_size):
    """Dryden 3.1: per group, values >= 0 -> mean of non-negatives, else mean of negatives."""
    x = np.asarray(x, np.float64)
    if grouping == "column":
        mat = x.reshape(qc.matrix_view(x.shape))  # the last axis indexes the columns
        groups = [mat[:, j] for j in range(mat.shape[1])]
    else:
        flat = x.ravel()
        groups = [flat[i:i + bucket_size] for i in range(0, flat.size, bucket_size)]
    pos = np.array([g[g >= 0].mean() if np.any(g >= 0) else 0.0 for g in groups])
    neg = np.array([g[g < 0].mean() if np.any(g < 0) else 0.0 for g in groups])
    return pos, neg


@given(
    shape=st.sampled_from([(1,), (5,), (63,), (64,), (65,), (1000,), (7, 3), (16, 9, 2)]),
    grouping=st.sampled_from(["bucket", "column"]),
    bucket_size=st.sampled_from([1, 7, 32, 64, 100, 128]),
    seed=st.integers(0, 2**16),
    zeros=st.booleans(),
)
def test_means_match_reference(shape, grouping, bucket_size, seed, zeros):
    x = np.asarray(normal(seed, shape))
    if zeros:  # exact zeros (and -0.0) belong to the non-negative side
        x = np.where(np.abs(x) < 0.5, np.float32(0.0), x)
        x.ravel()[::3] = np.where(x.ravel()[::3] == 0, np.float32(-0.0), x.ravel()[::3])
    c = qc.onebit(grouping=grouping, bucket_size=bucket_size)
    payload = jax.jit(c.encode)(x)
    pos, neg = reference(x, grouping, bucket_size)
    np.testing.assert_allclose(np.asarray(payload["pos"]), pos, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(payload["neg"]), neg, rtol=1e-5, atol=1e-6)
    x_hat = np.asarray(jax.jit(c.decode)(payload))
    flat_x = x.ravel()
    if grouping == "column":
        idx = np.arange(flat_x.size) % qc.matrix_view(shape)[1]
    else:
        idx = np.arange(flat_x.size) // bucket_size
    want = np.where(flat_x >= 0, pos[idx], neg[idx])
    np.testing.assert_allclose(x_hat.ravel(), want, rtol=1e-5, atol=1e-6)


@functools.partial(jax.jit, static_argnums=1)
def _one_read(x, bucket):
    """`_bucket_statistics` of ``x`` in buckets of ``bucket``, compiled as the
    encoder runs it (one program, not a compile per operation)."""
    from qcollect.compressors import _onebit
    from qcollect.compressors._groups import bucket_groups, to_view

    groups = bucket_groups(x.shape, bucket)
    return _onebit._bucket_statistics(to_view(x, groups), groups)


@functools.partial(jax.jit, static_argnums=1)
def _separate_reads(x, bucket):
    """The sign words and both sums by reductions of their own, and the largest
    bucket's sum of magnitudes: a program apart from `_one_read`'s, so that
    the compiler cannot share an expression between the two."""
    from qcollect.compressors._groups import bucket_groups, flat_codes, overflow_safe_scale, to_view

    groups = bucket_groups(x.shape, bucket)
    view = to_view(x, groups)
    c = overflow_safe_scale(bucket)
    return (qc.pack_bits(flat_codes(view >= 0, groups), 1),
            0.5 * jnp.sum(view * c + jnp.abs(view * c), 1), jnp.sum(view * c, 1),
            jnp.abs(view * c).sum(1).max(initial=0.0))


@pytest.mark.parametrize("size", [0, 1, 31, 33, 64, 65, 1000, 65_536, 100_003])
def test_buckets_of_whole_words_are_coded_in_one_read(size):
    """Buckets of whole uint32 words take their sign words and both sums from one
    reduction (`_bucket_statistics`): the words of packing the signs, sums equal to
    separate reductions up to their order, and one kernel reading the input
    where three did; padding after the last value packs as 0."""
    x = normal(size, (size,)) * jnp.exp(normal((1, size), (size,)))
    for bucket in (32, 64, 128):
        bits, (pos, total) = _one_read(x, bucket)
        words, want_pos, want_total, largest = _separate_reads(x, bucket)
        np.testing.assert_array_equal(bits, words)
        scale = float(largest) + 1e-30
        np.testing.assert_allclose(pos, want_pos, rtol=0, atol=1e-6 * scale)
        np.testing.assert_allclose(total, want_total, rtol=0, atol=1e-6 * scale)
    if size == 65_536:  # whole buckets: no padded copy either
        whole = 4 * size
        reads = [k for k in qc.memory_report(qc.onebit().encode, x) if k.read >= whole]
        assert len(reads) == 1, reads


def test_bits_are_signs_packed_32_per_word():
    x = jnp.array([1.0, -1.0, 0.0, -0.0, -3.0] + [2.0] * 30)
    payload = qc.onebit().encode(x)
    assert payload["bits"].dtype == jnp.uint32 and payload["bits"].shape == (2,)
    bits = np.asarray(qc.unpack_bits(payload["bits"], 1, 35))
    np.testing.assert_array_equal(bits, [1, 0, 1, 1, 0] + [1] * 30)


def test_empty_side_decodes_sensibly():
    c = qc.onebit(bucket_size=4)
    x_hat = c.decode(c.encode(jnp.array([1.0, 2.0, 3.0, 6.0, -1.0, -3.0, -2.0, -2.0])))
    np.testing.assert_allclose(np.asarray(x_hat), [3, 3, 3, 3, -2, -2, -2, -2])


@pytest.mark.parametrize("shape,grouping,bucket,expected", [
    ((1000,), "bucket", 64, 4 * 32 + 8 * 16),
    ((1000,), "bucket", 1000, 4 * 32 + 8),
    ((100, 30), "column", 64, 4 * 94 + 8 * 30),
    ((0,), "bucket", 64, 0),
])
def test_payload_bytes_formula(shape, grouping, bucket, expected):
    # 4 * ceil(n / 32) + 8 * num_groups
    c = qc.onebit(grouping=grouping, bucket_size=bucket)
    assert qc.payload_bytes(c.encode(jnp.ones(shape))) == expected


def test_sampled_means_are_means_of_samples():
    # Every sample lands in a constant bucket, so sampled means are exact.
    x = jnp.repeat(jnp.array([2.0, -4.0, 1.0, -1.0]), 16)
    c = qc.onebit(bucket_size=16, sample=3)
    np.testing.assert_allclose(np.asarray(c.decode(c.encode(x, jax.random.key(0)))), x)


def test_sampled_means_approach_exact_means():
    x = normal(0, (64 * 1024,)) + 0.3
    exact = qc.onebit(bucket_size=1024).encode(x)
    sampled = qc.onebit(bucket_size=1024, sample=256).encode(x, jax.random.key(1))
    for side in ("pos", "neg"):
        diff = np.abs(np.asarray(sampled[side]) - np.asarray(exact[side]))
        assert np.median(diff) < 0.1  # sampling std of a 256-sample mean ~ 0.04
    assert not np.allclose(np.asarray(sampled["pos"]), np.asarray(exact["pos"]))


def test_sampled_draws_depend_on_key():
    x = normal(0, (4096,))
    c = qc.onebit(bucket_size=512, sample=8)
    a, b = c.encode(x, jax.random.key(1)), c.encode(x, jax.random.key(2))
    assert not np.array_equal(np.asarray(a["pos"]), np.asarray(b["pos"]))


@pytest.mark.parametrize("kwargs,arg", [
    (dict(grouping="row"), "grouping"),
    (dict(bucket_size=0), "bucket_size"),
    (dict(bucket_size=2.5), "bucket_size"),
    (dict(sample=0), "sample"),
    (dict(sample=True), "sample"),
])
def test_bad_config(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        qc.onebit(**kwargs)


F32_MAX = np.finfo(np.float32).max


def _at_the_maximum(shape, seed=0):
    """Values of exactly +-F32_MAX, signs at random."""
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], shape)
    return (signs * F32_MAX).astype(np.float32)


@pytest.mark.parametrize("kwargs", [dict(), dict(grouping="column"), dict(bucket_size=4),
                                    dict(bucket_size=100), dict(sample=8)], ids=str)
def test_values_at_the_float32_maximum_decode_finite(kwargs):
    """A side of a group whose values all are F32_MAX has mean F32_MAX: the
    rounding of the scaled sum and of the division can put it an ulp beyond,
    which scaling back turned into inf. Means saturate at +-F32_MAX instead."""
    c = qc.onebit(**kwargs)
    x = _at_the_maximum((64, 64))
    out = np.asarray(jax.jit(lambda v, k: c.decode(c.encode(v, k)))(x, jax.random.key(0)))
    assert np.isfinite(out).all(), f"{np.sum(~np.isfinite(out))} of {out.size} non-finite"
    if "sample" not in kwargs:  # a side no sample falls on decodes 0
        np.testing.assert_allclose(out, x, rtol=1e-6)


@pytest.mark.parametrize("algorithm", ["ring_requantize", "pairwise"])
def test_all_reduce_of_values_at_the_float32_maximum_is_finite(algorithm):
    """Through the collective, on a tree: one device holds +-F32_MAX (the others
    zeros, so the exact sum is representable) beside a small leaf; every device's
    result and contribution are finite and the sum is the maximum's."""
    from tests.helpers import per_device

    n = 4
    big = np.zeros((n, 32, 64), np.float32)
    big[1] = _at_the_maximum((32, 64), seed=1)
    tree = {"max": jnp.asarray(big),
            "small": normal(2, (n, 300))}
    c = qc.onebit()
    run = per_device(lambda t, k: tuple(qc.compressed_all_reduce(
        t, "d", c, k, algorithm=algorithm, mean=False)[:2]), n)
    value, contributed = run(tree, jnp.stack([jax.random.key(0)] * n))
    for leaf in jax.tree.leaves((value, contributed)):
        assert np.isfinite(np.asarray(leaf)).all()
    np.testing.assert_allclose(np.asarray(value["max"]),
                               np.broadcast_to(big[1], (n, 32, 64)), rtol=1e-6)
