"""Canonical, length-limited Huffman codes and bit streams with static shapes.

The "HuffmanCodebook", "Encode" and "Decode" steps of Oland and Raj,
"Reducing Communication Overhead in Distributed Learning by an Order of
Magnitude (Almost)", Algorithms 1 and 2 (lines 8-9 and 2-3), written so that
every array shape is fixed by the alphabet size and the element count alone:

* `code_lengths`: optimal code lengths under a length limit, by the
  package-merge (coin collector) algorithm of Larmore and Hirschberg, with one
  stable sort per level. When the unlimited Huffman code already fits the
  limit it has the same total cost as Huffman's (both are optimal).
* `canonical_codes` / `decode_table`: canonical codes (sorted by length, then
  symbol), so the code lengths alone define the code. A 2**max_len table maps
  the next ``max_len`` stream bits to ``(symbol, length)``.
* `write_codes`: element ``i`` starts at bit ``offset_i``, the exclusive
  cumulative sum of the lengths. Bits are MSB-first within big-endian uint32
  words (bit ``p`` is bit ``31 - p % 32`` of word ``p // 32``); a code of at
  most 32 bits straddles at most two words, so two scatter-adds (the fields
  are disjoint, so an add is a bitwise OR) write the whole stream.
* `read_codes`: ``lanes`` independent decoders, one per block of elements,
  each starting from its block's bit offset, walk their blocks in lockstep
  under one `lax.scan`; every step is one table look-up per lane.
  `read_fixed` reads fixed-width codes in parallel (random access).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "MAX_CODE_LENGTH",
    "canonical_codes",
    "code_lengths",
    "decode_table",
    "read_codes",
    "read_fixed",
    "write_codes",
]

#: Longest code (bits). 15 keeps a code length in one 4-bit field (as in
#: DEFLATE) and the decoding table at 2**15 entries.
MAX_CODE_LENGTH = 15

# Weight of an absent item in package-merge; the sum of two still fits int32.
_BIG = 2**30 - 1


def code_lengths(counts: jax.Array, max_len: int = MAX_CODE_LENGTH) -> jax.Array:
    """Optimal prefix-code lengths for a histogram, no code longer than ``max_len``.

    Package-merge: the list of level ``max_len`` is the sorted leaves; the
    list of each shallower level merges the leaves with the pairwise sums
    ("packages") of the deeper list. The first ``2 * (used - 1)`` items of the
    level-1 list are selected; a selected package selects the two items it was
    made of. Since the leaves enter every list in the same sorted order, the
    leaves selected at a level are a prefix of that order, so walking back up
    the levels with one count per level gives every length.

    Args:
      counts: ``(K,)`` non-negative integer histogram, total below 2**30.
        Symbols with count 0 get length 0 (no code).
      max_len: length limit; needs ``2**max_len >= K``.

    Returns:
      ``(K,)`` uint32 code lengths. A single used symbol gets length 1 so a
      stream of it is still decodable from the lengths alone.

    Example:
      >>> import jax.numpy as jnp
      >>> code_lengths(jnp.array([5, 1, 1, 2, 0]))
      Array([1, 3, 3, 2, 0], dtype=uint32)
    """
    k = counts.shape[0]
    if 2**max_len < k:
        raise ValueError(f"max_len={max_len} is too short for {k} symbols")
    counts = counts.astype(jnp.int32)
    used = counts > 0
    num_used = jnp.sum(used.astype(jnp.int32))
    order = jnp.argsort(jnp.where(used, counts, _BIG), stable=True)
    leaves = jnp.where(used, counts, _BIG)[order]
    pad = jnp.full((k,), _BIG, jnp.int32)
    zero = jnp.zeros(1, jnp.int32)

    def merge_level(items: jax.Array, _: Any) -> tuple[jax.Array, jax.Array]:
        packages = jnp.minimum(items[0::2] + items[1::2], _BIG)
        merged = jnp.concatenate([leaves, packages])
        pick = jnp.argsort(merged, stable=True)  # leaves first on ties
        cum = jnp.concatenate([zero, jnp.cumsum((pick < k).astype(jnp.int32))])
        return merged[pick], cum

    # Leaf prefix counts of each level's list: the deepest level holds only
    # leaves; scan builds levels max_len - 1 .. 1.
    deepest = jnp.concatenate([zero, jnp.minimum(jnp.arange(1, 2 * k + 1, dtype=jnp.int32), k)])
    _, cums = lax.scan(merge_level, jnp.concatenate([leaves, pad]), None, length=max_len - 1)
    cums = jnp.concatenate([deepest[None], cums])
    rank = jnp.arange(k, dtype=jnp.int32)

    def select_level(take: jax.Array, cum: jax.Array) -> tuple[jax.Array, jax.Array]:
        # level 1 (shallowest) down to max_len
        leaves_taken = cum[take]
        return 2 * (take - leaves_taken), (rank < leaves_taken).astype(jnp.int32)

    take = jnp.maximum(2 * num_used - 2, 0)
    _, deeper = lax.scan(select_level, take, cums, reverse=True)
    sorted_lengths = jnp.sum(deeper, axis=0)
    lengths = jnp.zeros(k, jnp.int32).at[order].set(sorted_lengths)
    lengths = jnp.where(used & (num_used == 1), 1, lengths)
    return lengths.astype(jnp.uint32)


def _canonical_order(lengths: jax.Array,
                     max_len: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Symbols sorted by (length, symbol), unused last, and their left-justified codes."""
    lengths = lengths.astype(jnp.int32)
    rank_key = jnp.where(lengths > 0, lengths, max_len + 1)
    order = jnp.argsort(rank_key, stable=True)
    sorted_len = lengths[order]
    step = jnp.where(sorted_len > 0, jnp.left_shift(1, max_len - sorted_len), 0)
    # Canonical code of the i-th symbol, left-justified to max_len bits: the
    # Kraft sum of the codes before it.
    starts = jnp.cumsum(step) - step
    return order, sorted_len, starts


