"""Ring reduce-scatter, all-gather and all-reduce written with `lax.ppermute`.

Gibiansky, "Bringing HPC Techniques to Deep Learning" (the Baidu ring
all-reduce): the N devices of ``axis_name`` form a logical ring; the buffer is
cut into N chunks; N - 1 scatter-reduce steps leave device ``r`` with the sum of
chunk ``r``; N - 1 all-gather steps circulate the reduced chunks. Every step
moves one chunk of K/N elements to the right-hand neighbour, so each device
sends ``2 (N - 1) K / N`` elements, independent of N: the bandwidth-optimal
figure of the paper.

The steps run in a `lax.fori_loop`, so the compiled program holds one
collective-permute whatever N is. The functions work inside any context that
binds ``axis_name``: `jax.shard_map` (with ``check_vma=True``) and `jax.pmap`.

Types under ``shard_map``'s check: `ring_reduce_scatter` and
`ring_all_gather` return values varying along ``axis_name`` (as
`lax.psum_scatter` and `lax.all_gather` do). `ring_all_reduce` ends in
`all_gather_invariant` (``lax.all_gather(..., to="invarying")``), so its
result is invariant, like `lax.psum`'s: it can be returned with
``out_specs=P()`` and added to replicated parameters. The gather moves the
same ``(N - 1)`` blocks per device as the ring gather.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qcollect import _backend, _cluster
from qcollect.collectives._buckets import (
    BATCH_BUCKETS,
    BatchBuckets,
    check_batch_buckets,
    reduce_buckets,
)
from qcollect.collectives._layout import BUCKET_BYTES, plan_segments
from qcollect.collectives._messages import send_packed
from qcollect.collectives._result import AllReduceResult, AxisName
from qcollect.collectives._segments import Segment
from qcollect.varying import cast_varying

__all__ = [
    "all_gather_invariant",
    "as_varying",
    "chunk_rows",
    "exchange_chunks",
    "permute",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_bytes_per_device",
    "ring_reduce_scatter",
    "shift_right",
    "split_chunks",
    "take_chunk",
]


def _ring_size(axis_name: AxisName) -> int:
    return int(lax.axis_size(axis_name))


def permute(x: Any, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> Any:
    """`lax.ppermute` of a pytree as one message, 16-bit floats as 16-bit words.

    The leaves travel as one buffer of words, each viewed bit for bit: one
    exchange per permutation, not one per leaf, and 16-bit floats as their
    uint16 words, which no backend widens. Across processes on the CPU
    backend, a permutation in which two devices send to each other moves
    buffers over 256 KiB in 256 KiB pieces. The values and the bytes on the
    wire are those of `lax.ppermute` (docs/collectives.md#backend-workarounds).

    Args:
      x: a pytree of arrays (any dtypes and shapes).
      axis_name: the mapped axis (``shard_map`` or ``pmap``).
      perm: ``(source, destination)`` pairs of axis indices, as for
        `lax.ppermute`; a device that is no destination receives zeros.

    Returns:
      ``x``'s tree, each leaf as `lax.ppermute` would return it.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("d",))
      >>> swap = jax.shard_map(lambda t: qc.permute(t, "d", [(0, 1), (1, 0)]), mesh=mesh,
      ...                      in_specs=P("d"), out_specs=P("d"))
      >>> tree = {"w": jnp.arange(4.0), "b": jnp.array([1, 2], jnp.bfloat16)}
      >>> out = swap(jax.device_put(tree, NamedSharding(mesh, P("d"))))
      >>> out["w"].tolist(), out["b"].tolist()
      ([2.0, 3.0, 0.0, 1.0], [2.0, 1.0])
    """
    # _backend.MESSAGE_PER_ARRAY, _backend.WIDE_16_BIT, _backend.SLOW_SWAPS.
    pieces = _backend.split_swaps(perm)
    send = _in_words(lambda a: _backend.ppermute_in_pieces(a, axis_name, perm, pieces))
    leaves, treedef = jax.tree.flatten(x)
    return jax.tree.unflatten(treedef, send_packed(send, leaves))


def _in_words(move: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """``move`` (a collective of one array) that sends 16-bit floats as their
    bit-identical uint16 words (`_backend.WIDE_16_BIT`).

    Every exchange of the ring and compressed collectives is built here, so
    this is where the first one traced registers the exit-time check of a
    cluster job never joined (`_cluster.watch_unjoined`).
    """
    _cluster.watch_unjoined()

    def moved(a: jax.Array) -> jax.Array:
        word = _backend.narrow_word(a.dtype)
        if word is None:
            return move(a)
        return lax.bitcast_convert_type(move(lax.bitcast_convert_type(a, word)), a.dtype)
    return moved


def exchange_chunks(x: Any, axis_name: AxisName) -> Any:
    """Every device's row ``me`` of ``x``, in one `lax.all_to_all`.

    Each leaf of ``x`` is stacked ``(N, ...)``, row ``j`` meant for device
    ``j`` of ``axis_name``; the result is like ``x``, its row ``s`` the row
    ``me`` that device ``s`` holds (row ``me`` its own). The leaves travel
    as one buffer of words, 16-bit floats as their uint16 words, as with
    `permute`: one exchange in which every device sends to every other at
    once, where N - 1 `permute` shifts send one after the other (the two
    ``exchange`` settings of `qc.compressed_all_reduce`). Each device sends
    ``(N - 1) / N`` of ``x``.

    References:
      Wang et al. (ZeRO++), 2023 <https://arxiv.org/abs/2306.10209>: qgZ,
      the quantized gradients' reduce-scatter as one all-to-all.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("d",))
      >>> swap = jax.shard_map(lambda t: qc.exchange_chunks(t, "d"), mesh=mesh,
      ...                      in_specs=P("d"), out_specs=P("d"))
      >>> x = jnp.array([[0.0], [1.0], [10.0], [11.0]])  # device 0: rows 0, 1
      >>> swap(jax.device_put(x, NamedSharding(mesh, P("d")))).ravel().tolist()
      [0.0, 10.0, 1.0, 11.0]
    """
    send = _in_words(lambda a: lax.all_to_all(a, axis_name, 0, 0))
    leaves, treedef = jax.tree.flatten(x)
    return jax.tree.unflatten(treedef, send_packed(send, leaves, lead=1))


def shift_right(x: Any, axis_name: AxisName, n: int) -> Any:
    """Sends ``x`` (any pytree) one step along the ring: device r -> r + 1."""
    return permute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])


def as_varying(x: Any, axis_name: AxisName) -> Any:
    """Marks ``x`` as varying along ``axis_name`` under shard_map's type check.

    Loop carries that pass through `lax.ppermute` are varying; an invariant
    initial value must be cast first. Outside shard_map (pmap) it is a no-op.
    """
    axes: tuple[Any, ...] = tuple(axis_name) if isinstance(axis_name, tuple) else (axis_name,)
    return cast_varying(x, axes)


def all_gather_invariant(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """All-gather along the leading axis whose result is invariant along ``axis_name``.

    ``lax.all_gather(x, axis_name, tiled=True, to="invarying")``: device
    ``r``'s block lands at rows ``[r * c, (r + 1) * c)`` on every device and
    the type system knows the result is the same everywhere, so it can leave
    ``shard_map`` with ``out_specs=P()``. Each device sends its block to the
    ``N - 1`` others, the bytes of a ring all-gather. 16-bit floats travel as
    their uint16 words, as with `permute`.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("d",))
      >>> gather = jax.shard_map(lambda v: qc.all_gather_invariant(v, "d"), mesh=mesh,
      ...                        in_specs=P("d"), out_specs=P())
      >>> gather(jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("d")))).tolist()
      [0.0, 1.0, 2.0, 3.0]
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("all_gather_invariant needs x with a leading axis, got a scalar")
    return _in_words(lambda a: lax.all_gather(as_varying(a, axis_name), axis_name, tiled=True,
                                              to="invarying"))(x)


