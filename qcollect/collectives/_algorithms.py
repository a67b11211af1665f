"""The per-segment algorithms of `qc.compressed_all_reduce`.

A segment's values arrive as `Chunks` (one per device of the axis, whole
compressor groups each); `reduce_segment` runs one of the three algorithms
(docs/collectives.md#compressed_all_reduce-and-its-three-algorithms) over
them and returns the reduced chunks, what this device contributed, and
(pairwise) the owner's re-encoding error. `gather_payloads` and
`received_payloads` are the two exchanges the algorithms share with the
sharded reduce-scatter and all-gather.

References:
  Yu et al. (GradiVeQ), NeurIPS 2018 <https://arxiv.org/abs/1811.03617>,
    Algorithm 1 (``"ring"``); Dryden et al., MLHPC 2016, section 3.4
    <https://doi.org/10.1109/MLHPC.2016.004> (``"pairwise"``); Markov,
    Ramezani and Alistarh, "CGX: Adaptive System Support for
    Communication-Efficient Deep Learning", Middleware 2022
    (``"ring_requantize"``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qcollect._payload import Compressor, Payload
from qcollect.checks import check_int
from qcollect.collectives._chunk_maps import ChunkMap, ChunkView
from qcollect.collectives._layout import plan_segments
from qcollect.collectives._messages import send_packed
from qcollect.collectives._result import AllReduceResult, AxisName
from qcollect.collectives._ring import (
    all_gather_invariant,
    as_varying,
    exchange_chunks,
    permute,
    shift_right,
    take_chunk,
)
from qcollect.collectives._segments import Segment

__all__ = ["EXCHANGES", "ChunkSource", "Chunks", "Codec", "Exchange", "ReduceAlgorithm",
           "Stacked", "collective_codec", "gather_payloads", "received_payloads",
           "reduce_pieces", "reduce_segment"]

#: How the pairwise and compressed-ring algorithms move each chunk's payloads
#: to its owner: N - 1 ``ppermute`` shifts (the default) or one
#: `lax.all_to_all` (`qc.compressed_all_reduce`, ``exchange``).
Exchange = Literal["permute", "all_to_all"]
#: The values of `Exchange`.
EXCHANGES: tuple[Exchange, ...] = ("permute", "all_to_all")
#: The algorithm `reduce_segment` runs (``"auto"`` resolved).
ReduceAlgorithm = Literal["ring", "pairwise", "ring_requantize"]


class ChunkSource(ChunkView, Protocol):
    """What the algorithms read of a segment's chunks on this device: `Chunks`
    (laid out by a `Segment`) or `Stacked` (already ``(n, *chunk_shape)``)."""

    @property
    def data(self) -> jax.Array: ...

    @property
    def chunk_map(self) -> ChunkMap: ...

    @property
    def dtype(self) -> Any: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    def _replace(self, *, data: Any = ...) -> ChunkSource: ...


class Chunks(NamedTuple):
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
    def chunk_map(self) -> ChunkMap:
        return self.segment.chunk_map

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the stacked chunks, ``(n, *chunk_shape)``."""
        return (self.n,) + self.segment.chunk_shape

    def take(self, j: jax.Array | int) -> jax.Array:
        return self.segment.take(self.data, j)

    def stacked(self) -> jax.Array:
        return self.segment.stacked(self.data)


class Stacked(NamedTuple):
    """Chunks already stacked ``(n, *chunk_shape)`` (a node's share in the
    hierarchical all-reduce), coded as their segment's kind codes its
    chunks (``chunk_map``); a `ChunkSource` like `Chunks`."""

    data: jax.Array
    chunk_map: ChunkMap

    @property
    def n(self) -> int:
        return self.data.shape[0]

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def take(self, j: jax.Array | int) -> jax.Array:
        return take_chunk(self.data, j)

    def stacked(self) -> jax.Array:
        return self.data


