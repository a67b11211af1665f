"""QSGD: unbiasedness, the variance bound, error per element, sizes, config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qcollect as qc
from tests.helpers import normal


def _decode_many(c, x, keys):
    return jax.jit(jax.vmap(lambda k: c.decode(c.encode(x, k))))(keys)


@settings(max_examples=8)  # a compile per example
@given(
    bits=st.sampled_from([2, 4, 8]),
    length=st.integers(1, 700),
    bucket=st.sampled_from([None, 16, 128]),
    norm=st.sampled_from(["max", "l2"]),
    seed=st.integers(0, 2**16),
)
def test_unbiased_within_variance_bound(bits, length, bucket, norm, seed):
    """E[Q(v)] = v, and ||mean of K draws - v||^2 stays within the QSGD variance bound / K.

    Per bucket of n values with s levels, E||Q(v) - v||^2 <= min(n/s^2, sqrt(n)/s) ||v||_2^2
    (Alistarh et al., Lemma 3.1; Grubic eq. 1). The max-norm scale is smaller than the 2-norm,
    so the same bound holds for it. Averaging K independent draws divides it by K.
    """
    c = qc.qsgd(bits=bits, bucket_size=bucket, norm=norm)
    s = 2 ** (bits - 1) - 1
    x = np.asarray(jax.random.laplace(jax.random.key(seed), (length,)))
    draws = 400
    keys = jax.random.split(jax.random.key(seed + 1), draws)
    q = np.asarray(_decode_many(c, jnp.asarray(x), keys))
    size = length if bucket is None else bucket
    bound = 0.0
    for start in range(0, length, size):
        v = x[start:start + size]
        n = v.size
        bound += min(n / s**2, np.sqrt(n) / s) * np.sum(v.astype(np.float64) ** 2)
    per_draw = np.mean(np.sum((q - x) ** 2, axis=1))
    assert per_draw <= 1.2 * bound + 1e-9  # the variance bound itself, measured
    mean_err = np.sum((q.mean(0) - x) ** 2)
    assert mean_err <= 4.0 * bound / draws + 1e-9  # unbiased: the mean converges


def test_bias_is_statistically_zero_per_element():
    x = jnp.array([0.3, -0.77, 0.01, 1.0, -0.5, 0.123] * 10)
    q = np.asarray(_decode_many(qc.qsgd(bits=2, bucket_size=None), x,
                                jax.random.split(jax.random.key(0), 20000)))
    std_err = q.std(0) / np.sqrt(q.shape[0])
    assert np.all(np.abs(q.mean(0) - np.asarray(x)) <= 5 * std_err + 1e-7)


@settings(max_examples=8)  # a compile per example
@given(
    bits=st.sampled_from([2, 4, 8, 16]),
    length=st.integers(1, 3000),
    norm=st.sampled_from(["max", "l2"]),
    stochastic=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_error_per_element_within_one_level(bits, length, norm, stochastic, seed):
    c = qc.qsgd(bits=bits, norm=norm, stochastic=stochastic)
    x = np.asarray(normal(seed, (length,)), np.float64)  # no draw compiled per length
    payload = jax.jit(c.encode)(jnp.asarray(x, jnp.float32), jax.random.key(seed))
    x_hat = np.asarray(jax.jit(c.decode)(payload), np.float64)
    s = 2 ** (bits - 1) - 1
    bucket = qc.QSGD_BUCKET_SIZES[bits]
    step = np.repeat(np.asarray(payload["scale"], np.float64) / s, bucket)[:length]
    tol = 1e-6 * np.abs(x) + 1e-7
    if stochastic:
        assert np.all(np.abs(x_hat - x) <= step + tol)
    else:
        assert np.all(np.abs(x_hat - x) <= step / 2 + tol)
    assert np.all(np.sign(x_hat) * np.sign(x) >= 0)  # never flips a sign


def test_nearest_is_deterministic_and_exact_on_levels():
    c = qc.qsgd(bits=4, stochastic=False)
    x = jnp.array([-7.0, -3.0, 0.0, 1.0, 7.0]) / 7.0
    np.testing.assert_allclose(np.asarray(c.decode(c.encode(x))), np.asarray(x), rtol=1e-6)


def test_codes_are_sign_and_level_packed():
    c = qc.qsgd(bits=4, bucket_size=4, stochastic=False)
    payload = c.encode(jnp.array([1.0, -1.0, 0.0, -3.0 / 7.0]))
    codes = np.asarray(qc.unpack_bits(payload["codes"], 4, 4))
    np.testing.assert_array_equal(codes, [7, 8 | 7, 0, 8 | 3])
    np.testing.assert_allclose(np.asarray(payload["scale"]), [1.0])


@pytest.mark.parametrize("bits,bucket,n,expected", [
    (2, "default", 1000, 4 * 63 + 4 * 8),
    (4, "default", 1000, 4 * 125 + 4 * 2),
    (8, "default", 1000, 4 * 250 + 4 * 2),
    (16, "default", 1000, 4 * 500 + 4 * 1),
    (4, None, 1000, 4 * 125 + 4),
    (4, 7, 13, 4 * 2 + 4 * 2),
    (8, 512, 0, 0),
])
def test_payload_bytes_formula(bits, bucket, n, expected):
    # 4 * ceil(n * bits / 32) + 4 * ceil(n / bucket)
    c = qc.qsgd(bits=bits, bucket_size=bucket)
    assert qc.payload_bytes(c.encode(jnp.ones(n), jax.random.key(0))) == expected


def test_default_bucket_sizes_follow_grubic():
    assert qc.QSGD_BUCKET_SIZES == {2: 128, 4: 512, 8: 512, 16: 8192}
    assert qc.qsgd(bits=2).name == "qsgd/b2/128/max"


def test_different_keys_give_different_draws_and_same_key_same_draw():
    c = qc.qsgd(bits=2)
    x = jax.random.normal(jax.random.key(0), (1000,))
    a, b, a2 = (c.encode(x, jax.random.key(k))["codes"] for k in (1, 2, 1))
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a2))


@pytest.mark.parametrize("kwargs,arg", [
    (dict(bits=3), "bits"),
    (dict(bits=1), "bits"),
    (dict(bucket_size=0), "bucket_size"),
    (dict(bucket_size="big"), "bucket_size"),
    (dict(norm="l1"), "norm"),
    (dict(stochastic="yes"), "stochastic"),
])
def test_bad_config(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        qc.qsgd(**kwargs)
