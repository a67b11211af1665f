"""Adaptive quantization (Dryden et al. section 3.3) against numpy references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qcollect as qc
from qcollect.compressors._groups import bucket_groups, column_groups, sample_within_groups, to_view
from tests.helpers import normal, per_device

EMPTY = 0xFFFFFFFF
_JITTED = {}


def roundtrip(c, x, key=None):
    """(payload, decoded) from one jitted encode+decode, cached per wire format."""
    if c.name not in _JITTED:
        _JITTED[c.name] = jax.jit(lambda x, k: (c.encode(x, k), c.decode(c.encode(x, k))))
    p, y = _JITTED[c.name](x, key)
    return p, np.asarray(y)


def group_indices(shape, grouping, bucket_size):
    """Flat indices of each group, increasing."""
    size = math.prod(shape)
    flat = np.arange(size)
    if grouping == "bucket":
        return [flat[i:i + bucket_size] for i in range(0, size, bucket_size)]
    return list(flat.reshape(qc.matrix_view(tuple(shape))).T)


def sent_indices(p):
    words = np.asarray(p["words"])
    return np.sort(words[words != EMPTY] & 0x7FFFFFFF)


def reference(x, pi, grouping="column", bucket_size=512):
    """numpy exact mode: per group and sign the ceil(k/pi) largest |v| (ties: lower index)."""
    v = np.asarray(x, np.float32).ravel()
    out = np.zeros(v.shape, np.float32)
    sent, pos_means, neg_means = [], [], []
    for g in group_indices(np.shape(x), grouping, bucket_size):
        for side, means in ((v[g] >= 0, pos_means), (v[g] < 0, neg_means)):
            ids = g[side]
            s = int(np.ceil(np.float32(len(ids)) / np.float32(pi)))
            top = ids[np.argsort(-np.abs(v[ids]), kind="stable")][:s]
            mean = np.float32(v[top].sum(dtype=np.float32) / max(s, 1))
            out[top] = mean
            means.append(mean)
            sent.extend(top)
    return out.reshape(np.shape(x)), np.sort(sent), np.array(pos_means), np.array(neg_means)


def check_exact(x, pi, grouping="column", bucket_size=512):
    c = qc.adaptive(pi, grouping=grouping, bucket_size=bucket_size)
    p, y = roundtrip(c, jnp.asarray(x))
    ref, sent, pos, neg = reference(x, pi, grouping, bucket_size)
    np.testing.assert_array_equal(sent_indices(p), sent)
    np.testing.assert_allclose(np.asarray(p["pos"]), pos, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(p["neg"]), neg, rtol=1e-6)
    np.testing.assert_allclose(y, ref, rtol=1e-6)
    assert int(p["header"]) == len(sent)


@settings(max_examples=12)
@given(shape=st.sampled_from([(0,), (1,), (7,), (31, 3), (2, 3, 4)]),
       pi=st.sampled_from([1.0, 2.5]), grouping=st.sampled_from(["column", "bucket"]),
       ties=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_exact_matches_numpy_reference(shape, pi, grouping, ties, seed):
    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    if ties:
        x = np.round(x, 0)  # many equal values and zeros
    check_exact(x, pi, grouping, bucket_size=10)


@pytest.mark.parametrize("pi", [1.0, 1.5, 64.0])  # bisection (k > 256) and top_k paths
@pytest.mark.parametrize("grouping", ["column", "bucket"])
def test_exact_tall_columns_with_ties(pi, grouping):
    x = np.random.default_rng(5).normal(size=(601, 3)).astype(np.float32)
    x[:100, 1] = 0.5
    x[200:300, 2] = -0.25
    check_exact(x, pi, grouping, bucket_size=600)


def test_sends_requested_proportion_per_column_within_one_entry():
    x = np.random.default_rng(2).normal(size=(1000, 6)).astype(np.float32)
    x[:, 3] = np.abs(x[:, 3])  # a column without negatives
    pi = 16.0
    p, _ = roundtrip(qc.adaptive(pi), jnp.asarray(x))
    idx = sent_indices(p)
    flat = x.ravel()
    for col in range(6):
        mine = idx[idx % 6 == col]
        n_pos, n_neg = np.sum(x[:, col] >= 0), np.sum(x[:, col] < 0)
        assert abs(np.sum(flat[mine] >= 0) - n_pos / pi) < 1
        assert abs(np.sum(flat[mine] < 0) - n_neg / pi) < 1


def test_docstring_example_and_payload_bytes():
    c = qc.adaptive(2)
    p, y = roundtrip(c, jnp.array([4.0, 2.0, 1.0, -1.0, -3.0]))
    np.testing.assert_array_equal(y, [3, 3, 0, 0, -3])
    x = jax.ShapeDtypeStruct((13, 5), jnp.float32)
    p = jax.eval_shape(qc.adaptive(4).encode, x)
    assert qc.payload_bytes(p) == 4 * (5 * 5) + 4 + 8 * 5  # ceil(13/4)+1 = 5 slots per column
    p = jax.eval_shape(qc.adaptive(4, grouping="bucket", bucket_size=8).encode, x)
    # 8 buckets of 8 (min(8, 2+1) = 3 slots) and one of 1 (1 slot)
    assert qc.payload_bytes(p) == 4 * (8 * 3 + 1) + 4 + 8 * 9
    p = jax.eval_shape(qc.adaptive(4, sample=10, capacity_scale=2.0).encode, x,
                       jax.random.key(0))
    assert qc.payload_bytes(p) == 4 * (5 * 9) + 4 + 8 * 5


def sampled_reference(x, pi, m, key, grouping, bucket_size):
    """numpy mirror of the sampled thresholds and means, on the same samples."""
    shape = np.shape(x)
    groups = bucket_groups(shape, bucket_size) if grouping == "bucket" else column_groups(shape)
    picks = np.asarray(sample_within_groups(to_view(jnp.asarray(x), groups), groups, key, m))
    v = np.asarray(x, np.float32).ravel()
    passed, pos_means, neg_means = [], [], []
    for g, pk in zip(group_indices(shape, grouping, bucket_size), picks, strict=True):
        for sign, means in ((1, pos_means), (-1, neg_means)):
            side = pk >= 0 if sign == 1 else pk < 0
            mags = np.sort(np.abs(pk[side]))[::-1]
            if not len(mags):
                means.append(0.0)
                continue
            s = max(1, int(np.round(np.float32(len(mags)) / np.float32(pi))))
            means.append(sign * mags[:s].mean())
            data_side = v[g] >= 0 if sign == 1 else v[g] < 0
            passed.extend(g[data_side & (np.abs(v[g]) >= mags[s - 1])])
    return np.sort(passed), np.array(pos_means), np.array(neg_means)


@pytest.mark.parametrize("grouping", ["column", "bucket"])
def test_sampled_matches_numpy_on_the_same_samples(grouping):
    x = np.random.default_rng(3).normal(size=(500, 4)).astype(np.float32)
    key = jax.random.key(11)
    c = qc.adaptive(16, sample=64, grouping=grouping, bucket_size=250, capacity_scale=3.0)
    p, y = roundtrip(c, jnp.asarray(x), key)
    passed, pos, neg = sampled_reference(x, 16, 64, key, grouping, 250)
    np.testing.assert_array_equal(sent_indices(p), passed)
    np.testing.assert_allclose(np.asarray(p["pos"]), pos, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(p["neg"]), neg, rtol=1e-5)
    # roughly the requested proportion, and decode uses the two means
    assert 0.5 / 16 < len(passed) / x.size < 2 / 16
    assert set(np.unique(y)) <= set(np.asarray(p["pos"])) | set(np.asarray(p["neg"])) | {0.0}


def test_sampled_overflow_keeps_largest_and_fills_capacity():
    x = np.random.default_rng(4).normal(size=(128, 8)).astype(np.float32)
    key = jax.random.key(1)
    c = qc.adaptive(64, sample=1, capacity_scale=1.0)
    p, y = roundtrip(c, jnp.asarray(x), key)
    cap = 8 * 3  # ceil(128/64) + 1 per column
    passed, _, _ = sampled_reference(x, 64, 1, key, "column", 512)
    assert len(passed) > cap
    flat = np.abs(x.ravel())
    keep = np.sort(passed[np.argsort(-flat[passed], kind="stable")][:cap])
    np.testing.assert_array_equal(sent_indices(p), keep)
    assert int(p["header"]) == cap


def test_sampled_needs_key_and_depends_on_it():
    c = qc.adaptive(8, sample=16)
    assert c.stochastic
    x = normal(0, (64, 4))
    with pytest.raises(ValueError, match="key"):
        c.encode(x)
    a = roundtrip(c, x, jax.random.key(1))[1]
    np.testing.assert_array_equal(a, roundtrip(c, x, jax.random.key(1))[1])
    assert not np.array_equal(a, roundtrip(c, x, jax.random.key(2))[1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtypes(dtype):
    x = normal(9, (37, 3)).astype(dtype)
    c = qc.adaptive(4)
    _, y = roundtrip(c, x)
    assert y.dtype == dtype and y.shape == (37, 3)
    ref, *_ = reference(np.asarray(x, np.float32), 4.0)
    np.testing.assert_allclose(y.astype(np.float32), ref.astype(dtype).astype(np.float32))


@pytest.mark.parametrize("sample", [None, 4])
@pytest.mark.parametrize("shape", [(0,), (1,), ()])
def test_tiny_and_empty(sample, shape):
    c = qc.adaptive(2, sample=sample)
    x = jnp.full(shape, -1.5)
    _, y = roundtrip(c, x, jax.random.key(0))
    assert y.shape == shape
    np.testing.assert_array_equal(y, np.full(shape, -1.5))


@pytest.mark.parametrize("sample", [None, 8])
@pytest.mark.parametrize("coding", ["words", "golomb_rice"])
def test_non_finite_input_poisons_output(sample, coding):
    c = qc.adaptive(4, sample=sample, coding=coding)
    for bad in (np.nan, np.inf, -np.inf):
        x = jnp.zeros((16, 3)).at[5, 1].set(bad)
        _, y = roundtrip(c, x, jax.random.key(0))
        assert not np.isfinite(y).any()
    _, y = roundtrip(c, jnp.zeros((16, 3)), jax.random.key(0))
    np.testing.assert_array_equal(y, 0)


@pytest.mark.parametrize("sample", [None, 8])
def test_golomb_coding_decodes_like_words(sample):
    x = normal(4, (16, 3))  # the shapes of the test above
    a = roundtrip(qc.adaptive(4, sample=sample), x, jax.random.key(3))[1]
    b = roundtrip(qc.adaptive(4, sample=sample, coding="golomb_rice"), x, jax.random.key(3))[1]
    np.testing.assert_array_equal(a, b)
    assert np.count_nonzero(a) > 0


def test_vmap_exact_matches_reference():
    c = qc.adaptive(4, grouping="bucket", bucket_size=16)
    xs = normal(3, (3, 50))
    ys = jax.jit(jax.vmap(lambda x: c.decode(c.encode(x))))(xs)
    for x, y in zip(np.asarray(xs), np.asarray(ys), strict=True):
        np.testing.assert_allclose(y, reference(x, 4.0, "bucket", 16)[0], rtol=1e-6)


def test_vmap_sampled_matches_per_example():
    c = qc.adaptive(4, sample=8)  # the compressor and shape of the tests above
    xs = normal(3, (3, 16, 3))
    keys = jax.random.split(jax.random.key(5), 3)
    ys = jax.jit(jax.vmap(lambda x, k: c.decode(c.encode(x, k))))(xs, keys)
    for x, k, y in zip(xs, keys, ys, strict=True):
        np.testing.assert_array_equal(y, roundtrip(c, x, k)[1])


@pytest.mark.parametrize("kwargs, arg", [
    (dict(proportion=0.5), "proportion"), (dict(proportion=float("inf")), "proportion"),
    (dict(sample=0), "sample"), (dict(grouping="row"), "grouping"),
    (dict(bucket_size=0), "bucket_size"), (dict(capacity_scale=0.9), "capacity_scale"),
    (dict(coding="rle"), "coding"), (dict(rice_k=2), "rice_k"),
])
def test_bad_config_raises(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        qc.adaptive(**kwargs)


@pytest.mark.parametrize("sample", [None, 1])
def test_inside_shard_map(sample):
    # sample=1 with capacity_scale=1 overflows: the bisection runs per device.
    c = qc.adaptive(64, sample=sample, capacity_scale=1.0)
    xs = normal(6, (2, 128, 8))
    keys = jax.random.split(jax.random.key(2), 2)
    ys = per_device(lambda x, k: c.decode(c.encode(x, k)), 2)(xs, keys)
    for x, k, y in zip(xs, keys, np.asarray(ys), strict=True):
        np.testing.assert_array_equal(y, roundtrip(c, x, k)[1])
