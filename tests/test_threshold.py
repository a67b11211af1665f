"""Threshold quantization (Dryden et al. section 3.2): selection, wire words, edge cases."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qcollect as qc
from tests.helpers import normal, per_device

CODINGS = ("words", "golomb_rice")


def reference(x, tau, cap):
    """numpy: |v| > tau, largest |v| first (ties: lower index) up to cap, +-tau."""
    v = np.asarray(x, np.float32).ravel()
    cand = np.flatnonzero(np.abs(v) > tau)
    order = cand[np.argsort(-np.abs(v[cand]), kind="stable")][:cap]
    out = np.zeros(v.shape, np.float32)
    out[order] = np.where(v[order] > 0, tau, -tau)
    return out.reshape(np.shape(x)), np.sort(order)


_JITTED = {}


def roundtrip(c, x):
    """(payload, decoded) from one jitted encode+decode, cached per wire format."""
    if c.name not in _JITTED:
        _JITTED[c.name] = jax.jit(lambda x: (c.encode(x), c.decode(c.encode(x))))
    p, y = _JITTED[c.name](x)
    return p, np.asarray(y)


@settings(max_examples=15)
@given(n=st.sampled_from([0, 1, 61, 300]), config=st.sampled_from([(0.7, 1.0), (0.05, 0.1)]),
       seed=st.integers(0, 2**31 - 1), coding=st.sampled_from(CODINGS))
def test_matches_numpy_reference(n, config, seed, coding):
    tau, frac = config
    x = np.random.default_rng(seed).normal(size=n).astype(np.float32)
    c = qc.threshold(tau, capacity=frac, coding=coding)
    p, y = roundtrip(c, jnp.asarray(x))
    cap = math.ceil(frac * n)
    ref, sent = reference(x, np.float32(tau), cap)
    np.testing.assert_array_equal(y, ref)
    assert int(p["header"]) == len(sent)


def test_sends_exactly_entries_above_tau_as_words():
    x = jnp.array([0.5, -3.0, 2.0, 1.0, -1.0, -1.5, 0.0], jnp.float32)
    p, y = roundtrip(qc.threshold(1.0, capacity=5), x)
    np.testing.assert_array_equal(y, [0, -1, 1, 0, 0, -1, 0])  # |v| == tau is not sent
    words = np.asarray(p["words"])
    # bit 31 = 1 for +tau, 0 for -tau (the paper's value bit), bits 0..30 the index.
    np.testing.assert_array_equal(words, [1, 2 | 1 << 31, 5, 0xFFFFFFFF, 0xFFFFFFFF])
    assert int(p["header"]) == 3
    assert qc.payload_bytes(p) == 4 * 5 + 4


@pytest.mark.parametrize("coding", CODINGS)
def test_overflow_keeps_largest_magnitudes(coding):
    x = np.random.default_rng(1).normal(size=1000).astype(np.float32)
    x[[3, 500, 999]] = [40.0, -50.0, 30.0]
    c = qc.threshold(0.1, capacity=3, coding=coding)
    p, y = roundtrip(c, jnp.asarray(x))
    np.testing.assert_array_equal(np.flatnonzero(y), [3, 500, 999])
    np.testing.assert_array_equal(y[[3, 500, 999]], np.float32([0.1, -0.1, 0.1]))
    ref, _ = reference(x, np.float32(0.1), 50)
    np.testing.assert_array_equal(roundtrip(qc.threshold(0.1, capacity=50, coding=coding),
                                            jnp.asarray(x))[1], ref)


@pytest.mark.parametrize("coding", CODINGS)
def test_overflow_ties_go_to_lower_index(coding):
    x = jnp.full((37,), -2.0).at[20].set(5.0)
    _, y = roundtrip(qc.threshold(1.0, capacity=4, coding=coding), x)
    expect = np.zeros(37, np.float32)
    expect[[0, 1, 2]] = -1.0
    expect[20] = 1.0
    np.testing.assert_array_equal(y, expect)


@pytest.mark.parametrize("coding", CODINGS)
def test_dtypes_and_lengths(coding):
    """Odd lengths and 16-bit dtypes, all in one program."""
    cases = [(jnp.float32, (0,)), (jnp.float32, (1,)), (jnp.float32, ()), (jnp.float32, (97,)),
             (jnp.bfloat16, (31, 3)), (jnp.float16, (13,)), (jnp.bfloat16, (2,))]
    xs = [normal(7, shape, jnp.float32).astype(dtype)
          for dtype, shape in cases]
    c = qc.threshold(0.5, capacity=0.5, coding=coding)
    decoded = jax.jit(lambda xs: [c.decode(c.encode(x)) for x in xs])(xs)
    for (dtype, shape), x, y in zip(cases, xs, decoded, strict=True):
        assert y.shape == tuple(shape) and y.dtype == dtype, (dtype, shape)
        ref, _ = reference(np.asarray(x, np.float32), np.float32(0.5),
                           math.ceil(0.5 * math.prod(shape)))
        np.testing.assert_array_equal(np.asarray(y, np.float32), ref, err_msg=str((dtype, shape)))


@pytest.mark.parametrize("coding", CODINGS)
def test_all_zero_and_zero_capacity(coding):
    _, y = roundtrip(qc.threshold(0.5, capacity=0.25, coding=coding), jnp.zeros((64,)))
    np.testing.assert_array_equal(y, 0)
    p, y = roundtrip(qc.threshold(0.5, capacity=0, coding=coding), jnp.ones((64,)))
    np.testing.assert_array_equal(y, 0)
    assert int(p["header"]) == 0


@pytest.mark.parametrize("coding", CODINGS)
@pytest.mark.parametrize("capacity", [0, 1, 0.5])
def test_non_finite_input_poisons_output(coding, capacity):
    c = qc.threshold(1.0, capacity=capacity, coding=coding)
    for bad in (np.nan, np.inf, -np.inf):
        _, y = roundtrip(c, jnp.array([0.0, 0.1, bad, 3.0, -0.2], jnp.float32))
        assert not np.isfinite(y).any()
    p, _ = roundtrip(qc.threshold(1.0, coding=coding), jnp.array([0.0, 3.0]))
    assert int(p["header"]) >> 31 == 0


@pytest.mark.parametrize("coding", CODINGS)
def test_vmap_matches_per_example(coding):
    c = qc.threshold(1.0, capacity=0.2, coding=coding)
    xs = normal(3, (5, 41))
    ys = jax.jit(jax.vmap(lambda x: c.decode(c.encode(x))))(xs)
    for x, y in zip(xs, ys, strict=True):
        np.testing.assert_array_equal(y, roundtrip(c, x)[1])


def test_overflow_under_vmap_keeps_largest():
    c = qc.threshold(0.01, capacity=2)
    xs = jnp.array([[1.0, -5.0, 3.0, 0.5], [0.0, 0.0, 0.2, 0.0]])
    ys = jax.jit(jax.vmap(lambda x: c.decode(c.encode(x))))(xs)
    np.testing.assert_allclose(ys, [[0, -0.01, 0.01, 0], [0, 0, 0.01, 0]])


def test_payload_bytes_words():
    c = qc.threshold(1.0, capacity=0.125)
    p = jax.eval_shape(c.encode, jax.ShapeDtypeStruct((1000,), jnp.float32))
    assert qc.payload_bytes(p) == 4 * 125 + 4
    p = jax.eval_shape(qc.threshold(1.0, capacity=7000).encode,
                       jax.ShapeDtypeStruct((10, 100), jnp.bfloat16))
    assert qc.payload_bytes(p) == 4 * 1000 + 4  # capacity clipped to the size


def test_too_long_arrays_raise():
    c = qc.threshold(1.0)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        jax.eval_shape(c.encode, jax.ShapeDtypeStruct((2**31,), jnp.float32))


@pytest.mark.parametrize("kwargs, arg", [
    (dict(tau=0.0), "tau"), (dict(tau=-1.0), "tau"), (dict(tau=float("nan")), "tau"),
    (dict(tau=1.0, capacity=-1), "capacity"), (dict(tau=1.0, capacity=1.5), "capacity"),
    (dict(tau=1.0, capacity=0.0), "capacity"), (dict(tau=1.0, capacity=True), "capacity"),
    (dict(tau=1.0, coding="rle"), "coding"), (dict(tau=1.0, rice_k=3), "rice_k"),
    (dict(tau=1.0, coding="golomb_rice", rice_k=31), "rice_k"),
])
def test_bad_config_raises(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        qc.threshold(**kwargs)


def test_contract_fields_and_format_check():
    c = qc.threshold(1.0)
    assert not c.linear and not c.stochastic
    p = c.encode(jnp.ones(8))
    with pytest.raises(ValueError, match="format"):
        qc.threshold(2.0).decode(p)
    with pytest.raises(TypeError):
        c.encode(jnp.arange(8))


def test_zero_payload_decodes_to_zero_through_cond():
    c = qc.threshold(1.0, capacity=4)

    @jax.jit
    def f(x, flag):
        p = jax.lax.cond(flag, lambda p: p, lambda p: jax.tree.map(jnp.zeros_like, p), c.encode(x))
        return c.decode(p)

    x = jnp.array([3.0, -2.0, 0.0, 0.5])
    np.testing.assert_array_equal(f(x, True), [1, -1, 0, 0])
    np.testing.assert_array_equal(f(x, False), 0)


@pytest.mark.parametrize("coding", CODINGS)
def test_overflow_inside_shard_map(coding):
    c = qc.threshold(0.1, capacity=3, coding=coding)
    xs = normal(8, (2, 40))
    ys = per_device(lambda x: c.decode(c.encode(x)), 2)(xs)
    for x, y in zip(np.asarray(xs), np.asarray(ys), strict=True):
        np.testing.assert_array_equal(y, reference(x, np.float32(0.1), 3)[0])