def chunk_rows(rows: int, n: int) -> int:
    """Rows per chunk, ``ceil(rows / n)``, when ``rows`` are cut into ``n``
    equal, zero-padded chunks."""
    return -(-rows // n)


def split_chunks(x: jax.Array, n: int) -> jax.Array:
    """``(K, ...) -> (n, ceil(K / n), ...)``, zero-padded."""
    rows = chunk_rows(x.shape[0], n)
    pad = n * rows - x.shape[0]
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((n, rows) + x.shape[1:])


def take_chunk(chunks: jax.Array, index: jax.Array | int) -> jax.Array:
    """Chunk ``index`` (taken modulo the chunks) of stacked chunks."""
    return lax.dynamic_index_in_dim(chunks, index % chunks.shape[0], keepdims=False)


def ring_reduce_scatter(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Ring scatter-reduce along the leading axis.

    Args:
      x: array ``(K, ...)`` on every device.
      axis_name: the mapped axis to reduce over (N devices).

    Returns:
      ``(ceil(K / N), ...)``: on device ``r`` the sum over devices of rows
      ``[r * c, (r + 1) * c)`` of ``x``, ``c = ceil(K / N)``. When N divides K
      this equals ``lax.psum_scatter(x, axis_name, tiled=True)``; otherwise the
      rows past K are zero padding.

    Example:
      >>> # inside jax.shard_map(..., in_specs=P("d")), 4 devices, x of shape (8,)
      >>> # ring_reduce_scatter(x, "d").shape == (2,)
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("ring_reduce_scatter needs x with a leading axis, got a scalar")
    n = _ring_size(axis_name)
    chunks = split_chunks(x, n)
    if n == 1:
        return chunks[0]
    me = lax.axis_index(axis_name)
    # Step s: device r forwards its partial sum of chunk (r - s - 1) to r + 1,
    # which adds its own rows of that chunk. After N - 1 steps device r holds
    # the full sum of chunk r.
    def step(s: jax.Array, acc: jax.Array) -> jax.Array:
        return shift_right(acc, axis_name, n) + take_chunk(chunks, me - s - 2)

    return lax.fori_loop(0, n - 1, step, as_varying(take_chunk(chunks, me - 1), axis_name))


def ring_all_gather(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Ring all-gather along the leading axis: ``(c, ...) -> (N * c, ...)``.

    Equals ``lax.all_gather(x, axis_name, tiled=True)``: device ``r``'s block
    lands at rows ``[r * c, (r + 1) * c)`` on every device. Each device sends
    ``(N - 1) c`` rows in N - 1 steps.
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("ring_all_gather needs x with a leading axis, got a scalar")
    n = _ring_size(axis_name)
    if n == 1:
        return x
    word = _backend.narrow_word(x.dtype)
    if word is not None:
        # Gather the words themselves (_backend.WIDE_16_BIT): a float view converted
        # after each hop would be fused into the buffer update, rewriting the whole buffer.
        words = ring_all_gather(lax.bitcast_convert_type(x, word), axis_name)
        return lax.bitcast_convert_type(words, x.dtype)
    me = lax.axis_index(axis_name)
    x = as_varying(x, axis_name)
    gathered = jnp.zeros((n,) + x.shape, x.dtype)
    gathered = lax.dynamic_update_index_in_dim(gathered, x, me, 0)

    # Step s: the block received comes from device r - s - 1.
    def step(s: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        block, out = carry
        block = shift_right(block, axis_name, n)
        return block, lax.dynamic_update_index_in_dim(out, block, (me - s - 1) % n, 0)

    _, gathered = lax.fori_loop(0, n - 1, step, (x, gathered))
    return gathered.reshape((n * x.shape[0],) + x.shape[1:])


def ring_all_reduce(x: Any, axis_name: AxisName, *, bucket_bytes: int | None = BUCKET_BYTES,
                    batch_buckets: BatchBuckets = BATCH_BUCKETS) -> Any:
    """Ring all-reduce (sum) of an array or pytree: equals ``lax.psum``.

    Every leaf is flattened, zero-padded to a multiple of N, scatter-reduced
    and all-gathered around the ring, then unpadded and reshaped. Leaves of one
    dtype are fused first and reduced in buckets of up to ``bucket_bytes``,
    so small leaves ride together in one ring.

    Args:
      x: array or pytree of arrays (any shapes; float or integer dtypes).
      axis_name: the mapped axis to sum over.
      bucket_bytes: bucket size (default 4 MiB); a leaf of that
        size or more runs its own ring, without a concatenation copy. None:
        one ring per dtype.
      batch_buckets: which classes of equal buckets (full buckets of
        fused leaves, leaves of one shape reduced alone) run as one batch,
        each hop one message for all of them, as in `compressed_all_reduce`
        (default ``"auto"``: buckets of at most 4 MiB; `qc.runs_batched`).

    Returns:
      The sum over devices, same structure, shapes and dtypes as ``x``,
      invariant along ``axis_name``, like `lax.psum`'s (it can leave
      ``shard_map`` with ``out_specs=P()``).

    Example:
      >>> import functools, jax, jax.numpy as jnp, qcollect as qc
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("d",))
      >>> f = jax.shard_map(lambda v: qc.ring_all_reduce(v, "d"), mesh=mesh,
      ...                   in_specs=P("d"), out_specs=P())
      >>> x = jax.device_put(jnp.ones(jax.device_count() * 3),
      ...                    jax.NamedSharding(mesh, P("d")))
      >>> jax.jit(f)(x).tolist() == [float(jax.device_count())] * 3
      True
    """
    leaves, treedef = jax.tree.flatten(x)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    out: list[Any] = [None] * len(leaves)
    n = _ring_size(axis_name)
    batch_buckets = check_batch_buckets(batch_buckets)

    def reduce_bucket(chunks: jax.Array, valid: np.ndarray | None, residual: jax.Array | None,
                      *, key: jax.Array | None, layout: Segment) -> AllReduceResult:
        del valid, residual, key, layout
        summed = all_gather_invariant(ring_reduce_scatter(chunks.reshape(-1), axis_name),
                                      axis_name)
        return AllReduceResult(summed.reshape(chunks.shape), None, None)

    # Equal buckets run as one batch, as in `compressed_all_reduce`.
    segments = plan_segments(leaves, n=n, bucket_bytes=bucket_bytes)
    reduced = reduce_buckets(segments, leaves, None, key=None, masks_padding=False,
                             reduce_bucket=reduce_bucket, batch_buckets=batch_buckets)
    for seg, result in zip(segments, reduced, strict=True):
        sums = (seg.unbucketed(result.value) if seg.length else
                [jnp.zeros(leaves[m].shape, leaves[m].dtype) for m in seg.members])
        for m, leaf in zip(seg.members, sums, strict=True):
            out[m] = leaf
    return treedef.unflatten(out)


def ring_bytes_per_device(num_elements: int, itemsize: int, n: int) -> int:
    """Bytes one device sends in `ring_all_reduce` of ``num_elements`` values.

    ``2 (N - 1) ceil(K / N)`` elements (Gibiansky); the padding is included.
    """
    return 2 * (n - 1) * chunk_rows(num_elements, n) * itemsize if n > 1 else 0

