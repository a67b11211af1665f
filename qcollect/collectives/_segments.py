"""A segment: leaves reduced together as whole groups, cut into per-device chunks.

`plan_segments` (the layout) plans the segments; a segment lays its leaves
out and back. `RowSegment` holds whole rows of ``width`` values (the
``"element"`` and ``"bucket"`` groupings, and vectors shared by runs),
`ColumnSegment` whole columns of the leaves' matrix views (``"column"``,
and matrices shared by columns). Both count their length in *spans* (rows
or columns) and cut it into buckets of ``n`` equal chunks (`Segment.parts`).

What differs between the two beyond the layout is a segment's own
behaviour, so the algorithms never ask which kind they hold: how the ``n``
chunks are coded at once (`Segment.chunk_map`: a vmap over contiguous
chunks, a loop over strided column blocks) and whether a chunk can be cut
into pipeline pieces (`Segment.pipeline_pieces`: runs of whole rows; a
column chunk stays whole).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qcollect.collectives._chunk_maps import LOOPED, VMAPPED, ChunkMap
from qcollect.collectives._offsets import runtime_slices

__all__ = ["ColumnSegment", "RowPiece", "RowSegment", "Segment"]


class RowPiece(NamedTuple):
    """Rows ``[lo, hi)`` of every device's chunk of a row segment's bucket:
    one pipeline piece (`RowSegment.pipeline_pieces`)."""

    layout: RowSegment
    lo: int
    hi: int
    width: int

    def cut(self, laid_out: jax.Array) -> jax.Array:
        """The piece of a bucket's stacked chunks ``(n, per_chunk * width)``."""
        return laid_out[:, self.lo * self.width:self.hi * self.width]

    def rows(self, per_row: Any) -> Any:
        """The piece of per-row values ``(n, per_chunk)`` (valid counts)."""
        return per_row[:, self.lo:self.hi]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Segment(abc.ABC):
    """Leaves reduced together, as whole groups, and their per-device chunks.

    The base of the two layouts, `RowSegment` and `ColumnSegment`: what they
    share is counted in their *spans*, rows (of a row segment) or columns (of
    a column segment), and each says what a span is and how its chunks are
    cut.

    Attributes:
      members: indices of the leaves, in tree order.
      shapes: their shapes.
      dtype: their common dtype.
      spans: rows or columns of each member.
      n: devices, i.e. chunks.
      bucket: spans of one device's chunk in a full bucket, or None: the
        segment is one bucket. A segment longer than ``n * bucket`` is
        reduced bucket by bucket (`parts`), each bucket cut into ``n``
        chunks of whole groups; equal buckets run as one batch
        (`reduce_buckets`).
    """

    #: How the collectives code this kind's ``n`` chunks at once.
    chunk_map: ClassVar[ChunkMap]

    members: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: np.dtype
    spans: tuple[int, ...]
    n: int
    bucket: int | None = None

    @classmethod
    @abc.abstractmethod
    def planned(cls, *, unit: int, **fields: Any) -> Segment:
        """A segment of this kind whose spans hold ``unit`` values each."""

    @property
    @abc.abstractmethod
    def unit(self) -> int:
        """Values of one span: a row's width, or a column's height."""

    @property
    def length(self) -> int:
        """Spans of the segment, padding excluded."""
        return sum(self.spans)

    @property
    def parts(self) -> tuple[tuple[int, int], ...]:
        """``((count, per_chunk), ...)``: runs of equal buckets, in order.

        One bucket of ``ceil(length / n)`` spans per chunk, or ``count`` full
        buckets of ``bucket`` spans per chunk and a last, shorter one for the
        rest (padded to ``n`` chunks of equal size, as a single bucket is).
        """
        single = -(-self.length // self.n)
        if self.bucket is None or self.length <= self.n * self.bucket:
            return ((1, single),)
        full = self.length // (self.n * self.bucket)
        rest = self.length - full * self.n * self.bucket
        return ((full, self.bucket),) + (((1, -(-rest // self.n)),) if rest else ())

    @property
    def buckets(self) -> int:
        return sum(count for count, _ in self.parts)

    @property
    def per_chunk(self) -> int:
        """Spans in one device's chunk of the first bucket."""
        return self.parts[0][1]

    def layout(self, per_chunk: int) -> Segment:
        """The layout of one bucket of ``per_chunk`` spans per chunk: what
        `take`, `chunk_shape` and `per_chunk` read."""
        return dataclasses.replace(self, members=(), shapes=(), spans=(self.n * per_chunk,),
                                   bucket=None)

    @property
    @abc.abstractmethod
    def chunk_shape(self) -> tuple[int, ...]:
        """Shape of one device's chunk."""

    def chunks(self, leaves: Sequence[Any]) -> jax.Array:
        """``(n, *chunk_shape)``: the member leaves laid out and cut into chunks.

        ``leaves`` is the whole list of leaves (only the members are read);
        they may have another dtype than the segment's (a float32 residual).
        For a column segment this is a strided copy; `laid_out` and `take`
        read one chunk without it.
        """
        return self.stacked(self.laid_out(leaves))

    @abc.abstractmethod
    def stacked(self, laid_out: jax.Array) -> jax.Array:
        """``(n, *chunk_shape)``: the chunks of a `laid_out` array."""

    @abc.abstractmethod
    def take(self, laid_out: jax.Array, j: jax.Array | int) -> jax.Array:
        """Chunk ``j`` (traced, taken modulo ``n``) of a `laid_out` array."""

    @abc.abstractmethod
    def pipeline_pieces(self, pipeline: int) -> tuple[RowPiece, ...]:
        """The pieces one bucket's chunks are cut into for ``pipeline`` runs
        of whole spans each, or ``()`` when the chunks stay whole."""

    @property
    def _padded(self) -> int:
        """Spans of all buckets, padding included."""
        return sum(count * self.n * per_chunk for count, per_chunk in self.parts)

    @abc.abstractmethod
    def _stream(self, leaves: Sequence[Any]) -> jax.Array:
        """The members one after the other, padded to `_padded` spans."""

    def laid_out(self, leaves: Sequence[Any]) -> jax.Array:
        """The members laid out for one bucket's chunks (`take` reads chunk
        ``j``). One bucket only (see `bucketed`)."""
        self._check_single()
        return self._laid_out_stream(self._stream(leaves))

    def _laid_out_stream(self, stream: jax.Array) -> jax.Array:
        return stream

    def bucketed(self, leaves: Sequence[Any]) -> list[jax.Array]:
        """Per `parts` entry, its buckets stacked (`_bucket_run`)."""
        stream = self._stream(leaves)
        out: list[jax.Array] = []
        offset = 0
        for count, per_chunk in self.parts:
            size = count * self.n * per_chunk
            out.append(self._bucket_run(stream, offset, size, count, per_chunk))
            offset += size
        return out

    @abc.abstractmethod
    def _bucket_run(self, stream: jax.Array, offset: int, size: int, count: int,
                    per_chunk: int) -> jax.Array:
        """The ``count`` buckets of ``size`` spans from span ``offset`` of
        the `_stream`, stacked."""

    def leaves(self, chunks: jax.Array) -> list[jax.Array]:
        """Inverse of `chunks`: the members' arrays, padding dropped."""
        self._check_single()
        return self.unbucketed([chunks[None]])

    @abc.abstractmethod
    def unbucketed(self, parts: Sequence[jax.Array]) -> list[jax.Array]:
        """Inverse of `bucketed` for stacked chunks: per `parts` entry an
        array ``(count, n, *chunk_shape)``; returns the members' arrays,
        padding dropped."""

    def _check_single(self) -> None:
        if len(self.parts) != 1 or self.parts[0][0] != 1:
            raise ValueError(f"the segment has {self.buckets} buckets: use bucketed/unbucketed")

    def valid(self) -> np.ndarray | None:
        """``(n, rows per chunk)`` real values per row of a row segment, or
        None when every row is whole (and for column segments, whose columns
        are never split). One bucket only (see `bucket_valid`)."""
        self._check_single()
        valid = self.bucket_valid()
        return None if valid is None else valid[0][0]

    def bucket_valid(self) -> list[np.ndarray] | None:
        """Per `parts` entry ``(count, n, per_chunk)`` real values per row,
        or None when every row is whole (always for a column segment)."""
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowSegment(Segment):
    """Leaves flattened row-major into rows of ``width`` values (a leaf's
    last row zero-padded), stacked row after row; a device's chunk is
    ``per_chunk`` whole rows, one flat array of ``per_chunk * width``."""

    chunk_map: ClassVar[ChunkMap] = VMAPPED
    width: int

    @classmethod
    def planned(cls, *, unit: int, **fields: Any) -> RowSegment:
        return cls(width=unit, **fields)

    @property
    def unit(self) -> int:
        return self.width

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return (self.per_chunk * self.width,)

    def stacked(self, laid_out: jax.Array) -> jax.Array:
        return laid_out

    def take(self, laid_out: jax.Array, j: jax.Array | int) -> jax.Array:
        return lax.dynamic_index_in_dim(laid_out, j % self.n, keepdims=False)

    def pipeline_pieces(self, pipeline: int) -> tuple[RowPiece, ...]:
        """Runs of whole rows, at most ``pipeline`` and at most a chunk's rows."""
        rows = self.per_chunk
        count = min(pipeline, rows)
        if count <= 1:
            return ()
        bounds = [rows * k // count for k in range(count + 1)]
        return tuple(RowPiece(self._piece(hi - lo), lo, hi, self.width)
                     for lo, hi in zip(bounds[:-1], bounds[1:], strict=True))

    def _piece(self, rows: int) -> RowSegment:
        """The layout of one pipeline piece: ``rows`` rows per chunk."""
        return RowSegment(members=(0,), shapes=((self.n * rows * self.unit,),),
                          dtype=self.dtype, width=self.unit, spans=(self.n * rows,), n=self.n)

    def _stream(self, leaves: Sequence[Any]) -> jax.Array:
        """A flat run of the members' rows, padded to `_padded` rows."""
        parts = [jnp.asarray(leaves[i]) for i in self.members]
        flats = []
        for p, rows in zip(parts, self.spans, strict=True):
            flat = p.reshape(-1)
            tail = rows * self.width - flat.shape[0]
            flats.append(jnp.pad(flat, (0, tail)) if tail else flat)
        pad = self._padded - self.length
        if pad:
            flats.append(jnp.zeros((pad * self.width,), parts[0].dtype))
        return flats[0] if len(flats) == 1 else jnp.concatenate(flats)

    def _laid_out_stream(self, stream: jax.Array) -> jax.Array:
        """The ``(n, *chunk_shape)`` chunks themselves."""
        return stream.reshape((self.n,) + self.chunk_shape)

    def _bucket_run(self, stream: jax.Array, offset: int, size: int, count: int,
                    per_chunk: int) -> jax.Array:
        """``(count, n, per_chunk * width)`` chunks."""
        part = stream[offset * self.width:(offset + size) * self.width]
        return part.reshape(count, self.n, per_chunk * self.width)

    def unbucketed(self, parts: Sequence[jax.Array]) -> list[jax.Array]:
        pieces = [p.reshape(-1) for p in parts]
        starts = np.cumsum([0] + [span * self.width for span in self.spans[:-1]])
        members = _cut(pieces, [int(s) for s in starts],
                       [math.prod(shape) for shape in self.shapes], axis=0)
        return [m.reshape(shape) for m, shape in zip(members, self.shapes, strict=True)]

    def bucket_valid(self) -> list[np.ndarray] | None:
        counts: list[np.ndarray] = []
        partial = False
        for shape, rows in zip(self.shapes, self.spans, strict=True):
            row = np.full(rows, self.width, np.int32)
            if rows:
                row[-1] = math.prod(shape) - (rows - 1) * self.width
                partial |= bool(row[-1] != self.width)
            counts.append(row)
        if not partial:  # padding rows are all zeros: no statistic is biased
            return None
        counts.append(np.zeros(self._padded - self.length, np.int32))
        flat = np.concatenate(counts)
        out: list[np.ndarray] = []
        offset = 0
        for count, per_chunk in self.parts:
            size = count * self.n * per_chunk
            out.append(flat[offset:offset + size].reshape(count, self.n, per_chunk))
            offset += size
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ColumnSegment(Segment):
    """Leaves viewed as ``(rows, cols)`` matrices placed side by side; a
    device's chunk is ``per_chunk`` whole columns, a ``(rows, per_chunk)``
    matrix read straight from the side-by-side matrix (`take`)."""

    chunk_map: ClassVar[ChunkMap] = LOOPED
    rows: int

    @classmethod
    def planned(cls, *, unit: int, **fields: Any) -> ColumnSegment:
        return cls(rows=unit, **fields)

    @property
    def unit(self) -> int:
        return self.rows

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return (self.rows, self.per_chunk)

    def stacked(self, laid_out: jax.Array) -> jax.Array:
        return laid_out.reshape(self.rows, self.n, -1).transpose(1, 0, 2)

    def pipeline_pieces(self, pipeline: int) -> tuple[RowPiece, ...]:
        """``()``: a column segment's chunks stay whole (``pipeline`` cuts
        row segments only)."""
        del pipeline
        return ()

    def take(self, laid_out: jax.Array, j: jax.Array | int) -> jax.Array:
        return lax.dynamic_slice_in_dim(laid_out, (j % self.n) * self.per_chunk,
                                        self.per_chunk, axis=1)

    def _stream(self, leaves: Sequence[Any]) -> jax.Array:
        """The ``(rows, _padded)`` matrix of the members' columns side by
        side (chunk ``j`` of one bucket is columns ``[j c, (j + 1) c)``)."""
        parts = [jnp.asarray(leaves[i]) for i in self.members]
        mats = [p.reshape(self.rows, s) for p, s in zip(parts, self.spans, strict=True)]
        pad = self._padded - self.length
        if pad:
            mats.append(jnp.zeros((self.rows, pad), parts[0].dtype))
        return mats[0] if len(mats) == 1 else jnp.concatenate(mats, axis=1)

    def _bucket_run(self, stream: jax.Array, offset: int, size: int, count: int,
                    per_chunk: int) -> jax.Array:
        """``(count, rows, n * per_chunk)`` side-by-side matrices (one copy of
        the columns, only when there is more than one bucket)."""
        part = stream[:, offset:offset + size] if size != stream.shape[1] else stream
        return part.reshape(self.rows, count, self.n * per_chunk).transpose(1, 0, 2)

    def unbucketed(self, parts: Sequence[jax.Array]) -> list[jax.Array]:
        pieces = [p.transpose(2, 0, 1, 3).reshape(self.rows, -1) for p in parts]
        starts = np.cumsum([0] + list(self.spans[:-1]))
        members = _cut(pieces, [int(s) for s in starts], list(self.spans), axis=1)
        return [m.reshape(shape) for m, shape in zip(members, self.shapes, strict=True)]


def _cut(pieces: Sequence[jax.Array], starts: Sequence[int], sizes: Sequence[int],
         axis: int) -> list[jax.Array]:
    """Members ``[start, start + size)`` along ``axis`` of ``pieces`` laid end
    to end (a segment's decoded parts).

    Each member is cut from the piece that holds it, never from a
    concatenation of all pieces (that would copy the whole segment first);
    where a piece holds several, at runtime starts (`runtime_slices`), so
    their kernels -- the decode fused into each -- are one computation per
    shape, compiled once. A member across two pieces is joined from both.
    """
    bounds = np.cumsum([0] + [piece.shape[axis] for piece in pieces])
    homes: dict[int, int] = {}
    for b, (start, size) in enumerate(zip(starts, sizes, strict=True)):
        h = min(int(np.searchsorted(bounds, start, side="right")) - 1, len(pieces) - 1)
        if start + size <= bounds[h + 1]:
            homes[b] = h
    members: list[Any] = [None] * len(starts)
    for h, piece in enumerate(pieces):
        mine = [b for b, home in homes.items() if home == h]
        local = [starts[b] - int(bounds[h]) for b in mine]
        mine_sizes = [sizes[b] for b in mine]
        if len(mine) > 1:
            cuts = runtime_slices(piece, local, mine_sizes, axis)
        else:
            cuts = [lax.slice_in_dim(piece, s, s + n, axis=axis)
                    for s, n in zip(local, mine_sizes, strict=True)]
        for b, cut in zip(mine, cuts, strict=True):
            members[b] = cut
    for b, (start, size) in enumerate(zip(starts, sizes, strict=True)):
        if b not in homes:
            members[b] = jnp.concatenate(
                [lax.slice_in_dim(piece, max(start - lo, 0), min(start + size, hi) - lo,
                                  axis=axis)
                 for piece, lo, hi in zip(pieces, bounds[:-1], bounds[1:], strict=True)
                 if lo < start + size and hi > start], axis=axis)
    return members
