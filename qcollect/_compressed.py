"""Compressed all-reduce: three algorithms from the seed papers.

All three lay the leaves out into segments of whole compressor groups and cut
each segment into N chunks of whole groups, one per device of ``axis_name``
(`qcollect._layout`: no bucket, column or entropy range ever spans two leaves
or two devices, so every leaf is coded as the paper codes one layer), and
differ in where encoding and decoding happen:

``"ring"`` -- compressed-domain ring (Yu et al., GradiVeQ, Algorithm 1 and
  eq. 1). For linear compressors only. Every device encodes its own chunks;
  payloads are summed hop by hop *without decoding* during N - 1
  scatter-reduce steps; the aggregated compressed chunks are all-gathered
  around the ring and each is decoded once. Exact for ``identity``; for
  ``cast`` the sums round in the narrow dtype; for ``pca`` the mean term
  ``mu / N`` added by every device makes the decoded sum exact (eq. 4-5).

``"pairwise"`` -- pairwise-exchange reduce-scatter + ring all-gather with one
  re-quantization at the owner (Dryden et al. section 3.4; DeepSpeed's
  compressed all-reduce). Each chunk is encoded once by its origin and sent
  straight to its owner over N - 1 `ppermute` shifts (shift t moves chunk
  ``r + t`` from device r to device ``r + t``; each shift is its own
  permutation, so they are unrolled rather than looped); the owner decodes
  and sums the N payloads, re-encodes its reduced chunk once, and a ring
  all-gather moves that compressed result. The owner's re-encoding error is
  returned for a second level of error feedback.

``"ring_requantize"`` -- the classic ring where every hop decodes what it
  received, adds its own chunk and re-encodes (as in CGX). Quantization error
  is added at every one of the N - 1 hops, so the error of the sum grows with
  N; ``contributed`` can only report the first hop's encoding, the later
  re-encoding errors belonging to no single device.

Randomness: every device uses ``fold_in(key, axis_index)``, then one more
``fold_in`` per chunk, hop or buffer, so no two encodings share a stream.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from qcollect._config import check_choice, check_int
from qcollect._layout import BUCKET_BYTES, Segment, plan_segments
from qcollect._payload import Compressor
from qcollect._ring import (
    all_gather_invariant,
    as_varying,
    permute,
    shift_right,
    take_chunk,
)

__all__ = ["ALGORITHMS", "AllReduceResult", "compressed_all_reduce"]

ALGORITHMS = ("ring", "pairwise", "ring_requantize")


class AllReduceResult(NamedTuple):
    """What `compressed_all_reduce` returns.

    Attributes:
      value: the estimate of the sum (or mean) over devices, like ``x``.
      contributed: what this device's own encodings decode to, like ``x``; for
        error feedback keep ``x - contributed``.
      owner_error: ``"pairwise"`` only (else None): like ``x``, zero outside
        the chunk this device owns, and there the owner's re-encoding error
        ``reduced - decode(encode(reduced))`` (in sum units). Pass it back as
        ``owner_residual`` next step for two-level error feedback.
    """

    value: Any
    contributed: Any
    owner_error: Any


class _Chunks(NamedTuple):
    """One segment's values on this device, laid out for its ``n`` chunks.

    ``data`` is `Segment.laid_out`: the chunks stacked for a row segment, the
    side-by-side ``(rows, n c)`` matrix for a column segment, whose chunks are
    strided column blocks read by `take` (no copy of the whole segment).
    """

    data: jax.Array
    segment: Segment

    @property
    def n(self) -> int:
        return self.segment.n

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the stacked chunks, ``(n, *chunk_shape)``."""
        return (self.n,) + self.segment.chunk_shape

    def take(self, j) -> jax.Array:
        return self.segment.take(self.data, j)

    def stacked(self) -> jax.Array:
        if self.segment.columns:
            return self.data.reshape(self.segment.unit, self.n, -1).transpose(1, 0, 2)
        return self.data


