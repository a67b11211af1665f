"""Canonical length-limited Huffman codes and static-shape bit streams."""

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcollect.coding import _huffman as hf

K = 64  # one alphabet size for most tests: histograms are zero-padded to it


def huffman_cost(counts) -> int:
    """Total length of an (unlimited) Huffman code, heapq reference."""
    heap = [int(c) for c in counts if c > 0]
    if len(heap) <= 1:
        return sum(heap)  # one symbol: one bit each
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        merged = heapq.heappop(heap) + heapq.heappop(heap)
        cost += merged
        heapq.heappush(heap, merged)
    return cost


def limited_cost(counts, max_len) -> int:
    """Optimal length-limited cost: textbook package-merge on explicit item lists."""
    leaves = sorted((int(c), [i]) for i, c in enumerate(counts) if c > 0)
    if len(leaves) <= 1:
        return sum(c for c, _ in leaves)
    items = list(leaves)
    for _ in range(max_len - 1):
        packages = [(items[j][0] + items[j + 1][0], items[j][1] + items[j + 1][1])
                    for j in range(0, len(items) - 1, 2)]
        items = sorted(leaves + packages, key=lambda t: t[0])
    lengths = np.zeros(len(counts), np.int64)
    for _, symbols in items[: 2 * len(leaves) - 2]:
        for s in symbols:
            lengths[s] += 1
    return int(np.dot(lengths, counts))


lengths_fn = jax.jit(hf.code_lengths, static_argnums=1)
codes_fn = jax.jit(hf.canonical_codes, static_argnums=1)


def padded(counts):
    out = np.zeros(K, np.int64)
    out[: len(counts)] = counts
    return out


def check_code(counts, lengths, max_len):
    lengths = np.asarray(lengths).astype(np.int64)
    used = counts > 0
    assert np.all((lengths > 0) == used)
    assert lengths.max(initial=0) <= max_len
    kraft = np.sum(2.0 ** -lengths[used])
    if used.sum() >= 2:
        assert kraft == 1.0  # optimal codes are complete
    else:
        assert kraft <= 1.0


def check_prefix_free(lengths, codes):
    words = [format(int(c), f"0{int(n)}b")
             for c, n in zip(codes, lengths, strict=True) if n > 0]
    for i, a in enumerate(words):
        for j, b in enumerate(words):
            assert i == j or not b.startswith(a)


counts_strategy = st.lists(st.integers(0, 1000), min_size=1, max_size=K)


@given(counts_strategy)
def test_lengths_optimal_kraft_and_prefix_free(counts):
    counts = padded(counts)
    lengths = lengths_fn(jnp.asarray(counts), hf.MAX_CODE_LENGTH)
    check_code(counts, lengths, hf.MAX_CODE_LENGTH)
    assert int(np.dot(np.asarray(lengths, np.int64), counts)) == huffman_cost(counts)
    check_prefix_free(np.asarray(lengths), np.asarray(codes_fn(lengths, hf.MAX_CODE_LENGTH)))


@given(st.lists(st.integers(0, 5000), min_size=2, max_size=24), st.integers(5, 8))
def test_length_limit_is_optimal_under_the_limit(counts, max_len):
    counts = np.asarray(counts, np.int64)
    lengths = lengths_fn(jnp.asarray(counts), max_len)
    check_code(counts, lengths, max_len)
    cost = int(np.dot(np.asarray(lengths, np.int64), counts))
    assert cost == limited_cost(counts, max_len)
    assert cost >= huffman_cost(counts)


def test_fibonacci_counts_hit_the_limit():
    fib = [1, 1]
    while len(fib) < 30:
        fib.append(fib[-1] + fib[-2])
    counts = padded(fib)
    unlimited = huffman_cost(counts)
    lengths = np.asarray(lengths_fn(jnp.asarray(counts), hf.MAX_CODE_LENGTH))
    check_code(counts, lengths, hf.MAX_CODE_LENGTH)
    assert lengths.max() == hf.MAX_CODE_LENGTH  # Huffman alone would need 29 bits
    assert int(np.dot(lengths.astype(np.int64), counts)) == limited_cost(counts, 15) > unlimited