def canonical_codes(lengths: jax.Array, max_len: int = MAX_CODE_LENGTH) -> jax.Array:
    """Canonical Huffman codes (DEFLATE's assignment) from code lengths.

    Args:
      lengths: ``(K,)`` code lengths, 0 for unused symbols, each <= max_len,
        satisfying Kraft's inequality.
      max_len: the length limit the lengths were built with.

    Returns:
      ``(K,)`` uint32 codes, the value of each code read MSB-first (0 where
      unused).

    Example:
      >>> import jax.numpy as jnp
      >>> canonical_codes(jnp.array([1, 3, 3, 2, 0]))
      Array([0, 6, 7, 2, 0], dtype=uint32)
    """
    order, sorted_len, starts = _canonical_order(lengths, max_len)
    codes = jnp.where(sorted_len > 0, jnp.right_shift(starts, max_len - sorted_len), 0)
    return jnp.zeros(lengths.shape[0], jnp.uint32).at[order].set(codes.astype(jnp.uint32))


def decode_table(lengths: jax.Array, max_len: int = MAX_CODE_LENGTH) -> jax.Array:
    """Lookup table: next ``max_len`` stream bits -> ``symbol * 32 + length``.

    Entry ``t`` belongs to the last code whose left-justified value is
    ``<= t``. Entries beyond the Kraft sum (an incomplete code) map to length
    ``max_len``; a valid stream never reaches them.
    """
    order, sorted_len, starts = _canonical_order(lengths, max_len)
    rank = jnp.arange(lengths.shape[0], dtype=jnp.int32)
    size = 2**max_len
    # Mark each used code's first entry with its rank; a running max fills
    # the rest of its range. Unused symbols start at the Kraft sum (dropped).
    marks = jnp.zeros(size, jnp.int32).at[jnp.where(sorted_len > 0, starts, size)].max(
        rank, mode="drop")
    hit = lax.cummax(marks)
    entry = jnp.arange(size, dtype=jnp.int32)
    complete = jnp.sum(jnp.where(sorted_len > 0, jnp.left_shift(1, max_len - sorted_len), 0))
    length = jnp.where((entry < complete) & (sorted_len[hit] > 0), sorted_len[hit], max_len)
    return order[hit].astype(jnp.int32) * 32 + length