class _Codec(NamedTuple):
    """A compressor bound to one segment: encode chunk ``j`` with its valid counts."""

    compressor: Compressor
    valid: jax.Array | None

    def _code(self, method, chunk, key, j):
        if self.valid is None:
            return method(chunk, key)
        valid = take_chunk(self.valid, j)
        # Padding must be zero, as `Compressor.masks_padding` promises: a sum
        # of decodes (the owner's, a ring hop's) holds whatever the decoder
        # put there (1-bit decodes a padding zero to its group's mean).
        rows = chunk.reshape(valid.shape[0], -1)
        real = jnp.arange(rows.shape[1], dtype=jnp.int32)[None, :] < valid[:, None]
        chunk = jnp.where(real, rows, jnp.zeros((), chunk.dtype)).reshape(chunk.shape)
        return method(chunk, key, valid=valid)

    def encode(self, chunk, key, j):
        return self._code(self.compressor.encode, chunk, key, j)

    def round_trip(self, chunk, key, j):
        """``(payload, decode(payload))`` of chunk ``j`` (`Compressor.round_trip`)."""
        return self._code(self.compressor.round_trip, chunk, key, j)

    def round_trip_all(self, chunks: _Chunks, keys):
        """Payloads of all ``n`` chunks and what they decode to, stacked.
        Contiguous chunks are vmapped; column blocks are encoded one after the
        other straight from the side-by-side matrix (XLA:CPU runs a vmapped
        column codec over a transposed copy several times slower than the
        loop)."""
        index = jnp.arange(chunks.n)
        if not chunks.segment.columns:
            return jax.vmap(self.round_trip)(chunks.data, keys, index)
        return lax.map(lambda j: self.round_trip(chunks.take(j), keys[j], j), index)

    def decode(self, payload):
        return self.compressor.decode(payload)

    def decode_all(self, payloads):
        return jax.vmap(self.compressor.decode)(payloads)


def _chunk_keys(key, n: int):
    return jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(n))


def _gather(axis_name, payload):
    """Every owner's reduced payload on every device, invariant along the axis."""
    return jax.tree.map(lambda leaf: all_gather_invariant(leaf[None], axis_name), payload)


def _ring_compressed(chunks, axis_name, codec, key, n, me):
    payloads, contributed = codec.round_trip_all(chunks, _chunk_keys(key, n))
    own = lambda j: jax.tree.map(lambda leaf: take_chunk(leaf, j), payloads)  # noqa: E731

    def step(s, acc):
        received = shift_right(acc, axis_name, n)
        return jax.tree.map(jnp.add, received, own(me - s - 2))

    reduced = lax.fori_loop(0, n - 1, step, as_varying(own(me - 1), axis_name))
    gathered = _gather(axis_name, reduced)
    return codec.decode_all(gathered), contributed, None


def _pairwise(chunks, axis_name, codec, key, n, me, owner_residual):
    payloads, contributed = codec.round_trip_all(chunks, _chunk_keys(key, n))
    mine = lambda j: jax.tree.map(lambda leaf: take_chunk(leaf, j), payloads)  # noqa: E731
    # received[t] comes from device me - t and encodes chunk `me`.
    received = [mine(me)]
    for t in range(1, n):
        perm = [(i, (i + t) % n) for i in range(n)]
        received.append(permute(mine(me + t), axis_name, perm))
    # Decode and add one payload at a time: one fused elementwise pass.
    # (Stacking the decodes and summing over axis 0 is a major-axis reduction,
    # which XLA:CPU runs many times slower than the adds.)
    reduced = functools.reduce(
        operator.add, [codec.decode(p).astype(jnp.float32) for p in received])
    if owner_residual is not None:
        reduced = reduced + owner_residual.take(me).astype(jnp.float32)
    requantized, decoded = codec.round_trip(reduced.astype(chunks.dtype),
                                            jax.random.fold_in(key, n), me)
    error = reduced - decoded.astype(jnp.float32)
    gathered = _gather(axis_name, requantized)
    owner_error = lax.dynamic_update_index_in_dim(
        jnp.zeros(chunks.shape, jnp.float32), error, me, 0)
    return codec.decode_all(gathered), contributed, owner_error


def _ring_requantize(chunks, axis_name, codec, key, n, me):
    first, decoded = codec.round_trip(chunks.take(me - 1), jax.random.fold_in(key, 0), me - 1)
    contributed = lax.dynamic_update_index_in_dim(
        chunks.stacked(), decoded.astype(chunks.dtype), (me - 1) % n, 0)

    def step(s, payload):
        received = shift_right(payload, axis_name, n)
        j = me - s - 2
        partial = (codec.decode(received).astype(jnp.float32)
                   + chunks.take(j).astype(jnp.float32))
        # Constant payload leaves (e.g. PCA's weight) must stay varying like the carry.
        return as_varying(codec.encode(partial.astype(chunks.dtype),
                                       jax.random.fold_in(key, s + 1), j), axis_name)

    reduced = lax.fori_loop(0, n - 1, step, as_varying(first, axis_name))
    gathered = _gather(axis_name, reduced)
    return codec.decode_all(gathered), contributed, None


