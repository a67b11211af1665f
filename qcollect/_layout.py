"""How the leaves of a pytree are laid out for a collective, group by group.

A compressor computes its statistics over groups of one array
(`Compressor.grouping`): single values, buckets of consecutive values,
columns of the array's matrix view, or the whole array. A collective fuses
leaves into buffers and cuts each buffer into one chunk per device; done on
flat 1-D buffers, a chunk would mix layers (a bucket straddling two leaves,
an entropy range over several layers, a "column" that is a whole chunk). The
layout here keeps every group whole and inside its own leaf:

* ``"element"`` and ``"bucket"`` (``block`` values per bucket): a *row
  segment* (`RowSegment`). Each leaf is flattened row-major and
  zero-padded to whole buckets, so its buckets are rows of a ``(rows, block)`` array; leaves of
  one dtype are stacked row after row and the rows cut into buckets of at
  most ``bucket_bytes`` (`Segment.parts`), and a device's chunk of a bucket
  is whole rows, encoded as one flat array. A leaf's last, partial bucket
  is zero-padded; compressors whose statistics padding would bias
  (`Compressor.masks_padding`) get its real count in ``valid``.
* ``"column"``: a *column segment* (`ColumnSegment`). Each leaf is viewed
  as a ``(rows, cols)`` matrix (`qcollect.matrix_view`: the last axis indexes the
  columns, so a Flax kernel ``(in, out)`` or ``(kh, kw, in, out)`` has one
  column per output unit); leaves of one dtype and the same number of rows
  are placed side by side; a device's chunk is ``ceil(cols / N)`` whole
  columns, a ``(rows, c)`` matrix encoded with column groups (reduced along
  axis 0, no transpose). Columns are strided in memory: the collective
  encodes each chunk's block straight from the side-by-side matrix
  (`ColumnSegment.take`), and only the decoded chunks are copied back from
  ``(N, rows, c)`` to ``(rows, N c)``. The quantizer benchmark's
  ``collective layout`` rows measure the cost next to buckets.
* ``"leaf"``: one segment per leaf, never fused; each device owns a share
  of the leaf, coded as its own group. A leaf with at least N columns in
  its matrix view is shared by whole columns (a column segment), so every
  share holds weights from all the layer's inputs and the shares' statistics
  (ranges, entropies, hence planned sizes, which must be equal across
  devices) agree; a vector is cut into equal runs of ``ceil(size / N)``
  values, the last share's padding marked in ``valid``.

Padding rows and columns (when they do not divide by N) are all zeros, whose
statistics are harmless (zero means, scales and ranges) and which are dropped
after decoding; when ``valid`` is passed they count 0.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qcollect._config import check_int
from qcollect._groups import matrix_view
from qcollect._offsets import runtime_slices

__all__ = ["BUCKET_BYTES", "GROUPINGS", "ColumnSegment", "RowSegment", "Segment", "leaf_chunks",
           "plan_segments"]

#: Default bucket size: small leaves ride together in buckets of 4 MiB; a
#: leaf of 4 MiB or more is reduced on its own, without a concatenation copy.
BUCKET_BYTES = 4 << 20

GROUPINGS = ("element", "bucket", "column", "leaf")
#: `Compressor.grouping`: one of `GROUPINGS`.
Grouping = Literal["element", "bucket", "column", "leaf"]


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
        (`qcollect._buckets`).
    """

    #: Whether chunks are column blocks of a side-by-side matrix (encoded one
    #: by one, `qcollect._algorithms.Codec.round_trip_all`).
    columns: ClassVar[bool]

    members: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: np.dtype
    spans: tuple[int, ...]
    n: int
    bucket: int | None = None

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

    def chunks(self, leaves) -> jax.Array:
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
    def take(self, laid_out: jax.Array, j) -> jax.Array:
        """Chunk ``j`` (traced, taken modulo ``n``) of a `laid_out` array."""

    @property
    def _padded(self) -> int:
        """Spans of all buckets, padding included."""
        return sum(count * self.n * per_chunk for count, per_chunk in self.parts)

    @abc.abstractmethod
    def _stream(self, leaves) -> jax.Array:
        """The members one after the other, padded to `_padded` spans."""

    def laid_out(self, leaves) -> jax.Array:
        """The members laid out for one bucket's chunks (`take` reads chunk
        ``j``). One bucket only (see `bucketed`)."""
        self._check_single()
        return self._laid_out_stream(self._stream(leaves))

    def _laid_out_stream(self, stream: jax.Array) -> jax.Array:
        return stream

    def bucketed(self, leaves) -> list[jax.Array]:
        """Per `parts` entry, its buckets stacked (`_bucket_run`)."""
        stream = self._stream(leaves)
        out, offset = [], 0
        for count, per_chunk in self.parts:
            size = count * self.n * per_chunk
            out.append(self._bucket_run(stream, offset, size, count, per_chunk))
            offset += size
        return out

    @abc.abstractmethod
    def _bucket_run(self, stream, offset: int, size: int, count: int,
                    per_chunk: int) -> jax.Array:
        """The ``count`` buckets of ``size`` spans from span ``offset`` of
        the `_stream`, stacked."""

    def leaves(self, chunks: jax.Array) -> list[jax.Array]:
        """Inverse of `chunks`: the members' arrays, padding dropped."""
        self._check_single()
        return self.unbucketed([chunks[None]])

    @abc.abstractmethod
    def unbucketed(self, parts) -> list[jax.Array]:
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

    columns: ClassVar[bool] = False
    width: int

    @property
    def unit(self) -> int:
        return self.width

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return (self.per_chunk * self.width,)

    def stacked(self, laid_out: jax.Array) -> jax.Array:
        return laid_out

    def take(self, laid_out: jax.Array, j) -> jax.Array:
        return lax.dynamic_index_in_dim(laid_out, j % self.n, keepdims=False)

    def _stream(self, leaves) -> jax.Array:
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

    def _bucket_run(self, stream, offset, size, count, per_chunk):
        """``(count, n, per_chunk * width)`` chunks."""
        part = stream[offset * self.width:(offset + size) * self.width]
        return part.reshape(count, self.n, per_chunk * self.width)

    def unbucketed(self, parts) -> list[jax.Array]:
        pieces = [p.reshape(-1) for p in parts]
        starts = np.cumsum([0] + [span * self.width for span in self.spans[:-1]])
        members = _cut(pieces, [int(s) for s in starts],
                       [math.prod(shape) for shape in self.shapes], axis=0)
        return [m.reshape(shape) for m, shape in zip(members, self.shapes, strict=True)]

    def bucket_valid(self) -> list[np.ndarray] | None:
        counts = []
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
        out, offset = [], 0
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

    columns: ClassVar[bool] = True
    rows: int

    @property
    def unit(self) -> int:
        return self.rows

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return (self.rows, self.per_chunk)

    def stacked(self, laid_out: jax.Array) -> jax.Array:
        return laid_out.reshape(self.rows, self.n, -1).transpose(1, 0, 2)

    def take(self, laid_out: jax.Array, j) -> jax.Array:
        return lax.dynamic_slice_in_dim(laid_out, (j % self.n) * self.per_chunk,
                                        self.per_chunk, axis=1)

    def _stream(self, leaves) -> jax.Array:
        """The ``(rows, _padded)`` matrix of the members' columns side by
        side (chunk ``j`` of one bucket is columns ``[j c, (j + 1) c)``)."""
        parts = [jnp.asarray(leaves[i]) for i in self.members]
        mats = [p.reshape(self.rows, s) for p, s in zip(parts, self.spans, strict=True)]
        pad = self._padded - self.length
        if pad:
            mats.append(jnp.zeros((self.rows, pad), parts[0].dtype))
        return mats[0] if len(mats) == 1 else jnp.concatenate(mats, axis=1)

    def _bucket_run(self, stream, offset, size, count, per_chunk):
        """``(count, rows, n * per_chunk)`` side-by-side matrices (one copy of
        the columns, only when there is more than one bucket)."""
        part = stream[:, offset:offset + size] if size != stream.shape[1] else stream
        return part.reshape(self.rows, count, self.n * per_chunk).transpose(1, 0, 2)

    def unbucketed(self, parts) -> list[jax.Array]:
        pieces = [p.transpose(2, 0, 1, 3).reshape(self.rows, -1) for p in parts]
        starts = np.cumsum([0] + list(self.spans[:-1]))
        members = _cut(pieces, [int(s) for s in starts], list(self.spans), axis=1)
        return [m.reshape(shape) for m, shape in zip(members, self.shapes, strict=True)]