def test_canonical_codes_example():
    lengths = jnp.array([1, 3, 3, 2, 0], jnp.uint32)
    np.testing.assert_array_equal(codes_fn(lengths, 15), [0, 6, 7, 2, 0])
    np.testing.assert_array_equal(lengths_fn(jnp.array([5, 1, 1, 2, 0]), 15), lengths)


def test_too_many_symbols_for_the_limit_raises():
    with pytest.raises(ValueError, match="max_len"):
        hf.code_lengths(jnp.ones(40, jnp.int32), 5)


@jax.jit
def roundtrip(symbols):
    counts = jnp.bincount(symbols, length=K)
    lengths = hf.code_lengths(counts)
    codes = hf.canonical_codes(lengths)
    words = -(-symbols.shape[0] * hf.MAX_CODE_LENGTH // 32)
    stream, offsets, total = hf.write_codes(codes[symbols], lengths[symbols], words)
    out = {}
    for block in (1, 7, 64, max(symbols.shape[0], 1)):
        out[block] = hf.read_codes(stream, offsets[::block], hf.decode_table(lengths),
                                   symbols.shape[0], block)
    return out, total, jnp.sum(lengths[symbols])


def adversarial(kind, n, rng):
    if kind == "single":
        return np.full(n, 5)
    if kind == "two":
        return rng.integers(0, 2, n) * (K - 1)
    if kind == "outlier":
        s = np.zeros(n, np.int64)
        s[rng.integers(n)] = K - 1
        return s
    if kind == "distinct":
        return np.arange(n) % K
    if kind == "skewed":
        return np.minimum(rng.geometric(0.5, n) - 1, K - 1)
    return rng.integers(0, K, n)


@pytest.mark.parametrize("kind", ["single", "two", "outlier", "distinct", "skewed", "uniform"])
@pytest.mark.parametrize("n", [1, 2, 61, 997])
def test_stream_round_trip(kind, n):
    symbols = adversarial(kind, n, np.random.default_rng(n))
    decoded, total, expected = roundtrip(jnp.asarray(symbols, jnp.uint32))
    assert int(total) == int(expected)
    for block, out in decoded.items():
        np.testing.assert_array_equal(out, symbols, err_msg=f"block={block}")


@given(st.lists(st.integers(0, K - 1), min_size=61, max_size=61))
def test_stream_round_trip_random(symbols):
    decoded, _, _ = roundtrip(jnp.asarray(symbols, jnp.uint32))
    for out in decoded.values():
        np.testing.assert_array_equal(out, symbols)


def test_stream_bit_layout_is_msb_first():
    stream, offsets, total = jax.jit(hf.write_codes, static_argnums=2)(
        jnp.array([1, 0b110, 0xFFFF], jnp.uint32), jnp.array([1, 3, 32], jnp.uint32), 2)
    # bits: 1 | 110 | 0x0000FFFF over 32 bits -> 1110 0000 ... split across two words
    assert int(total) == 36
    np.testing.assert_array_equal(offsets, [0, 1, 4])
    np.testing.assert_array_equal(stream, [0xE0000FFF, 0xF0000000])
    np.testing.assert_array_equal(hf.read_fixed(stream, 4, 2), [0xE, 0x0])


def test_fixed_width_round_trip_all_widths():
    rng = np.random.default_rng(0)
    for bits in (1, 5, 9, 15, 32):
        values = rng.integers(0, 2**bits, 37, dtype=np.uint64).astype(np.uint32)
        stream, _, total = hf.write_codes(jnp.asarray(values), bits, -(-37 * bits // 32))
        assert int(total) == 37 * bits
        np.testing.assert_array_equal(hf.read_fixed(stream, bits, 37), values)


def test_empty_stream():
    decoded, total, _ = roundtrip(jnp.zeros(0, jnp.uint32))
    assert int(total) == 0
    assert all(out.shape == (0,) for out in decoded.values())
