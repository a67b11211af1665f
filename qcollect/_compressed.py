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

Multi-node meshes: ``axis_name=(outer, inner)`` reduces hierarchically
(`qcollect._hierarchical`): uncompressed inside a node (``inner``), one of
the three algorithms above across nodes (``outer``) on each device's share.

Randomness: every device uses ``fold_in(key, axis_index)``, then one more
``fold_in`` per chunk, hop or buffer, so no two encodings share a stream.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from qcollect._algorithms import Chunks, reduce_pieces
from qcollect._buckets import UNROLL_BUCKETS, check_unroll, reduce_buckets
from qcollect._config import check_choice, check_int
from qcollect._hierarchical import reduce_hierarchical
from qcollect._layout import BUCKET_BYTES, plan_segments
from qcollect._payload import Compressor

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


def _hierarchy(axis_name):
    """``(outer, inner)`` for a hierarchical all-reduce, None for one axis."""
    if not isinstance(axis_name, (tuple, list)):
        return None
    names = tuple(axis_name)
    if len(names) == 1:
        return None
    if len(names) != 2 or len(set(names)) != 2:
        raise ValueError(f"axis_name must be one mesh axis or a pair (outer, inner) of two "
                         f"different axes, got {axis_name!r}")
    return names


def compressed_all_reduce(x, axis_name, compressor: Compressor, key=None, *,
                          algorithm: str = "auto", mean: bool = False, fuse: bool = True,
                          bucket_bytes: int | None = BUCKET_BYTES, pipeline: int = 1,
                          owner_residual=None,
                          unroll_buckets: int | str | None = UNROLL_BUCKETS) -> AllReduceResult:
    """All-reduce of an array or pytree with every hop compressed.

    Args:
      x: array or pytree of arrays, this device's contribution.
      axis_name: the mapped axis (inside `jax.shard_map` or `jax.pmap`), or
        a pair ``(outer, inner)`` of mesh axes for a hierarchical
        all-reduce over both: an uncompressed ``psum_scatter`` over
        ``inner`` (the devices of one node, fast links), ``algorithm`` over
        ``outer`` (across nodes) on each device's 1/L share, and an
        ``all_gather`` over ``inner`` (module `qcollect._hierarchical`).
        Groups and error feedback are as with one axis; the result is
        invariant along both axes.
      compressor: any qcollect `Compressor`.
      key: PRNG key (needed by stochastic compressors); folded with the
        device index, so pass the same key on every device.
      algorithm: ``"ring"`` (linear compressors), ``"pairwise"``,
        ``"ring_requantize"``, or ``"auto"``: ring for linear compressors,
        else pairwise. See the module docstring.
      mean: divide the sum by the number of devices (of both axes).
      fuse: place leaves of one dtype side by side in one segment (default),
        so small leaves ride together: whole buckets row after row, or for
        ``grouping="column"`` compressors the columns of leaves with the
        same number of rows; ``"leaf"``-grouped compressors (entropy, QSGD
        with one scale per array) never fuse. Fusion never changes a leaf's
        statistics, only how many collectives run. With False every leaf is
        reduced on its own.
      bucket_bytes: bucket size (default 4 MiB, like the buckets of PyTorch
        DDP): the fused leaves of one dtype are reduced in buckets of whole
        groups of at most this size, and a leaf of ``bucket_bytes`` or more
        is reduced on its own, so large leaves are not copied into a
        concatenation. None: no cap.
      pipeline: pieces per chunk (row segments; column segments are never
        cut): each device's chunk of a segment is cut into ``pipeline`` runs
        of whole groups, and each run is reduced by its own chain of
        collectives, so that XLA may encode or decode one run while another
        is on the wire. Values are those of ``pipeline=1`` up to rounding
        order and the random streams of stochastic compressors; groups are
        never cut, so the wire bytes grow at most by each run's last,
        partly filled packed word. Default 1: on the CPU backend no count
        helped (`docs/collectives.md`, "Pipelining"). Single axis only.
      owner_residual: ``"pairwise"`` only: the previous step's ``owner_error``
        (same structure as ``x``), added to the owner's reduced chunk before
        re-encoding.
      unroll_buckets: equal buckets (the full buckets of fused leaves, or
        leaves of one shape reduced on their own) form a class, which runs
        either as one batch (`jax.vmap` over its buckets: each hop one
        message for all of them, one copy of the algorithm in the program)
        or traced once per bucket (`qc.runs_batched`). Default ``"auto"``
        (`qc.UNROLL_BUCKETS`): batch classes of buckets of at most 4 MiB,
        trace classes of larger buckets (large leaves reduced alone) unless
        more than 16 share a shape. The batch copies its buckets into a
        stack; measured across processes it pays for 4 MiB buckets and not
        for 8 MiB and up, and in one process it is slower
        (`docs/benchmarks.md`, "Batch or trace"). An int ``K`` batches
        classes of more than ``K`` buckets (0: all), None never batches (the
        program then grows with the model). Values, wire bytes and random
        streams are the same either way, except that a constant payload
        array (PCA's weight) is sent once per batch, not once per bucket.

    Returns:
      `AllReduceResult` ``(value, contributed, owner_error)``, each like ``x``
      (owner_error None unless pairwise). ``value`` is the same on every
      device and typed invariant along ``axis_name`` (it can leave
      ``shard_map`` with ``out_specs=P()``); ``contributed`` and
      ``owner_error`` are this device's own, typed varying.

    Raises:
      ValueError: unknown algorithm, ``"ring"`` with a non-linear compressor,
        ``owner_residual`` with another algorithm, an ``axis_name`` tuple
        that is not two different axes, or ``pipeline > 1`` with two.

    References:
      Yu et al., GradiVeQ, Algorithm 1; Dryden et al. section 3.4;
      Gibiansky (ring all-reduce); hierarchical: ZeRO++ (Wang et al. 2023,
      hierarchical quantized gradients), CGX (Markov et al. 2022).
    """
    check_choice("algorithm", algorithm, ("auto",) + ALGORITHMS)
    pipeline = check_int("pipeline", pipeline, low=1)
    unroll_buckets = check_unroll(unroll_buckets)
    if algorithm == "auto":
        algorithm = "ring" if compressor.linear else "pairwise"
    if algorithm == "ring" and not compressor.linear:
        raise ValueError(f"algorithm='ring' sums payloads in the compressed domain and needs "
                         f"a linear compressor; {compressor.name} is not (use 'pairwise')")
    if owner_residual is not None and algorithm != "pairwise":
        raise ValueError("owner_residual is only used by algorithm='pairwise'")
    if compressor.stochastic and key is None:
        raise ValueError(f"{compressor.name} is stochastic: pass key")
    axes = _hierarchy(axis_name)
    if axes is not None and pipeline > 1:
        raise ValueError("pipeline > 1 needs a single axis_name; a hierarchical (outer, "
                         "inner) all-reduce runs one piece per chunk")
    if key is None:
        key = jax.random.key(0)
    key = jax.random.fold_in(key, lax.axis_index(axis_name))
    n = int(lax.axis_size(axis_name))

    leaves, treedef = jax.tree.flatten(x)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    owners = (treedef.flatten_up_to(owner_residual) if owner_residual is not None
              else None)
    segments = plan_segments(leaves, compressor.grouping, compressor.block, n,
                             fuse=fuse, bucket_bytes=bucket_bytes)

    def reduce_bucket(data, valid, residual, bucket_key, layout):
        chunks = Chunks(data, layout)
        residual = None if residual is None else Chunks(residual, layout)
        if axes is None:
            return reduce_pieces(chunks, axis_name, compressor, valid, bucket_key, algorithm,
                                 residual, pipeline)
        return reduce_hierarchical(chunks, axes, compressor, valid, bucket_key, algorithm,
                                   residual)

    out = {"value": [None] * len(leaves), "contributed": [None] * len(leaves),
           "owner": [None] * len(leaves)}
    reduced = reduce_buckets(segments, leaves, owners, key, compressor.masks_padding,
                             reduce_bucket, unroll_buckets)
    for seg, parts in zip(segments, reduced, strict=True):
        for name, stacked in zip(("value", "contributed", "owner"), parts, strict=True):
            if seg.length == 0:  # empty leaves
                for m in seg.members:
                    dtype = jnp.float32 if name == "owner" else leaves[m].dtype
                    out[name][m] = jnp.zeros(leaves[m].shape, dtype)
            elif stacked is not None:
                for m, leaf in zip(seg.members, seg.unbucketed(stacked), strict=True):
                    out[name][m] = leaf
    value, contributed = (treedef.unflatten(out[k]) for k in ("value", "contributed"))
    owner = treedef.unflatten(out["owner"]) if algorithm == "pairwise" else None
    if mean:
        value = jax.tree.map(lambda v: (v / n).astype(v.dtype), value)
    return AllReduceResult(value, contributed, owner)
