"""Golomb-Rice coding of sorted sparse indices, and the sparse coding switch.

Dryden et al., "Communication Quantization for Data-parallel Training of Deep
Neural Networks", section 3.2: the positions of the sent entries "are quite
amenable to delta encoding followed by lossless compression using Golomb-Rice
coding" (Rice and Plaunt 1971). Sent indices ``i_0 < i_1 < ...`` become gaps
``d_0 = i_0``, ``d_j = i_j - i_{j-1} - 1 >= 0``; with Rice parameter ``k``
each gap is the unary quotient ``q = d >> k`` (``q`` zeros then a one) and
the ``k``-bit remainder ``d & (2**k - 1)``: ``q + 1 + k`` bits.

Layout (a deviation in bit order only, not in size): Rice's stream interleaves
``unary, remainder, unary, ...``, which only a serial loop can decode. Here the
uint32 ``stream`` holds the same bits in two sections, each LSB-first as in
`qcollect.pack_bits`: first the remainders of all ``capacity`` slots at fixed
``k``-bit offsets (``ceil(capacity * k / 32)`` words), then the unary codes
back to back (``ceil(unary_bits / 32)`` words). Every one-bit of the unary
section ends one code, so code ``j``'s quotient is the gap between the
``j``-th and ``(j-1)``-th one-bits: encode and decode are prefix sums and a
compaction, fully parallel. Signs travel as a separate packed bit array.

Static capacity: the gaps of ``c`` sorted indices below ``n`` sum to at most
``n - c``, so the unary section never needs more than
``unary_bits = capacity + (n - capacity) >> k`` bits. The stream is sized for
that worst case: it cannot overflow and every round trip is exact. The default
``k`` minimises that worst-case size, which is also close to the optimal
Rice parameter for geometric gaps at density ``capacity / n`` (about
``log2(ln 2 * n / capacity)``).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from qcollect.checks import check_choice, check_int
from qcollect.coding._packing import pack_bits, unpack_bits
from qcollect.coding._sparse import EMPTY_INDEX, compact_words, from_words, to_words

__all__ = ["CODINGS", "rice_parameter", "stream_layout", "rice_encode", "rice_decode",
           "encode_entries", "decode_entries", "check_coding"]

CODINGS = ("words", "golomb_rice")
#: How a sparse payload stores its indices: one of `CODINGS`.
Coding = Literal["words", "golomb_rice"]
MAX_RICE_K = 30


def check_coding(coding: Coding, rice_k: int | None) -> int | None:
    """Validates ``coding`` and ``rice_k`` (None: automatic, else 0..30, golomb only)."""
    check_choice("coding", coding, CODINGS)
    rice_k = check_int("rice_k", rice_k, low=0, high=MAX_RICE_K, allow_none=True)
    if rice_k is not None and coding != "golomb_rice":
        raise ValueError(f"rice_k applies to coding='golomb_rice' only, got rice_k={rice_k} "
                         f"with coding={coding!r}")
    return rice_k


def rice_parameter(size: int, capacity: int) -> int:
    """The ``k`` in 0..30 that minimises the worst-case stream bits for ``capacity``
    sorted indices below ``size``: ``capacity * (k + 1) + (size - capacity) >> k``."""
    spare = size - capacity
    return int(np.argmin([capacity * (k + 1) + (spare >> k) for k in range(MAX_RICE_K + 1)]))


def stream_layout(size: int, capacity: int, k: int) -> tuple[int, int]:
    """``(remainder_words, unary_bits)`` of the stream; its length is
    ``remainder_words + ceil(unary_bits / 32)`` uint32 words."""
    # At most size <= 2**31 - 1 bits, so positions fit the int32 compaction.
    return -(-capacity * k // 32), capacity + ((size - capacity) >> k)


def rice_encode(idx: jax.Array, count: jax.Array, size: int, k: int) -> jax.Array:
    """Rice-codes sorted indices into the static uint32 stream.

    Args:
      idx: int32 ``(capacity,)``, increasing in the first ``count`` slots.
      count: int32 number of valid slots.
      size: static array length, every index is below it.
      k: Rice parameter.

    Returns:
      uint32 ``(remainder_words + ceil(unary_bits / 32),)`` stream.
    """
    capacity = idx.shape[0]
    rem_words, unary_bits = stream_layout(size, capacity, k)
    unary_words = -(-unary_bits // 32)
    if capacity == 0:
        return jnp.zeros((rem_words + unary_words,), jnp.uint32)
    valid = jnp.arange(capacity) < count
    idx = jnp.where(valid, idx, 0).astype(jnp.uint32)
    prev = jnp.concatenate([jnp.full((1,), 0xFFFFFFFF, jnp.uint32), idx[:-1]])
    gap = jnp.where(valid, idx - prev - jnp.uint32(1), jnp.uint32(0))
    parts = []
    if rem_words:
        rem = gap & jnp.uint32((1 << k) - 1)
        bits = (rem[:, None] >> jnp.arange(k, dtype=jnp.uint32)) & jnp.uint32(1)
        parts.append(pack_bits(bits.reshape(-1), 1)[:rem_words])
    # The j-th code's terminating one-bit sits at sum_{i<=j} (q_i + 1) - 1.
    ends = jnp.cumsum((gap >> k) + jnp.uint32(1), dtype=jnp.uint32) - jnp.uint32(1)
    word = jnp.where(valid, ends >> 5, jnp.uint32(unary_words)).astype(jnp.int32)
    unary = jnp.zeros((unary_words,), jnp.uint32).at[word].add(
        jnp.uint32(1) << (ends & jnp.uint32(31)), mode="drop")  # disjoint bits: add == or
    parts.append(unary)
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def rice_decode(stream: jax.Array, count: jax.Array, size: int, capacity: int,
                k: int) -> jax.Array:
    """Inverse of `rice_encode`: int32 ``(capacity,)`` indices, ``EMPTY_INDEX``
    after the first ``count`` slots."""
    rem_words, unary_bits = stream_layout(size, capacity, k)
    if capacity == 0:
        return jnp.zeros((0,), jnp.int32)
    slot = jnp.arange(capacity)
    count = jnp.minimum(count, capacity)
    ends, _ = compact_words(stream[rem_words:], unary_bits, capacity)
    prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), ends[:-1]])
    quot = (ends - prev - 1).astype(jnp.uint32)
    if rem_words:
        bits = unpack_bits(stream[:rem_words], 1, capacity * k).reshape(capacity, k)
        rem = jnp.sum(bits << jnp.arange(k, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)
    else:
        rem = jnp.zeros((capacity,), jnp.uint32)
    gap = jnp.where(slot < count, (quot << k) | rem, jnp.uint32(0))
    idx = jnp.cumsum(gap + jnp.uint32(1), dtype=jnp.uint32) - jnp.uint32(1)
    return jnp.where(slot < count, idx.astype(jnp.int32), EMPTY_INDEX)


def encode_entries(coding: Coding, idx: jax.Array, count: jax.Array, positive: jax.Array,
                   size: int, k: int | None) -> dict[str, jax.Array]:
    """Wire arrays of the sent entries: ``{"words"}`` or ``{"stream", "signs"}``."""
    if coding == "words":
        return {"words": to_words(idx, positive)}
    k = rice_parameter(size, idx.shape[0]) if k is None else k
    positive = positive & (idx != EMPTY_INDEX)
    return {"stream": rice_encode(idx, count, size, k), "signs": pack_bits(positive, 1)}


def decode_entries(coding: Coding, arrays: dict[str, jax.Array], count: jax.Array, size: int,
                   capacity: int, k: int | None) -> tuple[jax.Array, jax.Array]:
    """Inverse of `encode_entries`: ``(idx, positive)``, ``EMPTY_INDEX`` in empty slots.

    Only the first ``count`` slots (from the header) are read, so an all-zero
    payload decodes to nothing.
    """
    if coding == "words":
        idx, positive = from_words(arrays["words"])
        valid = jnp.arange(capacity) < count
        return jnp.where(valid, idx, EMPTY_INDEX), positive
    k = rice_parameter(size, capacity) if k is None else k
    idx = rice_decode(arrays["stream"], count, size, capacity, k)
    positive = unpack_bits(arrays["signs"], 1, capacity) == 1
    return idx, positive
