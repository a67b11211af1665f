"""Golomb-Rice coding of sparse indices (Dryden et al. section 3.2): exact round trips."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qcollect as qc
from qcollect.coding._golomb import rice_decode, rice_encode, rice_parameter, stream_layout
from qcollect.coding._sparse import EMPTY_INDEX
from tests.helpers import normal

_CODEC = {}


def codec(size, capacity, k):
    """A jitted encode -> (stream, decoded indices) for one static layout."""
    key = (size, capacity, k)
    if key not in _CODEC:
        def run(idx, count):
            stream = rice_encode(idx, count, size, k)
            return stream, rice_decode(stream, count, size, capacity, k)
        _CODEC[key] = jax.jit(run)
    return _CODEC[key]


def check_roundtrip(indices, size, capacity, k=None):
    indices = np.asarray(sorted(indices), np.int32)
    k = rice_parameter(size, capacity) if k is None else k
    slots = np.full(capacity, EMPTY_INDEX, np.int32)
    slots[: len(indices)] = indices
    stream, back = codec(size, capacity, k)(jnp.asarray(slots), jnp.int32(len(indices)))
    np.testing.assert_array_equal(np.asarray(back), slots)
    rem_words, unary_bits = stream_layout(size, capacity, k)
    assert stream.shape == (rem_words + math.ceil(unary_bits / 32),)
    assert stream.dtype == jnp.uint32
    # The coded length is Rice's: k + 1 + (gap >> k) bits per entry.
    gaps = np.diff(np.concatenate([[-1], indices.astype(np.int64)])) - 1
    unary_used = int(np.sum((gaps >> k) + 1))
    unary = np.unpackbits(np.asarray(stream[rem_words:]).view(np.uint8), bitorder="little")
    assert unary[unary_used:].sum() == 0
    assert unary[:unary_used].sum() == len(indices)
    return stream


@settings(max_examples=20)
@given(size=st.sampled_from([1, 2, 97, 1000]), data=st.data(),
       k=st.sampled_from([None, 0, 3]))
def test_random_index_sets_round_trip(size, data, k):
    capacity = data.draw(st.sampled_from([1, max(1, size // 10), size]))
    chosen = data.draw(st.sets(st.integers(0, size - 1), max_size=capacity))
    check_roundtrip(chosen, size, capacity, k)


@pytest.mark.parametrize("size, capacity, indices", [
    (1000, 5, []),                      # empty
    (1000, 5, [0]),                     # index 0
    (1000, 5, [999]),                   # last index, maximal first gap
    (1000, 2, [0, 999]),                # maximal delta
    (1000, 1000, range(1000)),          # all entries, zero gaps
    (1000, 10, range(990, 1000)),       # everything at the end
    (1, 1, [0]),
    (2**20, 3, [0, 2**19, 2**20 - 1]),  # huge gaps with small capacity
    (2**20, 64, np.arange(64) * (2**20 // 64) + 2**20 // 64 - 1),  # worst-case spread
])
@pytest.mark.parametrize("k", [None, 0, 1, 7, 30])
def test_adversarial_index_sets_round_trip(size, capacity, indices, k):
    check_roundtrip(list(indices), size, capacity, k)  # k=0: one unary bit per entry of x


def test_worst_case_fills_but_never_overflows_the_stream():
    size, capacity = 4096, 32
    k = rice_parameter(size, capacity)
    # One maximal gap, then the last capacity - 1 entries: every unary bit used.
    indices = np.arange(size - capacity, size)
    stream = check_roundtrip(indices, size, capacity)
    _, unary_bits = stream_layout(size, capacity, k)
    gaps = np.diff(np.concatenate([[-1], indices])) - 1
    assert int(np.sum((gaps >> k) + 1)) == unary_bits
    assert stream.size * 32 >= capacity * k + unary_bits


def test_rice_parameter_tracks_density():
    assert rice_parameter(1 << 20, (1 << 20) // 32) == 4  # log2(ln2 * 32) = 4.47
    assert rice_parameter(1000, 1000) == 0
    assert rice_parameter(1 << 20, 1) in (19, 20)  # equal worst cases
    assert rice_parameter(0, 0) >= 0


def test_threshold_golomb_decodes_like_words():
    n = 3001
    rng = np.random.default_rng(0)
    outlier = np.zeros(n)
    outlier[1234] = -9.0
    inputs = {"normal": rng.normal(size=n), "equal": np.full(n, 2.0), "outlier": outlier,
              "distinct": np.linspace(-3, 3, n), "last": np.eye(1, n, n - 1)[0] * 5}
    for cap in (0.05, 1.0):
        words = qc.threshold(1.0, capacity=cap)
        rice = qc.threshold(1.0, capacity=cap, coding="golomb_rice")
        both = jax.jit(lambda x, w=words, r=rice: (w.decode(w.encode(x)), r.decode(r.encode(x))))
        for name, x in inputs.items():
            a, b = both(jnp.asarray(x, jnp.float32))
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_golomb_payload_bytes_as_documented():
    n, cap = 100_000, 3125
    c = qc.threshold(1.0, capacity=cap, coding="golomb_rice")
    p = jax.eval_shape(c.encode, jax.ShapeDtypeStruct((n,), jnp.float32))
    k = rice_parameter(n, cap)
    words = (math.ceil(cap * k / 32) + math.ceil((cap + ((n - cap) >> k)) / 32)
             + math.ceil(cap / 32) + 1)
    assert qc.payload_bytes(p) == 4 * words
    assert set(p.arrays) == {"stream", "signs", "header"}
    # about 8 bits per slot at density 1/32 against 32 for plain words
    assert 8 * qc.payload_bytes(p) / cap < 8.5


def test_golomb_bits_per_sent_entry_on_normal_gradient():
    """Rice bits per sent entry at ~1/32 density: the measured figure (about 7 + 1 sign)."""
    n = 1 << 20
    x = normal(0, (n,))
    c = qc.threshold(2.154, capacity=1 / 16, coding="golomb_rice")
    p = jax.jit(c.encode)(x)
    sent = int(p["header"]) & 0x7FFFFFFF
    assert abs(sent / n - 1 / 32) < 0.002
    k = rice_parameter(n, n // 16)
    rem_words, _ = stream_layout(n, n // 16, k)
    unary = np.unpackbits(np.asarray(p["stream"][rem_words:]).view(np.uint8), bitorder="little")
    used = sent * k + np.flatnonzero(unary)[-1] + 1 + sent  # remainders + unary + signs
    assert 7.0 < used / sent < 9.0
    np.testing.assert_array_equal(np.asarray(jax.jit(c.decode)(p)),
                                  np.where(np.abs(x) > 2.154, np.sign(x) * 2.154, 0))


def test_vmap_golomb():
    c = qc.threshold(0.5, capacity=0.3, coding="golomb_rice")
    xs = normal(2, (4, 50))
    ys = jax.jit(jax.vmap(lambda x: c.decode(c.encode(x))))(xs)
    xs = np.asarray(xs)
    for x, y in zip(xs, np.asarray(ys), strict=True):
        cand = np.flatnonzero(np.abs(x) > 0.5)
        keep = np.sort(cand[np.argsort(-np.abs(x[cand]), kind="stable")][:15])
        ref = np.zeros(50, np.float32)
        ref[keep] = np.sign(x[keep]) * np.float32(0.5)
        np.testing.assert_array_equal(y, ref)