class Codec(NamedTuple):
    """A compressor bound to one segment: encode chunk ``j`` with its valid counts."""

    compressor: Compressor
    valid: jax.Array | None

    def _code(self, method: Callable[..., Any], chunk: jax.Array, key: jax.Array,
              j: jax.Array | int) -> Any:
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

    def encode(self, chunk: jax.Array, key: jax.Array, j: jax.Array | int) -> Payload:
        return self._code(self.compressor.encode, chunk, key, j)

    def round_trip(self, chunk: jax.Array, key: jax.Array,
                   j: jax.Array | int) -> tuple[Payload, jax.Array]:
        """``(payload, decode(payload))`` of chunk ``j`` (`Compressor.round_trip`)."""
        return self._code(self.compressor.round_trip, chunk, key, j)

    def round_trip_all(self, chunks: ChunkSource, keys: jax.Array) -> tuple[Payload, jax.Array]:
        """Payloads of all ``n`` chunks and what they decode to, stacked, in
        the way the chunks' kind codes them (`Segment.chunk_map`)."""
        return chunks.chunk_map(self.round_trip, chunks, keys)

    def decode(self, payload: Payload) -> jax.Array:
        return self.compressor.decode(payload)

    def decode_all(self, payloads: Payload) -> jax.Array:
        return jax.vmap(self.compressor.decode)(payloads)


def _chunk_keys(key: jax.Array, n: int) -> jax.Array:
    return jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(n))


def gather_payloads(axis_name: AxisName, payload: Any) -> Any:
    """Every owner's reduced payload on every device, invariant along the axis:
    one all-gather of the payload's arrays packed together (`send_packed`)."""
    leaves, treedef = jax.tree.flatten(payload)
    gathered = send_packed(lambda leaf: all_gather_invariant(leaf, axis_name),
                           [leaf[None] for leaf in leaves], lead=1)
    return jax.tree.unflatten(treedef, gathered)


def _chunk_of(payloads: Any, j: jax.Array | int) -> Any:
    """Chunk ``j`` (modulo n) of stacked payloads."""
    return jax.tree.map(lambda leaf: take_chunk(leaf, j), payloads)


def received_payloads(payloads: Any, axis_name: AxisName, n: int, me: jax.Array,
                      exchange: Exchange) -> list[Any]:
    """The ``n`` payloads of chunk ``me``, ``received[t]`` from device
    ``me - t``, ``payloads`` holding this device's ``n`` stacked ones: one
    `exchange_chunks`, or N - 1 `permute` shifts (shift t moves payload
    ``r + t`` from device r to device ``r + t``; each shift is its own
    permutation, so they are unrolled rather than looped). The order is the
    same both ways, so are the owner's sums."""
    if exchange == "all_to_all":
        every = exchange_chunks(as_varying(payloads, axis_name), axis_name)
        return [_chunk_of(every, me - t) for t in range(n)]
    received = [_chunk_of(payloads, me)]
    for t in range(1, n):
        perm = [(i, (i + t) % n) for i in range(n)]
        received.append(permute(_chunk_of(payloads, me + t), axis_name, perm))
    return received


def _ring_compressed(chunks: ChunkSource, axis_name: AxisName, codec: Codec, key: jax.Array,
                     n: int, me: jax.Array, exchange: Exchange) -> AllReduceResult:
    """GradiVeQ's compressed-domain ring: payloads summed without decoding."""
    payloads, contributed = codec.round_trip_all(chunks, _chunk_keys(key, n))
    if exchange == "all_to_all":
        # The scatter-reduce as one exchange: the owner adds the n payloads
        # of its chunk in the compressed domain, as the ring's hops would.
        reduced = functools.reduce(
            lambda a, b: jax.tree.map(jnp.add, a, b),
            received_payloads(payloads, axis_name, n, me, exchange))
    else:
        def step(s: jax.Array, acc: Any) -> Any:
            received = shift_right(acc, axis_name, n)
            return jax.tree.map(jnp.add, received, _chunk_of(payloads, me - s - 2))

        reduced = lax.fori_loop(0, n - 1, step,
                                as_varying(_chunk_of(payloads, me - 1), axis_name))
    gathered = gather_payloads(axis_name, reduced)
    return AllReduceResult(codec.decode_all(gathered), contributed, None)


