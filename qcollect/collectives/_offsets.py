"""Slice offsets as runtime values, so that equal leaves share one kernel.

XLA compiles one machine-code kernel per distinct fused computation; two
fusions that differ only in the buffers they read are compiled once. A
static slice offset is a constant inside the fusion, so the kernel that
writes one leaf of a batch (``value[offset:offset + size]`` with the
batch's decode fused in) differs from its neighbour's by that constant
alone, and every leaf compiles a kernel of its own: the program's code
grows with the number of leaves (`_backend.CONSTANT_OFFSETS`; the counts
are in docs/collectives.md#backend-workarounds). With the offset an
operand -- a runtime uint32 that XLA cannot fold -- the kernels of all
leaves of one shape in one batch are the same computation and compiled
once (``python -m qcollect.bench compile``).

The offsets come out of one variadic `lax.sort` of constant pairs ``[c,
c]`` keyed on a value read at run time: any order of ``[c, c]`` is ``[c,
c]``, so each output is exactly its constant, but XLA's constant
folding cannot evaluate a sort whose keys are not constant, and each output
is a buffer of its own (a slice of one shared array would put its position
back into every kernel as a constant). The key is read from the array being
sliced, so the offsets are typed like it (varying or invariant along a
``shard_map`` axis) and cost no communication: one sort of 2-value arrays
per batch, and one 2-value broadcast per offset.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["runtime_offsets", "runtime_slices"]


def runtime_offsets(anchor: jax.Array, offsets: Iterable[int]) -> dict[int, jax.Array]:
    """``{offset: uint32 scalar}`` for every int in ``offsets``, computed at run
    time from the first value of ``anchor`` (whatever it is, NaN included).

    An ``anchor`` with fewer than two values gives plain constants (a program
    that small has no kernels to share). Under `jax.vmap` the offsets are
    batched like ``anchor`` and the slices become gathers: right, not shared.
    """
    distinct = sorted(set(int(o) for o in offsets))
    if anchor.size < 2:
        return {o: jnp.uint32(o) for o in distinct}
    key = anchor.reshape(-1)[0]
    if key.dtype == jnp.bool_:
        key = key.astype(jnp.uint8)
    # Broadcast scalars, not array literals (_backend.LITERAL_OPERANDS).
    pairs = tuple(lax.full((2,), o, jnp.uint32) for o in distinct)
    sorted_pairs = lax.sort((jnp.stack([key, key]),) + pairs, num_keys=1)[1:]
    return {o: pair[0] for o, pair in zip(distinct, sorted_pairs, strict=True)}


def runtime_slices(x: jax.Array, starts: Sequence[int] | np.ndarray, sizes: Sequence[int],
                   axis: int = 0) -> list[jax.Array]:
    """``[x[start:start + size] for ...]`` along ``axis``, with the starts as
    `runtime_offsets`.

    The slices are taken in whole runs of ``w`` values, ``w`` the greatest
    common divisor of the axis length, the starts and the sizes, so that the
    index arithmetic inside each run stays static (a decode fused into the
    slice unpacks its words with constant shifts, as with a static slice).
    """
    length = x.shape[axis]
    w = math.gcd(length, *(int(s) for s in starts), *(int(n) for n in sizes)) or 1
    runs = x.reshape(x.shape[:axis] + (length // w, w) + x.shape[axis + 1:])
    at = runtime_offsets(x, [int(s) // w for s in starts])
    return [lax.dynamic_slice_in_dim(runs, at[int(s) // w], int(n) // w, axis)
            .reshape(x.shape[:axis] + (int(n),) + x.shape[axis + 1:])
            for s, n in zip(starts, sizes, strict=True)]
