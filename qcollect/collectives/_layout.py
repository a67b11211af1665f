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

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qcollect._payload import GROUPINGS, Compressor, Grouping
from qcollect.checks import check_int
from qcollect.collectives._segments import ColumnSegment, RowSegment, Segment
from qcollect.compressors._groups import matrix_view

__all__ = ["BUCKET_BYTES", "GROUPINGS", "Grouping", "leaf_chunks", "plan_segments"]

#: Default bucket size: small leaves ride together in buckets of 4 MiB; a
#: leaf of 4 MiB or more is reduced on its own, without a concatenation copy.
BUCKET_BYTES = 4 << 20


def _units(shape: tuple[int, ...], grouping: Grouping, block: int,
           n: int) -> tuple[type[Segment], int, int]:
    """``(kind, unit, span)`` of one leaf: the segment kind that holds it,
    the values of one of its spans, and its spans."""
    size = math.prod(shape)
    if size == 0:
        return RowSegment, 1, 0
    rows, cols = matrix_view(tuple(shape))
    if grouping == "column" or (grouping == "leaf" and 1 < n <= cols):
        return ColumnSegment, rows, cols
    width = {"element": 1, "bucket": block, "leaf": -(-size // n)}[grouping]
    return RowSegment, width, -(-size // width)


def plan_segments(leaves: Sequence[Any], grouping: Grouping = "element", block: int = 1,
                  n: int = 1, *,
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
    segments: list[dict[str, Any]] = []
    streams: dict[tuple[np.dtype, type[Segment], int], dict[str, Any]] = {}
    for i, leaf in enumerate(leaves):
        shape, dtype = tuple(leaf.shape), jnp.dtype(leaf.dtype)
        kind, unit, span = _units(shape, grouping, block, n)
        nbytes = math.prod(shape) * dtype.itemsize
        key = (dtype, kind, unit)
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


def _segment(key: tuple[np.dtype, type[Segment], int], **fields: Any) -> Segment:
    """The segment of ``key = (dtype, kind, unit)`` (`_units`)."""
    dtype, kind, unit = key
    return kind.planned(dtype=dtype, unit=unit, **fields)


def leaf_chunks(x: jax.Array, compressor: Compressor,
                num_devices: int) -> tuple[jax.Array, jax.Array | None]:
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
