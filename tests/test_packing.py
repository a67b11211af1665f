"""Bit packing: exact round trip, sizes and layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qcollect as qc


@given(
    bits=st.sampled_from([1, 2, 4, 8, 16]),
    word=st.sampled_from(["uint8", "uint32"]),
    length=st.integers(0, 300),
    batch=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_exact(bits, word, length, batch, seed):
    if bits > np.dtype(word).itemsize * 8:
        return
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**bits, size=(batch, length), dtype=np.uint32)
    words = jax.jit(lambda c: qc.pack_bits(c, bits, jnp.dtype(word)))(codes)
    assert words.dtype == np.dtype(word)
    assert words.shape == (batch, qc.packed_words(length, bits, jnp.dtype(word)))
    back = jax.jit(lambda w: qc.unpack_bits(w, bits, length))(words)
    np.testing.assert_array_equal(np.asarray(back), codes)


@pytest.mark.parametrize("bits,word,expected", [(1, "uint8", 13), (1, "uint32", 4),
                                                (4, "uint8", 50), (16, "uint32", 50)])
def test_packed_sizes(bits, word, expected):
    # 100 codes: ceil(100 * bits / word_bits) words.
    assert qc.packed_words(100, bits, jnp.dtype(word)) == expected


def test_layout_is_little_endian_within_word():
    words = qc.pack_bits(jnp.array([1, 0, 1, 1, 0, 0, 0, 0, 1], jnp.uint32), 1, jnp.uint8)
    np.testing.assert_array_equal(np.asarray(words), [0b1101, 0b1])
    words = qc.pack_bits(jnp.array([0x3, 0xA], jnp.uint32), 4, jnp.uint8)
    np.testing.assert_array_equal(np.asarray(words), [0xA3])


def test_packing_matches_numpy_packbits_for_one_bit():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2, 1001).astype(np.uint8)
    ours = np.asarray(qc.pack_bits(jnp.asarray(bits), 1, jnp.uint8))
    np.testing.assert_array_equal(ours, np.packbits(bits, bitorder="little"))


def test_high_bits_are_masked():
    words = qc.pack_bits(jnp.array([0xFF, 0x1], jnp.uint32), 2, jnp.uint8)
    np.testing.assert_array_equal(np.asarray(qc.unpack_bits(words, 2, 2)), [3, 1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(bits=3), "bits"),
    (dict(bits=16, word_dtype=jnp.uint8), "bits=16"),
    (dict(bits=4, word_dtype=jnp.int32), "word_dtype"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        qc.pack_bits(jnp.zeros(4, jnp.uint32), **kwargs)


def test_unpack_too_long():
    with pytest.raises(ValueError, match="length"):
        qc.unpack_bits(jnp.zeros(1, jnp.uint8), 1, 9)