def _pairwise(chunks: ChunkSource, axis_name: AxisName, codec: Codec, key: jax.Array, n: int,
              me: jax.Array, owner_residual: ChunkSource | None,
              exchange: Exchange) -> AllReduceResult:
    """Dryden's pairwise exchange: one encoding per chunk, one re-encoding at its owner."""
    payloads, contributed = codec.round_trip_all(chunks, _chunk_keys(key, n))
    received = received_payloads(payloads, axis_name, n, me, exchange)
    # One payload at a time, one fused pass (_backend.DECODES_ADDED_ONE_BY_ONE).
    reduced = functools.reduce(
        operator.add, [codec.decode(p).astype(jnp.float32) for p in received])
    if owner_residual is not None:
        reduced = reduced + owner_residual.take(me).astype(jnp.float32)
    requantized, decoded = codec.round_trip(reduced.astype(chunks.dtype),
                                            jax.random.fold_in(key, n), me)
    error = reduced - decoded.astype(jnp.float32)
    gathered = gather_payloads(axis_name, requantized)
    owner_error = lax.dynamic_update_index_in_dim(
        jnp.zeros(chunks.shape, jnp.float32), error, me, 0)
    return AllReduceResult(codec.decode_all(gathered), contributed, owner_error)


def _ring_requantize(chunks: ChunkSource, axis_name: AxisName, codec: Codec, key: jax.Array,
                     n: int, me: jax.Array) -> AllReduceResult:
    """The classic ring, every hop decoding, adding and re-encoding (CGX)."""
    first, decoded = codec.round_trip(chunks.take(me - 1), jax.random.fold_in(key, 0), me - 1)
    contributed = lax.dynamic_update_index_in_dim(
        chunks.stacked(), decoded.astype(chunks.dtype), (me - 1) % n, 0)

    def step(s: jax.Array, payload: Any) -> Any:
        received = shift_right(payload, axis_name, n)
        j = me - s - 2
        partial = (codec.decode(received).astype(jnp.float32)
                   + chunks.take(j).astype(jnp.float32))
        # Constant payload leaves (e.g. PCA's weight) must stay varying like the carry.
        return as_varying(codec.encode(partial.astype(chunks.dtype),
                                       jax.random.fold_in(key, s + 1), j), axis_name)

    reduced = lax.fori_loop(0, n - 1, step, as_varying(first, axis_name))
    gathered = gather_payloads(axis_name, reduced)
    return AllReduceResult(codec.decode_all(gathered), contributed, None)


def reduce_segment(chunks: ChunkSource, axis_name: AxisName, codec: Codec, *, key: jax.Array,
                   algorithm: ReduceAlgorithm, owner_residual: ChunkSource | None,
                   exchange: Exchange = "permute") -> AllReduceResult:
    """One segment's chunks -> `AllReduceResult` ``(value, contributed,
    owner_error)``, each stacked ``(n, *chunk_shape)``; ``exchange`` (one of
    `EXCHANGES`) moves the payloads of ``"ring"`` and ``"pairwise"``."""
    n = chunks.n
    if n == 1:
        payload, decoded = codec.round_trip(chunks.take(0), key, 0)
        owner_error = jnp.zeros(chunks.shape, jnp.float32) if algorithm == "pairwise" else None
        # The gather over one device moves nothing; it makes the value invariant.
        return AllReduceResult(codec.decode_all(gather_payloads(axis_name, payload)),
                               decoded[None], owner_error)
    me = lax.axis_index(axis_name)
    chunks = chunks._replace(data=as_varying(chunks.data, axis_name))
    if algorithm == "ring":
        return _ring_compressed(chunks, axis_name, codec, key, n, me, exchange)
    if algorithm == "pairwise":
        return _pairwise(chunks, axis_name, codec, key, n, me, owner_residual, exchange)
    return _ring_requantize(chunks, axis_name, codec, key, n, me)


#: A pipeline piece: its chunks, valid counts and owner residual.
_Piece = tuple[ChunkSource, Any, "ChunkSource | None"]


