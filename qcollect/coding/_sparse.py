"""Sparse wire words: which entries are sent, how they are packed, how they decode.

Dryden et al., "Communication Quantization for Data-parallel Training of Deep
Neural Networks", section 3.2: a sparse entry travels as one 32-bit word, "one
bit of which is the quantized value and 31 bits of which are used to store the
index of the update". Threshold (3.2) and adaptive (3.3) quantization share
this module.

Word layout (uint32): bit 31 is the sign (1: the entry decodes to the positive
reconstruction value, 0: to the negative one, as in the paper), bits 0..30 the
flat row-major index. Arrays hold at most ``MAX_SIZE = 2**31 - 1`` entries, so
index ``2**31 - 1`` never occurs and ``EMPTY = 0xFFFFFFFF`` (sign 1, index
``2**31 - 1``) marks an unused slot of the static-capacity buffer. Sent
entries fill the buffer in increasing index order, empty slots follow; decode
reads only the first ``count`` slots (see the header), so an all-zero payload
decodes to zeros.

Every sparse payload also carries one uint32 ``header`` word: bits 0..30 hold
the number of sent entries, bit 31 is set when the input held a NaN or Inf.
A NaN never passes ``|v| > tau``, so without it a non-finite input could
decode to a finite array; with it, decode returns all-NaN.

Selection is static in shape and avoids sorting. The mask of candidate
entries is bit-packed (32 per word), popcounted and prefix-summed per word;
each non-empty word marks its first slot and a running max over the slots
tells every slot its word, a five-step popcount search its bit. The full-size
work is one fused pass that packs the mask; everything after it runs on
``n / 32`` words or on the ``capacity`` slots (an element-wise prefix sum over
``n`` values would cost several passes: PREFIX_SUMS_PER_WORD in
docs/collectives.md#backend-workarounds). When more entries are
candidates than fit, the ``capacity`` largest keys are kept, found per group
by a 31-step bisection on integer keys (31 counting passes, no sort); ties go
to the lower index.

Example:
  >>> import jax.numpy as jnp
  >>> from qcollect import pack_bits
  >>> idx, count = compact_words(pack_bits(jnp.array([0, 1, 0, 1, 1]), 1), 5, 4)
  >>> to_words(idx, jnp.array([True, False, True, True]))
  Array([2147483649,          3, 2147483652, 4294967295], dtype=uint32)
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qcollect.coding._packing import pack_bits

__all__ = ["EMPTY", "MAX_SIZE", "check_size", "check_capacity", "resolve_capacity",
           "magnitude_keys", "top_mask", "mask_at", "KEY_END", "compact_words", "compact_largest",
           "to_words", "from_words", "header", "header_count", "scatter_decode"]

SIGN_BIT = np.uint32(1 << 31)
INDEX_MASK = np.uint32((1 << 31) - 1)
#: The largest array a sparse payload can index (31 index bits, one value kept
#: for the empty-slot sentinel).
MAX_SIZE = (1 << 31) - 1
#: Index stored in empty slots; ``MAX_SIZE`` is no valid index.
EMPTY_INDEX = MAX_SIZE
#: The empty-slot word: sign bit set and index ``2**31 - 1``.
EMPTY = np.uint32(0xFFFFFFFF)
# One above the largest key: magnitude_keys(inf) = 0x7F800001.
KEY_END = 0x7F800002
_BISECT_STEPS = 31  # ceil(log2(KEY_END - 1))


def check_size(size: int) -> None:
    """Raises ValueError for arrays a 31-bit index cannot address."""
    if size > MAX_SIZE:
        raise ValueError(
            f"x has {size} entries; sparse words hold 31-bit indices, so at most "
            f"{MAX_SIZE} (2**31 - 1) entries per array (split the array)")


def check_capacity(capacity: object) -> int | float:
    """Validates a capacity: an int >= 0 (entries) or a float in (0, 1] (fraction)."""
    if isinstance(capacity, numbers.Integral) and not isinstance(capacity, bool):
        if int(capacity) >= 0:
            return int(capacity)
    elif isinstance(capacity, numbers.Real) and not isinstance(capacity, bool):
        if np.isfinite(float(capacity)) and 0 < float(capacity) <= 1:
            return float(capacity)
    raise ValueError("capacity must be an integer >= 0 (entries) or a float in (0, 1] "
                     f"(fraction of the array size), got {capacity!r}")


def resolve_capacity(capacity: int | float, size: int) -> int:
    """Static slot count: ``min(capacity, size)`` or ``ceil(capacity * size)``."""
    if isinstance(capacity, float):
        return min(size, int(np.ceil(capacity * size)))
    return min(size, capacity)


def magnitude_keys(v: jax.Array) -> jax.Array:
    """int32 keys ordered as ``|v|``: ``bits(|v|) + 1``, 1 for zero, 0x7F800001 for inf.

    Key 0 is left for "not a candidate". NaN must be masked out by the caller.
    """
    return lax.bitcast_convert_type(jnp.abs(v), jnp.int32) + 1


def top_mask(keys: jax.Array, k: jax.Array, axis: int) -> jax.Array:
    """Marks the ``k`` largest positive keys of each group along ``axis``.

    Args:
      keys: int32 keys, ``0`` for entries that must not be chosen, else in
        ``[1, 0x7F800001]`` (see `magnitude_keys`).
      k: int32, the shape of ``keys`` with ``axis`` kept as size 1: how many
        to choose per group. Groups with fewer candidates choose them all.
      axis: the axis along which a group runs.

    Returns:
      bool mask of ``min(k, candidates)`` entries per group: keys above the
      group's k-th largest key, then equal keys by increasing position.
    """
    k = k.astype(jnp.int32)

    def count_ge(t: jax.Array | int) -> jax.Array:
        return jnp.sum(keys >= t, axis=axis, keepdims=True, dtype=jnp.int32)

    total = count_ge(1)
    # Derived from the data, so the carry has the data's varying axes under
    # shard_map (constants would not).
    lo = total - total + 1
    hi = total - total + KEY_END

    def body(_: jax.Array,
             carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        lo, hi, n_lo = carry
        mid = lo + (hi - lo) // 2
        n_mid = count_ge(mid)
        ok = n_mid >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid), jnp.where(ok, n_mid, n_lo)

    t, _, n_t = lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi, total))
    # t is the k-th largest key (or 1 when a group has fewer than k candidates).
    return mask_at(keys, k, t, axis, n_t)


def mask_at(keys: jax.Array, k: jax.Array, t: jax.Array, axis: int,
            n_t: jax.Array | None = None) -> jax.Array:
    """Chooses ``min(k, #(keys >= t))`` entries per group: every key ``> t``,
    then keys ``== t`` by increasing position along ``axis``.

    ``t`` (shaped like ``k``) must be the group's k-th largest key, so at most
    ``k`` keys exceed it. ``n_t``, the count of keys ``>= t``, is computed when
    not given. Only groups with surplus ties at ``t`` need a prefix count,
    which runs under a `lax.cond`.
    """
    k = k.astype(jnp.int32)
    if n_t is None:
        n_t = jnp.sum(keys >= t, axis=axis, keepdims=True, dtype=jnp.int32)

    def tie_break() -> jax.Array:
        ties = keys == t
        rank = jnp.cumsum(ties, axis=axis, dtype=jnp.int32)
        need = k - (n_t - jnp.sum(ties, axis=axis, keepdims=True, dtype=jnp.int32))
        return (keys > t) | (ties & (rank <= need))

    return lax.cond(jnp.all(n_t <= k), lambda: keys >= t, tie_break)


def _select_bit(word: jax.Array, r: jax.Array) -> jax.Array:
    """Position of the ``r``-th (0-based) set bit of each uint32 ``word``."""
    pos = jnp.zeros(word.shape, jnp.uint32)
    for width in (16, 8, 4, 2, 1):
        low = word & jnp.uint32((1 << width) - 1)
        c = lax.population_count(low)
        high = r >= c
        r = jnp.where(high, r - c, r)
        word = jnp.where(high, word >> width, low)
        pos = pos + jnp.where(high, jnp.uint32(width), jnp.uint32(0))
    return pos


def compact_words(words: jax.Array, size: int,
                  capacity: int) -> tuple[jax.Array, jax.Array]:
    """Stream compaction of a bit-packed mask (`qcollect.pack_bits` 1-bit layout).

    Args:
      words: uint32 words holding a mask of ``size`` bits (padding bits 0).
      size: number of mask bits.
      capacity: static number of output slots.

    Returns:
      ``(idx, count)``: int32 ``(capacity,)`` positions of the first
      ``capacity`` set bits in increasing order, ``EMPTY_INDEX`` in the
      slots after them; ``count`` = int32 number of filled slots.
    """
    if capacity == 0 or size == 0:
        return jnp.full((capacity,), EMPTY_INDEX, jnp.int32), jnp.int32(0)
    pc = lax.population_count(words).astype(jnp.int32)
    ends = jnp.cumsum(pc, dtype=jnp.int32)  # set bits in words[: w + 1]
    # Slot j lies in the last word whose first slot is <= j: mark each
    # non-empty word at its first slot, then a running max (cheaper on CPU
    # than a binary search per slot).
    first = jnp.where(pc > 0, ends - pc, capacity)
    owner = jnp.zeros((capacity,), jnp.int32).at[first].set(
        lax.iota(jnp.int32, words.shape[0]), mode="drop")
    w = lax.cummax(owner)
    slot = lax.iota(jnp.int32, capacity)
    r = (slot - (ends[w] - pc[w])).astype(jnp.uint32)
    idx = w * 32 + _select_bit(words[w], r).astype(jnp.int32)
    count = jnp.minimum(ends[-1], capacity)
    return jnp.where(slot < count, idx, EMPTY_INDEX), count


def compact_largest(keys_fn: Callable[[], jax.Array], size: int,
                    capacity: int) -> tuple[jax.Array, jax.Array]:
    """Indices of the entries with the ``capacity`` largest positive keys, ascending.

    Args:
      keys_fn: ``() -> keys``, flat int32 ``(size,)`` keys, 0 for entries
        that are not candidates. A function, so that XLA fuses the keys into
        the mask packing instead of materialising them for the overflow branch.
      size: number of keys.
      capacity: static slot count.

    Returns:
      ``(idx, count)`` as `compact_words`. When at most ``capacity`` keys are
      positive all of them are kept; otherwise `top_mask` picks the largest
      (the bisection runs only on that branch, except under `jax.vmap`, which
      evaluates both branches of a `lax.cond`).
    """
    if capacity == 0 or size == 0:
        return compact_words(jnp.zeros((0,), jnp.uint32), size, capacity)
    words = pack_bits(keys_fn() > 0, 1)
    total = jnp.sum(lax.population_count(words).astype(jnp.int32))
    # k takes the type of the data (varying under shard_map), so lax.cond under
    # vmap has nothing to cast between its branches.
    k = jnp.full((1,), capacity, jnp.int32) + 0 * total
    words = lax.cond(total > capacity, lambda: pack_bits(top_mask(keys_fn(), k, 0), 1),
                     lambda: words)
    return compact_words(words, size, capacity)


def to_words(idx: jax.Array, positive: jax.Array) -> jax.Array:
    """Sparse words ``sign << 31 | index``; ``EMPTY`` where ``idx == EMPTY_INDEX``."""
    idx = idx.astype(jnp.uint32)
    sign = positive | (idx == jnp.uint32(EMPTY_INDEX))
    return idx | jnp.where(sign, SIGN_BIT, jnp.uint32(0))


def from_words(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of `to_words`: ``(idx int32, positive bool)``; empty slots give
    ``EMPTY_INDEX``, which `scatter_decode` drops."""
    return (words & INDEX_MASK).astype(jnp.int32), words >= SIGN_BIT


def header(count: jax.Array, flat: jax.Array) -> jax.Array:
    """The header word: ``count`` in bits 0..30, bit 31 set if ``flat`` has NaN/Inf.

    ``v - v`` is 0 for finite values and NaN otherwise, so one sum tells.
    """
    if flat.shape[0] == 0:
        bad = jnp.bool_(False)
    else:
        bad = jnp.isnan(jnp.sum(flat - flat))
    return count.astype(jnp.uint32) | jnp.where(bad, SIGN_BIT, jnp.uint32(0))


def header_count(head: jax.Array) -> jax.Array:
    """Sent-entry count from a header word."""
    return (head & INDEX_MASK).astype(jnp.int32)


def scatter_decode(head: jax.Array, size: int, idx: jax.Array, values: jax.Array) -> jax.Array:
    """Dense float32 ``(size,)``: ``values`` added at ``idx``, 0 elsewhere, all NaN
    when the header flags a non-finite input. ``EMPTY_INDEX`` slots are dropped."""
    base = jnp.where(head >= SIGN_BIT, jnp.float32(jnp.nan), jnp.float32(0.0))
    out = jnp.full((size,), base, jnp.float32)
    if idx.shape[0] == 0 or size == 0:
        return out
    return out.at[idx].add(values.astype(jnp.float32), mode="drop")
