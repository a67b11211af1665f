"""One message per collective: several arrays travel as one buffer of words.

XLA's collectives take several operands (a tuple all-reduce, one
``ppermute`` per leaf of a pytree), but how many messages that makes is the
backend's choice, and across processes on the CPU backend every operand is
an exchange of its own, each costing milliseconds of latency whatever its
size (`_backend.MESSAGE_PER_ARRAY`; measured in
docs/collectives.md#messages-per-exchange). A compressed all-reduce sends
several arrays per hop (one-bit: the sign words and two means per group;
QSGD: words and norms), and a model has dozens of small leaves that are
averaged uncompressed, so the per-message latency, not the link, would
bound a compressed step.

`pack` lays arrays of any shapes and dtypes side by side in one buffer of
unsigned words (a bit-identical view: no value is rounded or converted) and
`unpack` restores them; `send_packed` moves a list of arrays as one such
buffer per collective (qc.permute, qc.exchange_chunks and the payload
gathers use it), and `fused_psum` sums a pytree with one collective per
dtype and bucket, as PyTorch DDP's gradient buckets do. The bytes on the
wire are the same: only the number of messages changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qcollect import _cluster
from qcollect.collectives._blocks import BlockSpecs, over_blocks
from qcollect.collectives._layout import BUCKET_BYTES
from qcollect.collectives._result import AxisName
from qcollect.varying import varying_axes

__all__ = ["Packing", "fused_psum", "pack", "packable", "send_packed", "unpack"]

_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


class Packing(NamedTuple):
    """How `pack` laid arrays out: enough for `unpack` to restore them.

    Attributes:
      shapes: each array's shape past the leading ``lead`` axes.
      dtypes: each array's dtype.
      bounds: word offsets, ``bounds[i]:bounds[i + 1]`` holds array ``i``.
      lead: leading axes shared by every array and kept by the buffer.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    bounds: tuple[int, ...]
    lead: int


def packable(arrays: Sequence[jax.Array]) -> bool:
    """Whether `pack` can view every one of ``arrays`` as words: real or
    integer dtypes (not bool, not complex)."""
    return all(jnp.issubdtype(a.dtype, jnp.number)
               and not jnp.issubdtype(a.dtype, jnp.complexfloating) for a in arrays)


def _word(dtypes: Sequence[Any]) -> type:
    return _WORDS[min(np.dtype(d).itemsize for d in dtypes)]


def pack(arrays: Sequence[Any], lead: int = 0) -> tuple[jax.Array, Packing]:
    """Arrays side by side in one buffer of unsigned words.

    Args:
      arrays: a list of arrays of numeric dtypes (`packable`) whose first
        ``lead`` axes are the same.
      lead: leading axes kept as they are (for example the devices' axis of
        an all-gather); the rest of each array is flattened.

    Returns:
      ``(buffer, packing)``: ``buffer`` has shape ``lead_shape + (words,)``
      and the unsigned dtype as wide as the narrowest of the arrays' dtypes,
      each array viewed bit for bit (``lax.bitcast_convert_type``);
      ``packing`` is what `unpack` needs.

    Example:
      >>> import jax.numpy as jnp
      >>> buf, how = pack([jnp.ones((2, 3)), jnp.arange(4, dtype=jnp.uint32)])
      >>> buf.shape, buf.dtype
      ((10,), dtype('uint32'))
      >>> [a.shape for a in unpack(buf, how)]
      [(2, 3), (4,)]
    """
    arrays = [jnp.asarray(a) for a in arrays]
    if not packable(arrays):
        raise ValueError(f"pack needs real or integer arrays, got dtypes "
                         f"{[str(a.dtype) for a in arrays]}")
    lead_shape = arrays[0].shape[:lead]
    word = _word([a.dtype for a in arrays])
    parts, bounds = [], [0]
    for a in arrays:
        if a.shape[:lead] != lead_shape:
            raise ValueError(f"pack: the arrays' first {lead} axes differ: {lead_shape} "
                             f"and {a.shape[:lead]}")
        words = a if a.dtype == word else lax.bitcast_convert_type(a, word)
        parts.append(words.reshape(lead_shape + (-1,)))
        bounds.append(bounds[-1] + parts[-1].shape[-1])
    packing = Packing(tuple(a.shape[lead:] for a in arrays),
                      tuple(np.dtype(a.dtype) for a in arrays), tuple(bounds), lead)
    return jnp.concatenate(parts, axis=-1), packing


def unpack(buffer: jax.Array, packing: Packing) -> list[jax.Array]:
    """The arrays `pack` laid into ``buffer`` (which may have gained leading
    axes in front of ``packing.lead``'s, as an all-gather adds one)."""
    lead_shape = buffer.shape[:-1]
    out = []
    for i, (shape, dtype) in enumerate(zip(packing.shapes, packing.dtypes, strict=True)):
        words = buffer[..., packing.bounds[i]:packing.bounds[i + 1]]
        ratio = dtype.itemsize // buffer.dtype.itemsize
        words = words.reshape(lead_shape + shape + ((ratio,) if ratio > 1 else ()))
        out.append(words if words.dtype == dtype else lax.bitcast_convert_type(words, dtype))
    return out