def _pieces(chunks: Chunks, valid: Any, residual: Chunks | None,
            pipeline: int) -> list[_Piece]:
    """A segment's chunks cut into its `Segment.pipeline_pieces`:
    ``[(chunks, valid, residual)]``, the piece ``k`` of every device's chunk
    together; the chunks whole when the segment makes no pieces."""
    pieces = chunks.segment.pipeline_pieces(pipeline)
    if not pieces:
        return [(chunks, valid, residual)]
    return [(Chunks(piece.cut(chunks.data), piece.layout),
             None if valid is None else piece.rows(valid),
             None if residual is None else Chunks(piece.cut(residual.data), piece.layout))
            for piece in pieces]


def reduce_pieces(chunks: Chunks, axis_name: AxisName, compressor: Compressor, *,
                  valid: jax.Array | np.ndarray | None, key: jax.Array,
                  algorithm: ReduceAlgorithm, residual: Chunks | None, pipeline: int,
                  exchange: Exchange = "permute") -> AllReduceResult:
    """`reduce_segment` of each pipeline piece, the results joined along the rows."""
    pieces = _pieces(chunks, valid, residual, pipeline)
    results = []
    for k, (part, part_valid, part_residual) in enumerate(pieces):
        codec = Codec(compressor, None if part_valid is None else jnp.asarray(part_valid))
        results.append(reduce_segment(part, axis_name, codec,
                                       key=key if len(pieces) == 1 else jax.random.fold_in(key, k),
                                       algorithm=algorithm, owner_residual=part_residual,
                                       exchange=exchange))
    if len(results) == 1:
        return results[0]
    return AllReduceResult(*(None if parts[0] is None else jnp.concatenate(parts, axis=1)
                             for parts in zip(*results, strict=True)))


def collective_codec(compressor: Compressor, like: jax.Array | jax.ShapeDtypeStruct,
                     num_devices: int) -> Compressor:
    """``compressor`` as `qc.compressed_all_reduce` codes one leaf
    shaped like ``like`` reduced on its own over ``num_devices`` devices.

    ``encode(x, key)`` lays ``x`` out into ``num_devices`` chunks of whole
    groups (buckets: a reshape; columns: blocks of whole columns read from
    the matrix, no copy) and encodes every chunk with the collective's own
    code (padding masked as the collective masks it), returning the stacked
    payloads; ``decode`` decodes them and lays the values back (for columns
    a copy of ``(N, rows, c)`` into ``(rows, N c)``). Side by side with
    ``compressor`` itself this is what the collective's layout costs (the
    quantizer benchmark's ``collective layout`` rows).

    Args:
      compressor: a `Compressor`.
      like: an array or ``jax.ShapeDtypeStruct``: the leaf's shape and dtype.
      num_devices: devices along the axis, >= 1.

    Returns:
      A `Compressor` named ``"<name>/layout<num_devices>"`` for arrays shaped
      like ``like``.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> x = jnp.arange(24.0).reshape(3, 8)
      >>> c = qc.collective_codec(qc.cast("bfloat16"), x, 4)
      >>> payload = c.encode(x, jax.random.key(0))
      >>> c.name, bool((c.decode(payload) == x).all())
      ('cast/bfloat16/layout4', True)
    """
    num_devices = check_int("num_devices", num_devices, low=1)
    (segment,) = plan_segments([like], compressor.grouping, compressor.block, num_devices,
                               bucket_bytes=None)
    valid = segment.valid() if compressor.masks_padding else None
    codec = Codec(compressor, None if valid is None else jnp.asarray(valid))
    name = f"{compressor.name}/layout{num_devices}"

    def encode(x: jax.Array, key: jax.Array | None = None) -> Payload:
        keys = jax.random.split(jax.random.key(0) if key is None else key, num_devices)
        chunks = codec.round_trip_all(Chunks(segment.laid_out([x]), segment), keys)[0]
        return Payload(chunks.arrays, tuple(x.shape), x.dtype, name)

    def decode(payload: Payload) -> jax.Array:
        chunks = Payload(payload.arrays, segment.chunk_shape, payload.dtype, compressor.name)
        return segment.leaves(codec.decode_all(chunks))[0]

    return Compressor(name, encode, decode, linear=compressor.linear,
                      stochastic=compressor.stochastic)