def _reduce_segment(chunks: _Chunks, axis_name, codec, key, algorithm, owner_residual):
    """One segment's chunks -> (value, contributed, owner_error), each stacked
    ``(n, *chunk_shape)``."""
    n = chunks.n
    if n == 1:
        payload, decoded = codec.round_trip(chunks.take(0), key, 0)
        owner_error = jnp.zeros(chunks.shape, jnp.float32) if algorithm == "pairwise" else None
        # The gather over one device moves nothing; it makes the value invariant.
        return codec.decode_all(_gather(axis_name, payload)), decoded[None], owner_error
    me = lax.axis_index(axis_name)
    chunks = chunks._replace(data=as_varying(chunks.data, axis_name))
    if algorithm == "ring":
        return _ring_compressed(chunks, axis_name, codec, key, n, me)
    if algorithm == "pairwise":
        return _pairwise(chunks, axis_name, codec, key, n, me, owner_residual)
    return _ring_requantize(chunks, axis_name, codec, key, n, me)


def _pieces(chunks: _Chunks, valid, residual, pipeline: int):
    """A row segment's chunks cut into ``pipeline`` runs of whole rows each
    (fewer when a chunk has fewer rows): ``[(chunks, valid, residual)]``, the
    piece ``k`` of every device's chunk together. Column segments are one piece."""
    seg = chunks.segment
    rows = seg.per_chunk
    count = min(pipeline, rows) if not seg.columns else 1
    if count <= 1:
        return [(chunks, valid, residual)]
    bounds = [rows * k // count for k in range(count + 1)]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        piece = Segment((0,), ((seg.n * (hi - lo) * seg.unit,),), seg.dtype, False, seg.unit,
                        (seg.n * (hi - lo),), seg.n)
        cut = lambda a, lo=lo, hi=hi: a[:, lo * seg.unit:hi * seg.unit]  # noqa: E731
        out.append((_Chunks(cut(chunks.data), piece),
                    None if valid is None else valid[:, lo:hi],
                    None if residual is None else _Chunks(cut(residual.data), piece)))
    return out


def _reduce_pieces(chunks, axis_name, compressor, valid, key, algorithm, residual, pipeline):
    """`_reduce_segment` of each pipeline piece, the results joined along the rows."""
    pieces = _pieces(chunks, valid, residual, pipeline)
    results = []
    for k, (part, part_valid, part_residual) in enumerate(pieces):
        codec = _Codec(compressor, None if part_valid is None else jnp.asarray(part_valid))
        results.append(_reduce_segment(part, axis_name, codec,
                                       key if len(pieces) == 1 else jax.random.fold_in(key, k),
                                       algorithm, part_residual))
    if len(results) == 1:
        return results[0]
    return tuple(None if parts[0] is None else jnp.concatenate(parts, axis=1)
                 for parts in zip(*results, strict=True))


