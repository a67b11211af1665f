"""Bit packing: k-bit unsigned codes into uint8 / uint32 words and back.

Layout (natural, little-endian within a word): along the last axis, code ``i``
lands in word ``i // per_word`` at bit offset ``(i % per_word) * bits``, with
``per_word = word_bits // bits``. The last word is zero-padded; unpacking takes
the original length and strips the padding. Every quantizer in qcollect packs
through this module, so a 1-bit payload really is 8 codes per byte.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qcollect.checks import check_choice

__all__ = ["pack_bits", "unpack_bits", "packed_words"]

CODE_BITS = (1, 2, 4, 8, 16)
WORD_DTYPES = {"uint8": jnp.uint8, "uint32": jnp.uint32}


def _word_bits(word_dtype: Any) -> int:
    name = np.dtype(word_dtype).name
    check_choice("word_dtype", name, tuple(WORD_DTYPES))
    return np.dtype(word_dtype).itemsize * 8


def _per_word(bits: int, word_dtype: Any) -> int:
    check_choice("bits", bits, CODE_BITS)
    word_bits = _word_bits(word_dtype)
    if bits > word_bits:
        raise ValueError(f"bits={bits} does not fit in a {np.dtype(word_dtype).name} word")
    return word_bits // bits


def packed_words(length: int, bits: int, word_dtype: Any = jnp.uint32) -> int:
    """Number of words that hold ``length`` codes of ``bits`` bits each.

    Static: the size of a packed array is known before anything is packed,
    so payload shapes never depend on data.

    Args:
      length: number of codes.
      bits: code width, one of 1, 2, 4, 8, 16.
      word_dtype: ``jnp.uint8`` or ``jnp.uint32``.

    Returns:
      ``ceil(length / (word_bits // bits))``.

    Raises:
      ValueError: another ``bits`` or ``word_dtype``, or codes wider than a word.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> qc.packed_words(1000, 4), qc.packed_words(5, 2, jnp.uint8)
      (125, 2)
    """
    per_word = _per_word(bits, word_dtype)
    return -(-length // per_word)


def pack_bits(codes: jax.Array, bits: int, word_dtype: Any = jnp.uint32) -> jax.Array:
    """Packs unsigned ``bits``-bit codes along the last axis into words.

    Every quantizer packs its codes through it, so ``k``-bit codes cost
    ``k`` bits on the wire (plus the padding of the last word).

    Args:
      codes: unsigned integer array ``(..., n)``; values must be ``< 2**bits``
        (higher bits are masked off).
      bits: code width, one of 1, 2, 4, 8, 16.
      word_dtype: ``jnp.uint8`` or ``jnp.uint32``.

    Returns:
      ``(..., packed_words(n, bits, word_dtype))`` array of ``word_dtype``.

    Raises:
      ValueError: another ``bits`` or ``word_dtype``, or codes wider than a word.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> qc.pack_bits(jnp.array([1, 0, 1, 1], jnp.uint8), 1, jnp.uint8)  # 0b1101
      Array([13], dtype=uint8)
    """
    per_word = _per_word(bits, word_dtype)
    n = codes.shape[-1]
    words = -(-n // per_word)
    codes = codes.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
    pad = words * per_word - n
    if pad:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
    codes = codes.reshape(codes.shape[:-1] + (words, per_word))
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * jnp.uint32(bits)
    # Fields are disjoint, so the sum is a bitwise OR (and XLA fuses it).
    packed = jnp.sum(codes << shifts, axis=-1, dtype=jnp.uint32)
    return packed.astype(word_dtype)


def unpack_bits(words: jax.Array, bits: int, length: int) -> jax.Array:
    """Inverse of `pack_bits`: the first ``length`` codes of the packed words.

    Args:
      words: ``(..., num_words)`` ``uint8`` or ``uint32`` words from
        `pack_bits` (the word size is read from their dtype).
      bits: the code width they were packed with.
      length: number of codes to return (the padding after them is dropped).

    Returns:
      ``(..., length)`` uint32 codes.

    Raises:
      ValueError: ``length`` exceeds the codes the words hold, or another
        ``bits`` or word dtype.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> words = qc.pack_bits(jnp.array([3, 0, 1, 2, 1], jnp.uint8), 2, jnp.uint8)
      >>> words, qc.unpack_bits(words, 2, 5)
      (Array([147,   1], dtype=uint8), Array([3, 0, 1, 2, 1], dtype=uint32))
    """
    per_word = _per_word(bits, words.dtype)
    if words.shape[-1] * per_word < length:
        raise ValueError(
            f"length={length} exceeds the {words.shape[-1] * per_word} codes "
            f"held by {words.shape[-1]} words"
        )
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * jnp.uint32(bits)
    codes = (words.astype(jnp.uint32)[..., None] >> shifts) & jnp.uint32((1 << bits) - 1)
    codes = codes.reshape(words.shape[:-1] + (words.shape[-1] * per_word,))
    return codes[..., :length]