def _by_type(leaves: Sequence[jax.Array]) -> list[list[int]]:
    """Indices of ``leaves`` grouped by the manual axes they vary along (a
    buffer varies along every axis any of its arrays does, so packing an
    array with one that varies along more would change its type)."""
    groups: dict[frozenset[str] | None, list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(varying_axes(leaf), []).append(i)
    return list(groups.values())


def send_packed(send: Callable[[jax.Array], jax.Array], leaves: Sequence[jax.Array],
                lead: int = 0) -> list[jax.Array]:
    """``send`` (a function of one array: a collective) applied to ``leaves``
    with one message per type: the `packable` leaves that vary along the same
    manual axes go as one buffer, any other leaf on its own."""
    out: list[Any] = [None] * len(leaves)
    for group in _by_type(leaves):
        arrays = [leaves[i] for i in group]
        if len(arrays) < 2 or not packable(arrays):
            moved = [send(a) for a in arrays]
        else:
            buffer, packing = pack(arrays, lead)
            moved = unpack(send(buffer), packing)
        for i, a in zip(group, moved, strict=True):
            out[i] = a
    return out


def _buckets(sizes: list[int], cap: int | None) -> list[list[int]]:
    """Consecutive runs of indices of at most ``cap`` bytes; an index of
    ``cap`` bytes or more is a run of its own."""
    runs: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if cap is not None and size >= cap:
            runs.append([i])
            continue
        if current and cap is not None and total + size > cap:
            runs.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    if current:
        runs.append(current)
    return runs


def fused_psum(x: Any, axis_name: AxisName, *, mean: bool = False,
               bucket_bytes: int | None = BUCKET_BYTES, block_specs: BlockSpecs = None) -> Any:
    """``lax.psum`` (or ``lax.pmean``) of a pytree with one collective per
    bucket: the leaves of one dtype are concatenated into buckets of at most
    ``bucket_bytes``, as PyTorch DDP buckets gradients.

    The values are ``lax.psum``'s (each element is summed over the same
    devices); the bytes on the wire are the same; the number of exchanges
    drops from one per leaf to one per bucket, which is what a step pays
    when every exchange carries a fixed latency
    (docs/collectives.md#messages-per-exchange).

    Args:
      x: array or pytree of arrays, this device's contribution.
      axis_name: the mapped axis (or tuple of axes) as for ``lax.psum``.
      mean: divide by the number of devices (``lax.pmean``).
      bucket_bytes: the largest bucket (default 4 MiB, `BUCKET_BYTES`); a
        leaf of this size or more is summed alone, not copied. None: one
        bucket per dtype.

    Returns:
      The sum (or mean), like ``x``, invariant along ``axis_name``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("d",))
      >>> f = jax.shard_map(lambda t: fused_psum(t, "d"), mesh=mesh,
      ...                   in_specs=P(), out_specs=P())
      >>> out = f({"w": jnp.ones((2, 2)), "b": jnp.arange(3.0)})
      >>> np.asarray(out["b"]).tolist()
      [0.0, 1.0, 2.0]
    """
    run = functools.partial(_fused_psum, axis_name=axis_name, mean=mean,
                            bucket_bytes=bucket_bytes)
    return over_blocks(run, x, block_specs, out_specs=lambda specs: specs)


def _fused_psum(x: Any, *, axis_name: AxisName, mean: bool, bucket_bytes: int | None) -> Any:
    """`fused_psum` on whole leaves (the first one traced registers the
    exit-time check of a cluster job never joined, `_cluster.watch_unjoined`)."""
    _cluster.watch_unjoined()
    reduce = lax.pmean if mean else lax.psum
    leaves, treedef = jax.tree.flatten(x)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    out: list[Any] = [None] * len(leaves)
    classes: dict[tuple[np.dtype, frozenset[str] | None], list[int]] = {}
    for i, leaf in enumerate(leaves):
        classes.setdefault((np.dtype(leaf.dtype), varying_axes(leaf)), []).append(i)
    for (dtype, _), members in classes.items():
        sizes = [leaves[i].size * dtype.itemsize for i in members]
        for run in _buckets(sizes, bucket_bytes):
            idx = [members[j] for j in run]
            if len(idx) == 1:
                out[idx[0]] = reduce(leaves[idx[0]], axis_name)
                continue
            flat = jnp.concatenate([leaves[i].reshape(-1) for i in idx])
            summed = reduce(flat, axis_name)
            start = 0
            for i in idx:
                out[i] = summed[start:start + leaves[i].size].reshape(leaves[i].shape)
                start += leaves[i].size
    return jax.tree.unflatten(treedef, out)
