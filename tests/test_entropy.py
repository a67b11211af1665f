"""Oland & Raj entropy quantizer: N = H + c, bin centres, Huffman payloads."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qcollect as qc
from qcollect.compressors._entropy_stats import ROUND_TOL, sample_indices

KEY = jax.random.key(7)
FULL = qc.entropy(sample_fraction=1.0)
PAPER = qc.entropy()  # F = 0.03, M = 4, c = 6, ceiling 10
RAW = qc.entropy(sample_fraction=1.0, huffman=False)
PAPER_RAW = qc.entropy(huffman=False)
N = 997  # most tests share this length (and so their compiled functions)

_jitted = {}


def jitted(fn, **kw):
    key = (fn, tuple(sorted(kw.items())))
    if key not in _jitted:
        _jitted[key] = jax.jit(fn, **kw)
    return _jitted[key]


def encode(c, x, key=KEY, plan=None):
    if plan is None:
        return jitted(c.encode)(x, key)
    return jitted(c.encode, static_argnames="plan")(x, key, plan=plan)


def decode(c, payload):
    return jitted(c.decode)(payload)


def plan_of(c, x, key=KEY):
    return jax.tree.map(int, jitted(c.plan)(x, key))


# -- numpy references --------------------------------------------------------
def ref_quantize(x, w_min, w_max, bits):
    x = np.asarray(x, np.float32)
    span = np.float32(w_max) - np.float32(w_min)
    scale = np.float32(2**bits) / span if span > 0 else np.float32(0)
    t = (x - np.float32(w_min)) * scale
    return np.minimum(np.floor(np.maximum(t, 0)), 2**bits - 1).astype(np.int64)


def ref_entropy(q, bins):
    p = np.bincount(q, minlength=bins) / max(len(q), 1)
    p = p[p > 0]
    return float(-np.sum(p * np.log2(p)))


def ref_bits(x, fraction, prelim, floor, ceiling, key=KEY):
    x = np.asarray(x, np.float32).reshape(-1)
    picks = x[np.asarray(sample_indices(key, x.size, fraction))]
    h = ref_entropy(ref_quantize(picks, x.min(), x.max(), prelim), 2**prelim)
    return int(np.clip(math.ceil(h + floor - ROUND_TOL), floor, ceiling)), h


def centres(q, w_min, w_max, bits):
    step = np.float32(2.0**-bits)
    span = np.float32(w_max) - np.float32(w_min)
    return np.float32(w_min) + span * ((q.astype(np.float32) + np.float32(0.5)) * step)


def documented_bytes(n, symbols, words, block=1024, huffman=True):
    size = 8 + 4 + 4 * words  # range, bits, stream
    if huffman:
        size += 4 * math.ceil(symbols / 8) + 4 * math.ceil(n / block)
    return size


floats = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@st.composite
def arrays(draw):
    """Length-N float32 arrays: drawn values, repeated or among Gaussian noise."""
    values = np.asarray(draw(st.lists(floats, min_size=1, max_size=32)), np.float32)
    if draw(st.booleans()):
        return np.resize(values, N)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = rng.normal(0, draw(st.sampled_from([1e-3, 1.0, 1e3])), N).astype(np.float32)
    x[rng.choice(N, values.size, replace=False)] = values
    return x


def data(n, seed, kind="normal"):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.normal(0, 0.1, n).astype(np.float32)
    if kind == "laplace":  # peaked with long tails, like trained weights
        return rng.laplace(0, 0.01, n).astype(np.float32)
    return rng.uniform(-1, 1, n).astype(np.float32)


# -- the paper's formulae ----------------------------------------------------
@given(arrays())
def test_bits_formula_full_sample(values):
    x = jnp.asarray(values, jnp.float32)
    want, _ = ref_bits(values, 1.0, 4, 6, 10)
    assert plan_of(FULL, x).bits == want
    assert int(encode(FULL, x)["bits"][0]) == want


CONFIGS = {(4, 6, 10): PAPER, (4, 5, 10): qc.entropy(floor=5),
           (2, 3, 4): qc.entropy(prelim_bits=2, floor=3, ceiling=4)}


@pytest.mark.parametrize("kind", ["normal", "laplace", "uniform"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_bits_formula_on_the_same_sample(kind, config):
    x = data(N, 1, kind)
    want, h = ref_bits(x, 0.03, *config)
    assert 0 <= h <= config[0]
    assert plan_of(CONFIGS[config], jnp.asarray(x)).bits == want


@given(arrays())
def test_decode_is_the_bin_centre_of_each_value(values):
    x = np.asarray(values, np.float32)
    for c in (FULL, RAW):
        p = encode(c, jnp.asarray(x))
        bits = int(p["bits"][0])
        w_min, w_max = np.asarray(p["range"])
        assert (w_min, w_max) == (x.min(), x.max())
        q = ref_quantize(x, w_min, w_max, bits)
        y = np.asarray(decode(c, p))
        # XLA may fuse w_min + span * t into one FMA: allow a few ulp of the range.
        ulps = 4 * np.finfo(np.float32).eps * max(abs(w_min), abs(w_max), 1e-30)
        np.testing.assert_allclose(y, centres(q, w_min, w_max, bits), rtol=0, atol=ulps)
        if w_max > w_min:
            q_back = np.rint((y - np.float64(w_min)) / (np.float64(w_max) - w_min) * 2**bits - 0.5)
            np.testing.assert_array_equal(q_back, q)
        assert np.all(np.abs(y - x) <= (w_max - w_min) * 2.0**-bits * 0.5001 + ulps)


@pytest.mark.parametrize("kind", ["normal", "laplace", "uniform"])
def test_huffman_and_raw_decode_equal_and_huffman_is_near_entropy(kind):
    x = jnp.asarray(data(N, 2, kind))
    np.testing.assert_array_equal(decode(FULL, encode(FULL, x)), decode(RAW, encode(RAW, x)))
    plan = plan_of(FULL, x)
    q = ref_quantize(x, x.min(), x.max(), plan.bits)
    h = ref_entropy(q, 2**plan.bits)
    code_bits = plan.words * 32 / x.size
    assert h - 1e-9 <= code_bits <= h + 1 + 32 / x.size  # Huffman within one bit of H


# -- plans, static sizes and payload accounting --------------------------------
@pytest.mark.parametrize("n", [0, 1, 2, 13, N, 10007])
def test_payload_bytes_match_the_documented_size(n):
    x = jax.ShapeDtypeStruct((n,), jnp.float32)
    words = math.ceil(n * 10 / 32)
    assert qc.payload_bytes(jax.eval_shape(PAPER.encode, x, KEY)) == documented_bytes(
        n, 2**10, words)
    assert qc.payload_bytes(jax.eval_shape(PAPER_RAW.encode, x, KEY)) == documented_bytes(
        n, 0, words, huffman=False)
    plan = qc.EntropyPlan(bits=7, words=123)
    planned = jax.eval_shape(lambda v: PAPER.encode(v, plan=plan), x)
    assert qc.payload_bytes(planned) == documented_bytes(n, 2**7, 123)
    assert qc.payload_bytes(jax.eval_shape(PAPER_RAW.with_plan(plan).encode, x)) == (
        documented_bytes(n, 0, 123, huffman=False))


def test_raw_plan_is_n_times_bits():
    x = jnp.asarray(data(N, 3))
    plan = plan_of(PAPER_RAW, x)
    assert plan.bits == plan_of(PAPER, x).bits
    assert plan.words == math.ceil(N * plan.bits / 32)
    np.testing.assert_array_equal(decode(PAPER_RAW, encode(PAPER_RAW, x, plan=plan)),
                                  decode(PAPER, encode(PAPER, x)))


def test_plan_is_exact_and_with_plan_is_cached():
    x = jnp.asarray(data(N, 4, "laplace"))
    plan = plan_of(PAPER, x)
    p = encode(PAPER, x)
    assert int(p["bits"][0]) == plan.bits
    lengths = np.asarray(qc.unpack_bits(p["lengths"], 4, 2**10)).astype(np.int64)
    q = ref_quantize(x, x.min(), x.max(), plan.bits)
    assert plan.words == math.ceil(lengths[q].sum() / 32)
    assert np.all(np.asarray(p["stream"])[plan.words:] == 0)
    assert PAPER.with_plan(plan) is PAPER.with_plan(plan)
    planned = PAPER.with_plan(plan)
    assert not planned.stochastic
    assert planned.name == f"{PAPER.name}/plan/b{plan.bits}/w{plan.words}"
    pp = encode(PAPER, x, plan=plan)
    # The planned payload is the unplanned one cut to the planned sizes.
    assert pp["lengths"].shape == (2**plan.bits // 8,) and pp["stream"].shape == (plan.words,)
    for name, arr in pp.arrays.items():
        np.testing.assert_array_equal(arr, p[name][: arr.shape[0]], err_msg=name)
    np.testing.assert_array_equal(decode(PAPER, pp), decode(PAPER, p))


def test_a_too_small_plan_decodes_to_nan_never_silently_wrong():
    small = plan_of(PAPER, jnp.asarray(data(N, 5, "laplace")))
    wide = jnp.asarray(data(N, 5, "uniform"))
    out = decode(PAPER, encode(PAPER, wide, plan=small))
    assert np.all(np.isnan(out))


def test_plan_validation():
    with pytest.raises(ValueError, match="plan.bits"):
        PAPER.with_plan((3, 10))
    with pytest.raises(ValueError, match="plan.words"):
        PAPER.with_plan((7, -1))
    with pytest.raises(ValueError, match="plan"):
        jax.jit(lambda x, b: PAPER.encode(x, KEY, plan=(b, 10)))(jnp.ones(4), 7)


# -- contract edge cases --------------------------------------------------------
@pytest.mark.parametrize("dtype,shape", [
    (jnp.float32, (0,)), (jnp.float32, (1,)), (jnp.float32, (7,)), (jnp.float32, (13, 31)),
    (jnp.bfloat16, (N,)), (jnp.float16, (N,))])
def test_dtypes_and_shapes(dtype, shape):
    x = jnp.asarray(data(math.prod(shape), 6)).reshape(shape).astype(dtype)
    y = decode(PAPER, encode(PAPER, x))
    assert y.shape == shape and y.dtype == dtype
    if x.size:
        span = float(jnp.max(x.astype(jnp.float32)) - jnp.min(x.astype(jnp.float32)))
        err = np.max(np.abs(np.asarray(y, np.float32) - np.asarray(x, np.float32)))
        assert err <= span * 2.0**-6 / 2 + float(jnp.finfo(dtype).eps) * span + 1e-30


@pytest.mark.parametrize("value", [0.0, -3.25, 1e30])
def test_constant_input_decodes_exactly(value):
    x = jnp.full((N,), value, jnp.float32)
    for c in (FULL, RAW):
        p = encode(c, x)
        np.testing.assert_array_equal(decode(c, p), x)
        assert int(p["bits"][0]) == 6  # H = 0 -> N = c


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_gives_non_finite_output(bad):
    x = data(N, 7)
    x[11] = bad
    for c in (PAPER, RAW):
        y = np.asarray(decode(c, encode(c, jnp.asarray(x))))
        assert not np.any(np.isfinite(y))


def test_vmap_matches_per_example():
    xs = jnp.asarray(data(3 * N, 8, "laplace")).reshape(3, N)
    keys = jax.random.split(KEY, 3)
    batch = jax.jit(jax.vmap(PAPER.encode))(xs, keys)
    ys = jax.jit(jax.vmap(PAPER.decode))(batch)
    plans = jax.jit(jax.vmap(PAPER.plan))(xs, keys)
    for i in range(3):
        np.testing.assert_array_equal(ys[i], decode(PAPER, encode(PAPER, xs[i], keys[i])))
        assert int(plans.bits[i]) == plan_of(PAPER, xs[i], keys[i]).bits
    widest = qc.EntropyPlan(int(plans.bits.max()), int(plans.words.max()))
    shared = jax.jit(jax.vmap(lambda x: PAPER.decode(PAPER.encode(x, plan=widest))))(xs)
    assert np.all(np.isfinite(shared))


def test_stochastic_needs_a_key_and_full_sample_does_not():
    assert PAPER.stochastic and not FULL.stochastic and not PAPER.linear
    x = jax.ShapeDtypeStruct((N,), jnp.float32)
    with pytest.raises(ValueError, match="key"):
        jax.eval_shape(PAPER.encode, x)
    jax.eval_shape(FULL.encode, x)
    jax.eval_shape(FULL.plan, x)


@pytest.mark.parametrize("kwargs,name", [
    ({"sample_fraction": 0.0}, "sample_fraction"),
    ({"sample_fraction": 1.5}, "sample_fraction"),
    ({"prelim_bits": 0}, "prelim_bits"),
    ({"prelim_bits": 16}, "prelim_bits"),
    ({"floor": 0}, "floor"),
    ({"ceiling": 16}, "ceiling"),
    ({"floor": 8, "ceiling": 7}, "ceiling"),
    ({"huffman": "yes"}, "huffman"),
    ({"block_size": 0}, "block_size"),
])
def test_bad_config_raises_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        qc.entropy(**kwargs)


def test_format_mismatch_and_integer_input_raise():
    payload = jax.eval_shape(PAPER.encode, jax.ShapeDtypeStruct((N,), jnp.float32), KEY)
    with pytest.raises(ValueError, match="format"):
        jax.eval_shape(RAW.decode, payload)
    with pytest.raises(TypeError):
        jax.eval_shape(PAPER.encode, jax.ShapeDtypeStruct((N,), jnp.int32), KEY)


def test_single_block_stream():
    c = qc.entropy(block_size=None)
    x = jnp.asarray(data(N, 9, "laplace"))
    p = encode(c, x)
    assert p["blocks"].shape == (1,)
    np.testing.assert_array_equal(decode(c, p), decode(PAPER, encode(PAPER, x)))
