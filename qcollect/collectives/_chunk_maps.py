"""How a collective codes all ``n`` chunks of a segment at once.

Each kind of segment has its own way (`Segment.chunk_map`): the contiguous
chunks of a row segment are coded by one `jax.vmap` over the stacked chunks
(`VMAPPED`); the strided column blocks of a column segment one after the
other in a `lax.map` loop, each block read straight from the side-by-side
matrix (`LOOPED`; why a loop: `_backend.COLUMN_BLOCKS_IN_A_LOOP`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Protocol, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["LOOPED", "VMAPPED", "ChunkMap", "ChunkView"]

_T = TypeVar("_T")


class ChunkView(Protocol):
    """What a `ChunkMap` reads of a segment's chunks on this device."""

    @property
    def n(self) -> int: ...

    def take(self, j: jax.Array | int) -> jax.Array: ...

    def stacked(self) -> jax.Array: ...


class ChunkMap(abc.ABC):
    """How a collective runs a per-chunk function over all ``n`` chunks of a
    segment: the segment kind's own way (`Segment.chunk_map`)."""

    @abc.abstractmethod
    def __call__(self, fn: Callable[[jax.Array, jax.Array, jax.Array], _T], chunks: ChunkView,
                 keys: jax.Array) -> _T:
        """``fn(chunk j, keys[j], j)`` for every chunk ``j``, results stacked."""


class _Vmapped(ChunkMap):
    """Contiguous chunks: one `jax.vmap` over the stacked chunks."""

    def __call__(self, fn: Callable[[jax.Array, jax.Array, jax.Array], _T], chunks: ChunkView,
                 keys: jax.Array) -> _T:
        return jax.vmap(fn)(chunks.stacked(), keys, jnp.arange(chunks.n))


class _Looped(ChunkMap):
    """Strided column blocks: a `lax.map` over the chunks, each block read
    straight from the side-by-side matrix (`_backend.COLUMN_BLOCKS_IN_A_LOOP`)."""

    def __call__(self, fn: Callable[[jax.Array, jax.Array, jax.Array], _T], chunks: ChunkView,
                 keys: jax.Array) -> _T:
        index = jnp.arange(chunks.n)
        return lax.map(lambda j: fn(chunks.take(j), keys[j], j), index)


#: The chunk map of row segments.
VMAPPED: ChunkMap = _Vmapped()
#: The chunk map of column segments.
LOOPED: ChunkMap = _Looped()