def compressed_all_reduce(x, axis_name, compressor: Compressor, key=None, *,
                          algorithm: str = "auto", mean: bool = False, fuse: bool = True,
                          bucket_bytes: int | None = BUCKET_BYTES, pipeline: int = 1,
                          owner_residual=None) -> AllReduceResult:
    """All-reduce of an array or pytree with every hop compressed.

    Args:
      x: array or pytree of arrays, this device's contribution.
      axis_name: the mapped axis (inside `jax.shard_map` or `jax.pmap`).
      compressor: any qcollect `Compressor`.
      key: PRNG key (needed by stochastic compressors); folded with the
        device index, so pass the same key on every device.
      algorithm: ``"ring"`` (linear compressors), ``"pairwise"``,
        ``"ring_requantize"``, or ``"auto"``: ring for linear compressors,
        else pairwise. See the module docstring.
      mean: divide the sum by the number of devices.
      fuse: place leaves of one dtype side by side in one segment (default),
        so small leaves ride together: whole buckets row after row, or for
        ``grouping="column"`` compressors the columns of leaves with the
        same number of rows; ``"leaf"``-grouped compressors (entropy, QSGD
        with one scale per array) never fuse. Fusion never changes a leaf's
        statistics, only how many collectives run. With False every leaf is
        reduced on its own.
      bucket_bytes: cap of a fused segment (default 4 MiB, like the buckets
        of PyTorch DDP): leaves fill a segment in tree order until the next
        would pass the cap, and a leaf of ``bucket_bytes`` or more is reduced
        on its own, so large leaves are not copied into a concatenation.
        None: no cap.
      pipeline: pieces per chunk (row segments; column segments are never
        cut): each device's chunk of a segment is cut into ``pipeline`` runs
        of whole groups, and each run is reduced by its own chain of
        collectives, so that XLA may encode or decode one run while another
        is on the wire. Values are those of ``pipeline=1`` up to rounding
        order and the random streams of stochastic compressors; groups are
        never cut, so the wire bytes grow at most by each run's last,
        partly filled packed word. Default 1: on the CPU backend no count
        helped (`docs/collectives.md`, "Pipelining").
      owner_residual: ``"pairwise"`` only: the previous step's ``owner_error``
        (same structure as ``x``), added to the owner's reduced chunk before
        re-encoding.

    Returns:
      `AllReduceResult` ``(value, contributed, owner_error)``, each like ``x``
      (owner_error None unless pairwise). ``value`` is the same on every
      device and typed invariant along ``axis_name`` (it can leave
      ``shard_map`` with ``out_specs=P()``); ``contributed`` and
      ``owner_error`` are this device's own, typed varying.

    Raises:
      ValueError: unknown algorithm, ``"ring"`` with a non-linear compressor,
        or ``owner_residual`` with another algorithm.

    References:
      Yu et al., GradiVeQ, Algorithm 1; Dryden et al. section 3.4;
      Gibiansky (ring all-reduce).
    """
    check_choice("algorithm", algorithm, ("auto",) + ALGORITHMS)
    pipeline = check_int("pipeline", pipeline, low=1)
    if algorithm == "auto":
        algorithm = "ring" if compressor.linear else "pairwise"
    if algorithm == "ring" and not compressor.linear:
        raise ValueError(f"algorithm='ring' sums payloads in the compressed domain and needs "
                         f"a linear compressor; {compressor.name} is not (use 'pairwise')")
    if owner_residual is not None and algorithm != "pairwise":
        raise ValueError("owner_residual is only used by algorithm='pairwise'")
    if compressor.stochastic and key is None:
        raise ValueError(f"{compressor.name} is stochastic: pass key")
    if key is None:
        key = jax.random.key(0)
    key = jax.random.fold_in(key, lax.axis_index(axis_name))
    n = int(lax.axis_size(axis_name))

    leaves, treedef = jax.tree.flatten(x)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    owners = (treedef.flatten_up_to(owner_residual) if owner_residual is not None
              else None)
    out = {"value": [None] * len(leaves), "contributed": [None] * len(leaves),
           "owner": [None] * len(leaves)}
    segments = plan_segments(leaves, compressor.grouping, compressor.block, n,
                             fuse=fuse, bucket_bytes=bucket_bytes)
    for i, seg in enumerate(segments):
        if seg.length == 0:  # empty leaves
            for m in seg.members:
                out["value"][m] = jnp.zeros(leaves[m].shape, leaves[m].dtype)
                out["contributed"][m] = jnp.zeros_like(leaves[m])
                out["owner"][m] = jnp.zeros(leaves[m].shape, jnp.float32)
            continue
        valid = seg.valid() if compressor.masks_padding else None
        residual = None if owners is None else _Chunks(seg.laid_out(owners), seg)
        parts = _reduce_pieces(_Chunks(seg.laid_out(leaves), seg), axis_name, compressor,
                               valid, jax.random.fold_in(key, i), algorithm, residual, pipeline)
        for name, part in zip(("value", "contributed", "owner"), parts, strict=True):
            if part is not None:
                for m, leaf in zip(seg.members, seg.leaves(part), strict=True):
                    out[name][m] = leaf
    value, contributed = (treedef.unflatten(out[k]) for k in ("value", "contributed"))
    owner = treedef.unflatten(out["owner"]) if algorithm == "pairwise" else None
    if mean:
        value = jax.tree.map(lambda v: (v / n).astype(v.dtype), value)
    return AllReduceResult(value, contributed, owner)
