"""Compressed reduce-scatter and all-gather for sharded training (FSDP / ZeRO-3).

With parameters sharded over the data axis, every device holds one shard of
each leaf: the forward and backward passes gather the weights
(`compressed_all_gather`) and the gradients are reduce-scattered back to
their shards (`compressed_reduce_scatter`). Both follow the tiled layout of
``lax.psum_scatter(tiled=True)`` and ``lax.all_gather(tiled=True)``: a
leaf's ``dimension`` is cut into N equal blocks, block ``k`` belonging to
device ``k`` of the axis (the layout of ``P(axis_name)`` on that dimension).

Reduce-scatter (the first half of the pairwise all-reduce, Dryden et al.
section 3.4; ZeRO++'s qgZ): every device encodes each of its N blocks of a
leaf on its own (a block is the compressor's array: buckets, columns and
scales never span two devices' shards), sends block ``k`` to device ``k``
(N - 1 ``ppermute`` shifts or one ``all_to_all``, the ``exchange`` of
`qcollect.compressed_all_reduce`), and the owner decodes and adds the N
payloads. Nothing is re-encoded: each value is quantized once, by its
origin, so ``x - contributed`` is all the error there is (error feedback).

All-gather (ZeRO++'s qwZ for weights): every device encodes its shard once,
one all-gather moves the payloads, and every device decodes all N -- its own
too, so the gathered weights are the same everywhere (typed invariant).
ZeRO++ quantizes the weights block-wise to int8 with round-to-nearest:
``qc.qsgd(bits=8, bucket_size=B, stochastic=False)`` is that quantizer
(symmetric levels ``-127..127`` times each block's max-norm / 127).

Several leaves travel together: one message per shift (or one all-to-all,
one all-gather) carries every leaf's payloads packed into words
(`send_packed`, `_backend.MESSAGE_PER_ARRAY`).

Two axes ``(outer, inner)`` (nodes and the devices inside one, as for the
all-reduce) reduce-scatter hierarchically, as qgZ's two hops: an
uncompressed ``psum_scatter`` inside the node leaves local device ``l`` the
node's sum of the M blocks ``m L + l`` (M nodes of L devices), and the
compressed reduce-scatter over ``outer`` on those M blocks gives device
``(m, l)`` block ``m L + l``, its block of ``P((outer, inner))``. Only the
compressed payloads cross the network. The all-gather over two axes
gathers the compressed shards over both at once (a weight is encoded once,
by its owner).

References:
  Wang et al. (ZeRO++), 2023 <https://arxiv.org/abs/2306.10209>, qwZ and
    qgZ; Dryden et al., MLHPC 2016, section 3.4
    <https://doi.org/10.1109/MLHPC.2016.004>; Markov et al. (QSDP), ICML
    2023 <https://arxiv.org/abs/2302.02390>.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qcollect._config import per_leaf
from qcollect._payload import Compressor
from qcollect.checks import check_choice, check_floating_leaves
from qcollect.collectives._algorithms import (
    EXCHANGES,
    Exchange,
    gather_payloads,
    received_payloads,
)
from qcollect.collectives._compressed import hierarchy_axes
from qcollect.collectives._hierarchical import reduce_scatter_inside_node
from qcollect.collectives._result import AllReduceResult, AxisName
from qcollect.collectives._ring import as_varying

__all__ = ["compressed_all_gather", "compressed_reduce_scatter"]


def _dimensions(leaves: Sequence[jax.Array], treedef: Any, dimension: Any,
                name: str) -> list[int]:
    """Each leaf's dimension, normalised to ``0 <= d < ndim``: ``dimension``
    is one int for every leaf or a pytree of ints shaped like ``x``."""
    dims = per_leaf(treedef, dimension,
                    lambda v: isinstance(v, int) and not isinstance(v, bool), name, "an int")
    out = []
    for leaf, d in zip(leaves, dims, strict=True):
        if isinstance(d, bool) or not isinstance(d, int):
            raise ValueError(f"{name} must hold ints, got {d!r}")
        if leaf.ndim == 0 or not -leaf.ndim <= d < leaf.ndim:
            raise ValueError(f"{name}={d} is not a dimension of a leaf of shape "
                             f"{tuple(leaf.shape)}")
        out.append(d % leaf.ndim)
    return out


def _prepared(tree: Any, axis_name: AxisName, compressor: Compressor, key: jax.Array | None,
              exchange: object, dimension: Any,
              name: str) -> tuple[jax.Array, int, list[jax.Array], Any, list[int]]:
    """The arguments checked: ``(this device's key, N, leaves, treedef, each
    leaf's dimension)``."""
    if not isinstance(compressor, Compressor):
        raise ValueError(f"compressor must be a qcollect Compressor, got {compressor!r}")
    if compressor.stochastic and key is None:
        raise ValueError(f"{compressor.name} is stochastic: pass key")
    check_choice("exchange", exchange, EXCHANGES)
    check_floating_leaves(tree, "shard" if name == "gather_dimension" else "x")
    key = jax.random.fold_in(jax.random.key(0) if key is None else key,
                             lax.axis_index(axis_name))
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    dims = _dimensions(leaves, treedef, dimension, name)
    return key, int(lax.axis_size(axis_name)), leaves, treedef, dims


def _blocks(leaf: jax.Array, d: int, n: int) -> jax.Array:
    """``leaf`` cut along ``d`` into ``n`` blocks, stacked ``(n, *block_shape)``."""
    if leaf.shape[d] % n:
        raise ValueError(f"dimension {d} of a leaf of shape {tuple(leaf.shape)} has "
                         f"{leaf.shape[d]} entries, not a multiple of the {n} devices "
                         f"(scatter_dimension)")
    moved = jnp.moveaxis(leaf, d, 0)
    return jnp.moveaxis(moved.reshape((n, moved.shape[0] // n) + moved.shape[1:]), 1, d + 1)


def _joined(blocks: jax.Array, d: int) -> jax.Array:
    """The inverse of `_blocks`: ``(n, *block_shape)`` -> one array, the blocks
    side by side along ``d``."""
    n = blocks.shape[0]
    moved = jnp.moveaxis(blocks, d + 1, 1)
    return jnp.moveaxis(moved.reshape((n * moved.shape[1],) + moved.shape[2:]), 0, d)


def _keys(key: jax.Array, n: int, leaf_index: int) -> jax.Array:
    leaf_key = jax.random.fold_in(key, leaf_index)
    return jax.vmap(lambda j: jax.random.fold_in(leaf_key, j))(jnp.arange(n))


def _scatter_blocks(stacks: Sequence[jax.Array], axis_name: AxisName, compressor: Compressor,
                    key: jax.Array, exchange: Exchange) -> tuple[list[jax.Array], list[jax.Array]]:
    """Every leaf's ``n`` stacked blocks (``n`` the size of ``axis_name``)
    reduce-scattered: ``(sums of block me, decoded blocks)`` per leaf, the
    sums in float32. One exchange carries all leaves' payloads."""
    if not stacks:
        return [], []
    n = int(lax.axis_size(axis_name))
    me = lax.axis_index(axis_name)
    coded = [jax.vmap(compressor.round_trip)(s, _keys(key, n, i)) for i, s in enumerate(stacks)]
    payloads = [p for p, _ in coded]
    received = received_payloads(payloads, axis_name, n, me, exchange)
    # One payload at a time, one fused pass (_backend.DECODES_ADDED_ONE_BY_ONE).
    sums = [functools.reduce(operator.add, [compressor.decode(r[i]).astype(jnp.float32)
                                            for r in received])
            for i in range(len(stacks))]
    return sums, [decoded for _, decoded in coded]


def compressed_reduce_scatter(x: Any, axis_name: AxisName, compressor: Compressor,
                              key: jax.Array | None = None, *, scatter_dimension: Any = 0,
                              mean: bool = False,
                              exchange: Exchange = "permute") -> AllReduceResult:
    """Reduce-scatter of an array or pytree with every block compressed once.

    Each leaf's ``scatter_dimension`` is cut into N equal blocks (N devices
    of ``axis_name``); device ``k`` gets the sum over devices of block ``k``,
    as ``lax.psum_scatter(leaf, axis_name, scatter_dimension=d, tiled=True)``
    would give (bit for bit with ``qc.identity()`` where the sum is exact).
    Every block is encoded once by its origin, on its own (buckets,
    columns and scales never span two devices' shards), and decoded and
    added by its owner
    (docs/collectives.md#sharded-training-reduce-scatter-and-all-gather).

    Args:
      x: array or pytree of arrays, this device's full-size contribution
        (a gradient). Leaves of integer dtype are not compressible.
      axis_name: the mapped axis, or ``(outer, inner)``: uncompressed inside
        a node, compressed across nodes; the shards are those of
        ``P((outer, inner))``.
      compressor: any qcollect `Compressor`.
      key: PRNG key for stochastic compressors (the same on every device;
        it is folded with the device, the leaf and the block).
      scatter_dimension: the dimension each leaf is sharded on: one int for
        all leaves or a pytree of ints shaped like ``x``. Its length must be
        a multiple of N.
      mean: divide the sum by N.
      exchange: ``"permute"`` (N - 1 ``ppermute`` shifts, default) or
        ``"all_to_all"`` (one `lax.all_to_all`), as for
        `qcollect.compressed_all_reduce`.

    Returns:
      `AllReduceResult` ``(value, contributed, None)``: ``value`` this
      device's shard of the sum, each leaf's ``scatter_dimension`` N times
      shorter (varying along ``axis_name``); ``contributed`` like ``x``, what
      this device's encodings decode to (keep ``x - contributed`` for error
      feedback; over two axes, ``x`` minus what this device's encoding of
      the node's sum lost, as in the hierarchical all-reduce).

    Raises:
      ValueError: a ``scatter_dimension`` that a leaf does not have or whose
        length is not a multiple of N, a stochastic compressor without a key,
        an unknown ``exchange``.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("d",))
      >>> rs = jax.jit(jax.shard_map(
      ...     lambda g: qc.compressed_reduce_scatter(g[0], "d", qc.qsgd(bits=8),
      ...                                            jax.random.key(0)).value,
      ...     mesh=mesh, in_specs=P("d"), out_specs=P("d")))
      >>> g = jnp.stack([jnp.arange(4.0), jnp.ones(4)])  # device 0, device 1
      >>> rs(jax.device_put(g, NamedSharding(mesh, P("d")))).round(1).tolist()
      [1.0, 2.0, 3.0, 4.0]

    References:
      Wang et al. (ZeRO++), 2023 <https://arxiv.org/abs/2306.10209>, qgZ;
      Dryden et al., MLHPC 2016, section 3.4.
    """
    axes = hierarchy_axes(axis_name)
    key, n, leaves, treedef, dims = _prepared(x, axis_name, compressor, key, exchange,
                                              scatter_dimension, "scatter_dimension")
    stacks = [_blocks(leaf, d, n) for leaf, d in zip(leaves, dims, strict=True)]
    live = [i for i, s in enumerate(stacks) if s.size]
    if axes is None:
        sums, decoded = _scatter_blocks([stacks[i] for i in live], axis_name, compressor,
                                        key, exchange)
    else:
        sums, decoded = _scatter_hierarchical([stacks[i] for i in live], axes, compressor,
                                              key, exchange)
    values = [jnp.zeros(s.shape[1:], s.dtype) for s in stacks]
    contributed = list(leaves)
    for i, total, dec in zip(live, sums, decoded, strict=True):
        values[i] = (total / n if mean else total).astype(leaves[i].dtype)
        contributed[i] = _joined(dec.astype(leaves[i].dtype), dims[i])
    return AllReduceResult(treedef.unflatten(values), treedef.unflatten(contributed), None)


def _scatter_hierarchical(stacks: Sequence[jax.Array], axes: tuple[AxisName, AxisName],
                          compressor: Compressor, key: jax.Array,
                          exchange: Exchange) -> tuple[list[jax.Array], list[jax.Array]]:
    """`_scatter_blocks` over ``(outer, inner)``: block ``m L + l`` (node
    ``m``, local device ``l``) summed uncompressed inside the node by local
    device ``l``, then reduce-scattered compressed over ``outer``. The
    decoded blocks are ``x`` less what this device's encoding of its node
    sums lost, at the blocks it encoded."""
    outer, inner = axes
    nodes, local = int(lax.axis_size(outer)), int(lax.axis_size(inner))
    me = lax.axis_index(inner)

    def grid(s: jax.Array) -> jax.Array:  # (n, ...) -> (L, M, ...): row l holds blocks m L + l
        return jnp.swapaxes(s.reshape((nodes, local) + s.shape[1:]), 0, 1)

    varying = [as_varying(s, inner) for s in stacks]
    shares = [reduce_scatter_inside_node(grid(s), inner) for s in varying]
    sums, decoded = _scatter_blocks(shares, outer, compressor, key, exchange)
    contributed = []
    for s, share, dec in zip(varying, shares, decoded, strict=True):
        lost = share.astype(jnp.float32) - dec.astype(jnp.float32)
        rows = grid(s.astype(jnp.float32))
        rows = lax.dynamic_update_index_in_dim(
            rows, lax.dynamic_index_in_dim(rows, me, keepdims=False) - lost, me, 0)
        contributed.append(jnp.swapaxes(rows, 0, 1).reshape(s.shape))
    return sums, contributed


def compressed_all_gather(shard: Any, axis_name: AxisName, compressor: Compressor,
                          key: jax.Array | None = None, *,
                          gather_dimension: Any = 0) -> AllReduceResult:
    """All-gather of an array or pytree, each shard encoded once by its owner.

    Device ``k``'s shard of each leaf lands at block ``k`` of the leaf's
    ``gather_dimension``, as ``lax.all_gather(shard, axis_name,
    axis=d, tiled=True)`` would place it (bit for bit with
    ``qc.identity()``). Every device decodes all N payloads, its own too,
    so the result is the same on every device and typed invariant.

    Args:
      shard: array or pytree of arrays, this device's shards (weights).
      axis_name: the mapped axis, or a tuple of axes gathered as one (the
        shards of ``P((outer, inner))``).
      compressor: any qcollect `Compressor`; for weights, a deterministic
        one such as ``qc.qsgd(bits=8, bucket_size=2048, stochastic=False)``
        (ZeRO++'s qwZ) or ``qc.cast(jnp.bfloat16)``.
      key: PRNG key for stochastic compressors.
      gather_dimension: one int for all leaves or a pytree of ints.

    Returns:
      `AllReduceResult` ``(value, contributed, None)``: ``value`` the
      gathered leaves (``gather_dimension`` N times longer, invariant along
      ``axis_name``); ``contributed`` like ``shard``, what this device's
      encoding decodes to.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("d",))
      >>> ag = jax.jit(jax.shard_map(
      ...     lambda w: qc.compressed_all_gather(w, "d", qc.cast(jnp.bfloat16)).value,
      ...     mesh=mesh, in_specs=P("d"), out_specs=P()))
      >>> ag(jax.device_put(jnp.array([1.0, 2.0, 3.0, 1/3]),
      ...                   NamedSharding(mesh, P("d")))).tolist()
      [1.0, 2.0, 3.0, 0.333984375]

    References:
      Wang et al. (ZeRO++), 2023 <https://arxiv.org/abs/2306.10209>, qwZ.
    """
    key, n, leaves, treedef, dims = _prepared(shard, axis_name, compressor, key, "permute",
                                              gather_dimension, "gather_dimension")
    live = [i for i, leaf in enumerate(leaves) if leaf.size]
    coded = [compressor.round_trip(leaves[i], jax.random.fold_in(key, i)) for i in live]
    gathered = gather_payloads(axis_name, [p for p, _ in coded]) if live else []
    values = [jnp.zeros(leaf.shape[:d] + (n * leaf.shape[d],) + leaf.shape[d + 1:],
                        leaf.dtype) for leaf, d in zip(leaves, dims, strict=True)]
    contributed = list(leaves)
    for i, payloads, (_, own) in zip(live, gathered, coded, strict=True):
        blocks = jax.vmap(compressor.decode)(payloads).astype(leaves[i].dtype)
        values[i] = _joined(blocks, dims[i])
        contributed[i] = own.astype(leaves[i].dtype)
    return AllReduceResult(treedef.unflatten(values), treedef.unflatten(contributed), None)
