"""Hierarchical compressed all-reduce over an ``(outer, inner)`` pair of mesh axes.

For meshes of N = M L devices, M nodes (``outer``) of L devices each
(``inner``), joined by a network far slower than the links inside a node: the
two-level scheme of ZeRO++'s hierarchical quantized gradients and CGX's
multi-node mode, on the one-axis layout of whole compressor groups:

1. A segment is cut into N chunks of whole compressor groups, chunk
   ``l M + m`` (row ``l``, column ``m`` of an ``(L, M)`` grid). Inside the
   node, an uncompressed reduce-scatter over ``inner``
   (`reduce_scatter_inside_node`) leaves local device ``l`` with its node's
   sum of grid row ``l``: M chunks.
2. Across nodes, the local devices ``l`` of all M nodes run the 1-D
   compressed all-reduce (`reduce_segment`, any algorithm) over ``outer`` on
   those M chunks.
3. Inside the node, ``all_gather`` over ``inner`` (typed invariant) puts the
   L reduced rows together on every device.

Every device sends across the network only its 1/L share, compressed: the
bytes on ``outer`` are those of a 1-D compressed all-reduce of ``K / L``
values over M devices, about ``1 / (L r)`` of a flat all-reduce's (``r`` the
compression ratio), while the inner collectives move ``2 (L - 1) / L`` of
the buffer uncompressed over the fast links.

Error feedback: a node's share is encoded once (pairwise, ring) by the local
device ``l`` that holds it, so the encoding error of the share belongs to
that device: ``contributed`` is ``x`` minus that error, placed at the share's
chunks, and the residuals ``x - contributed`` of all devices add up to
everything the outer compression lost. ``owner_error`` (pairwise) is the
owner's re-encoding error, at the one chunk this device owns, in sum units.

References:
  Wang et al. (ZeRO++), 2023 <https://arxiv.org/abs/2306.10209>, section
    on hierarchical quantized gradients (qgZ); Markov, Ramezani and
    Alistarh, "CGX: Adaptive System Support for Communication-Efficient
    Deep Learning", Middleware 2022.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qcollect import _backend
from qcollect._payload import Compressor
from qcollect.collectives._algorithms import (
    Chunks,
    Codec,
    Exchange,
    ReduceAlgorithm,
    Stacked,
    reduce_segment,
)
from qcollect.collectives._result import AllReduceResult, AxisName
from qcollect.collectives._ring import all_gather_invariant, as_varying, ring_reduce_scatter

__all__ = ["reduce_hierarchical", "reduce_scatter_inside_node"]


def reduce_scatter_inside_node(grid: jax.Array, inner: AxisName) -> jax.Array:
    """Row ``axis_index(inner)`` of ``grid`` summed over ``inner``: the
    ``ppermute`` ring or ``lax.psum_scatter``, as `_backend.ring_inside_nodes`
    chooses for this backend (`_backend.RING_IN_NODES`)."""
    if _backend.ring_inside_nodes():
        return ring_reduce_scatter(grid, inner)[0]
    return lax.psum_scatter(grid, inner, scatter_dimension=0, tiled=False)


def reduce_hierarchical(chunks: Chunks, axes: tuple[AxisName, AxisName], compressor: Compressor,
                        *, valid: jax.Array | np.ndarray | None, key: jax.Array,
                        algorithm: ReduceAlgorithm, residual: Chunks | None,
                        exchange: Exchange = "permute") -> AllReduceResult:
    """One segment's ``n = M L`` chunks -> `AllReduceResult` ``(value,
    contributed, owner_error)``, each stacked ``(n, *chunk_shape)`` as
    `reduce_segment`'s; ``value`` is invariant along both axes."""
    outer, inner = axes
    nodes, local = int(lax.axis_size(outer)), int(lax.axis_size(inner))
    me = lax.axis_index(inner)
    grid = lambda a: a.reshape((local, nodes) + a.shape[1:])  # noqa: E731

    def mine(a: jax.Array) -> jax.Array:
        """This device's row of the ``(L, M, ...)`` grid: its M chunks."""
        return lax.dynamic_index_in_dim(grid(a), me, keepdims=False)

    def placed(row: jax.Array, dtype: jnp.dtype | type) -> jax.Array:
        """``row`` at this device's grid row of zeros, as ``(n, ...)`` chunks."""
        zeros = jnp.zeros((local * nodes,) + row.shape[1:], dtype)
        return lax.dynamic_update_slice_in_dim(zeros, row.astype(dtype), me * nodes, axis=0)

    stacked = as_varying(chunks.stacked(), inner)
    share = reduce_scatter_inside_node(grid(stacked), inner)
    codec = Codec(compressor, None if valid is None else mine(jnp.asarray(valid)))
    owner_residual = None if residual is None else Stacked(mine(residual.stacked()),
                                                           chunks.chunk_map)
    value, contributed, owner_error = reduce_segment(
        Stacked(share, chunks.chunk_map), outer, codec, key=key, algorithm=algorithm,
        owner_residual=owner_residual, exchange=exchange)
    # What this device's share lost to compression, taken off its own grid
    # row only (the other rows are contributed as they are).
    lost = share.astype(jnp.float32) - contributed.astype(jnp.float32)
    row = mine(stacked).astype(jnp.float32) - lost
    contributed = lax.dynamic_update_slice_in_dim(stacked, row.astype(stacked.dtype),
                                                  me * nodes, axis=0)
    if owner_error is not None:
        owner_error = placed(owner_error, jnp.float32)
    return AllReduceResult(all_gather_invariant(value, inner), contributed, owner_error)