def write_codes(codes: jax.Array, lengths: jax.Array,
                words: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Concatenates variable-length codes into a ``(words,)`` uint32 stream.

    Args:
      codes: ``(n,)`` uint32 code values (MSB-first, right-aligned).
      lengths: ``(n,)`` code lengths in [1, 32]; a traced scalar broadcasts.
      words: static stream capacity in uint32 words.

    Returns:
      ``(stream, offsets, total_bits)``: the packed words, the ``(n,)`` uint32
      start bit of each code, and the uint32 total. Codes past the capacity
      are dropped; the caller detects that as ``total_bits > 32 * words``.
    """
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.uint32), codes.shape)
    ends = jnp.cumsum(lengths, dtype=jnp.uint32)
    offsets = ends - lengths
    total = ends[-1] if codes.shape[0] else jnp.uint32(0)
    word = (offsets >> 5).astype(jnp.int32)
    shift = offsets & jnp.uint32(31)
    aligned = codes.astype(jnp.uint32) << (jnp.uint32(32) - lengths)
    high = aligned >> shift
    low = jnp.where(shift == 0, jnp.uint32(0), aligned << ((jnp.uint32(32) - shift) & 31))
    stream = jnp.zeros(words, jnp.uint32)
    stream = stream.at[word].add(high, mode="drop").at[word + 1].add(low, mode="drop")
    return stream, offsets, total


def _window(stream: jax.Array, pos: jax.Array) -> jax.Array:
    """The 32 stream bits starting at bit ``pos``, first bit as the MSB.

    ``stream`` must carry one trailing zero word.
    """
    word = (pos >> 5).astype(jnp.int32)
    shift = pos & jnp.uint32(31)
    first = stream.at[word].get(mode="fill", fill_value=0)
    second = stream.at[word + 1].get(mode="fill", fill_value=0)
    tail = jnp.where(shift == 0, jnp.uint32(0), second >> ((jnp.uint32(32) - shift) & 31))
    return (first << shift) | tail


def read_fixed(stream: jax.Array, bits: jax.Array | int, count: int) -> jax.Array:
    """Reads ``count`` fixed-width codes of ``bits`` (<= 32, may be traced) bits."""
    pos = lax.iota(jnp.uint32, count) * jnp.asarray(bits, jnp.uint32)
    stream = jnp.concatenate([stream, jnp.zeros(1, jnp.uint32)])
    return _window(stream, pos) >> (jnp.uint32(32) - jnp.asarray(bits, jnp.uint32))


def read_codes(stream: jax.Array, starts: jax.Array, table: jax.Array, count: int,
               block: int, max_len: int = MAX_CODE_LENGTH) -> jax.Array:
    """Decodes ``count`` symbols, ``block`` per lane, lane ``j`` from bit ``starts[j]``.

    Args:
      stream: ``(words,)`` uint32 stream from `write_codes`.
      starts: ``(ceil(count / block),)`` uint32 start bit of every block.
      table: `decode_table` of the code.
      count: number of symbols (static).
      block: symbols per block (static).
      max_len: the code's length limit.

    Returns:
      ``(count,)`` int32 symbols.
    """
    if count == 0:
        return jnp.zeros(0, jnp.int32)
    steps = min(block, count)
    stream = jnp.concatenate([stream, jnp.zeros(1, jnp.uint32)])
    drop = jnp.uint32(32 - max_len)

    def step(pos: jax.Array, _: Any) -> tuple[jax.Array, jax.Array]:
        entry = table[_window(stream, pos) >> drop]
        return pos + (entry & 31).astype(jnp.uint32), entry >> 5

    _, symbols = lax.scan(step, starts.astype(jnp.uint32), None, length=steps)
    return symbols.T.reshape(-1)[:count]