def _cut(pieces, starts, sizes, axis: int) -> list[jax.Array]:
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
    members: list = [None] * len(starts)
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


def _units(shape, grouping: str, block: int, n: int) -> tuple[bool, int, int]:
    """``(columns, unit, span)`` of one leaf."""
    size = math.prod(shape)
    if size == 0:
        return False, 1, 0
    rows, cols = matrix_view(tuple(shape))
    if grouping == "column" or (grouping == "leaf" and 1 < n <= cols):
        return True, rows, cols
    width = {"element": 1, "bucket": block, "leaf": -(-size // n)}[grouping]
    return False, width, -(-size // width)


def plan_segments(leaves, grouping: Grouping = "element", block: int = 1, n: int = 1, *,
                  fuse: bool = True, bucket_bytes: int | None = BUCKET_BYTES
                  ) -> list[Segment]:
    """Lays out ``leaves`` (arrays or shape/dtype structs) into segments.

    Args:
      leaves: the leaves, in tree order.
      grouping: the compressor's `Compressor.grouping`.
      block: values per bucket for ``"bucket"``.
      n: devices along the axis.
      fuse: place leaves of one dtype (and, for columns, one row count)
        together; False (or ``"leaf"`` grouping) gives every leaf its own.
      bucket_bytes: bucket size: fused leaves form one segment per dtype
        (and row width), reduced in buckets of whole groups of at most
        ``bucket_bytes`` (`Segment.parts`: full buckets run as one batch, so
        the program does not grow with the model); a leaf of
        ``bucket_bytes`` or more goes alone, as one bucket (never copied
        into a concatenation). None: one bucket for everything.

    Returns:
      Segments covering every leaf once, in the order of their first leaf.
      Empty leaves get segments of their own with no rows.
    """
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
    bucket_bytes = check_int("bucket_bytes", bucket_bytes, low=0, allow_none=True)
    check_int("block", block, low=1)
    alone = not fuse or grouping == "leaf" or bucket_bytes == 0
    segments: list[dict] = []
    streams: dict[tuple, dict] = {}
    for i, leaf in enumerate(leaves):
        shape, dtype = tuple(leaf.shape), jnp.dtype(leaf.dtype)
        columns, unit, span = _units(shape, grouping, block, n)
        nbytes = math.prod(shape) * dtype.itemsize
        key = (dtype, columns, unit)
        by_itself = alone or span == 0 or (bucket_bytes is not None and nbytes >= bucket_bytes)
        current = None if by_itself else streams.get(key)
        if current is None:
            bucket = None
            if not by_itself and bucket_bytes is not None:
                bucket = max(1, bucket_bytes // (unit * dtype.itemsize) // n)
            current = {"key": key, "members": [], "shapes": [], "spans": [], "bucket": bucket}
            segments.append(current)
            if not by_itself:
                streams[key] = current
        current["members"].append(i)
        current["shapes"].append(shape)
        current["spans"].append(span)
    return [_segment(s["key"], members=tuple(s["members"]), shapes=tuple(s["shapes"]),
                     spans=tuple(s["spans"]), n=n, bucket=s["bucket"]) for s in segments]


def _segment(key: tuple, **fields) -> Segment:
    """The segment of ``key = (dtype, columns, unit)`` (`_units`)."""
    dtype, columns, unit = key
    if columns:
        return ColumnSegment(dtype=dtype, rows=unit, **fields)
    return RowSegment(dtype=dtype, width=unit, **fields)


def leaf_chunks(x, compressor, num_devices: int):
    """The chunks `qcollect.compressed_all_reduce` encodes for the leaf ``x``
    reduced on its own over ``num_devices`` devices.

    For planning data-dependent sizes on exactly what will be encoded (the
    entropy quantizer's `EntropyCompressor.plan` per chunk), or for looking
    at the layout.

    Args:
      x: an array.
      compressor: the `Compressor` (its grouping decides the layout).
      num_devices: devices along the axis.

    Returns:
      ``(chunks, valid)``: ``(num_devices, *chunk_shape)`` chunks of whole
      groups (zero-padded), and ``(num_devices, groups per chunk)`` int32
      real counts to pass as ``encode(..., valid=valid[j])`` (None when the
      compressor takes none or no group holds padding).

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> chunks, valid = qc.leaf_chunks(jnp.ones((3, 8)), qc.entropy(), 4)
      >>> chunks.shape, valid   # two whole columns per device
      ((4, 3, 2), None)
    """
    check_int("num_devices", num_devices, low=1)
    x = jnp.asarray(x)
    (segment,) = plan_segments([x], compressor.grouping, compressor.block, num_devices,
                               fuse=False)
    valid = segment.valid() if compressor.masks_padding else None
    return segment.chunks([x]), None if valid is None else jnp.asarray(valid)
