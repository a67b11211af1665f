"""Compressed all-reduce: three algorithms from the seed papers.

All three lay the leaves out into segments of whole compressor groups and cut
each segment into N chunks of whole groups, one per device of ``axis_name``
(`plan_segments`: no bucket, column or entropy range ever spans two leaves
or two devices, so every leaf is coded as the paper codes one layer;
docs/collectives.md#per-layer-groups-through-the-collective), and differ in
where encoding and decoding happen:

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
  straight to its owner, in one ``all_to_all`` or over N - 1 `ppermute`
  shifts (shift t moves chunk ``r + t`` from device r to device ``r + t``;
  the ``exchange`` argument below); the owner decodes
  and sums the N payloads, re-encodes its reduced chunk once, and a ring
  all-gather moves that compressed result. The owner's re-encoding error is
  returned for a second level of error feedback.

``"ring_requantize"`` -- the classic ring where every hop decodes what it
  received, adds its own chunk and re-encodes (as in CGX). Quantization error
  is added at every one of the N - 1 hops, so the error of the sum grows with
  N; ``contributed`` can only report the first hop's encoding, the later
  re-encoding errors belonging to no single device.

Multi-node meshes: ``axis_name=(outer, inner)`` reduces hierarchically
(`reduce_hierarchical`; docs/collectives.md#multi-node-meshes-the-hierarchical-all-reduce):
uncompressed inside a node (``inner``), one of the three algorithms above
across nodes (``outer``) on each device's share.

Randomness: every device uses ``fold_in(key, axis_index)``, then one more
``fold_in`` per chunk, hop or buffer, so no two encodings share a stream.

Exchange (the ``exchange`` argument): the pairwise exchange's N - 1 transfers
of every chunk to its owner run as N - 1 ``ppermute`` shifts one after the
other (``"permute"``, the default) or as one `lax.all_to_all`, every device
sending to every other at once (``"all_to_all"``, as ZeRO++'s qgZ moves its
quantized reduce-scatter); with ``"all_to_all"`` the compressed-domain ring
likewise sends every payload straight to its owner, which adds the N
payloads, in place of N - 1 hops. The bytes are the same, and pairwise
gives the same values bit for bit. Which is faster depends on the backend
and the link; the shifts are the default because on the CPU backend they
were never slower but for small messages over a slow link
(docs/collectives.md#one-all-to-all-or-n---1-shifts).

Segments, buckets and batches (the ``fuse``, ``bucket_bytes``, ``pipeline``
and ``batch_buckets`` arguments):

* ``fuse`` places leaves of one dtype side by side in one segment, so small
  leaves ride together: whole buckets row after row, or for
  ``grouping="column"`` compressors the columns of leaves with the same
  number of rows; ``"leaf"``-grouped compressors (entropy, QSGD with one
  scale per array) never fuse. Fusion never changes a leaf's statistics,
  only how many collectives run.
* ``bucket_bytes`` (default 4 MiB, like the buckets of PyTorch DDP): the
  fused leaves of one dtype are reduced in buckets of whole groups of at
  most this size, and a leaf of ``bucket_bytes`` or more is reduced on its
  own, so large leaves are not copied into a concatenation.
* ``pipeline`` cuts each device's chunk of a row segment into runs of whole
  groups (column segments are never cut), each reduced by its own chain of
  collectives, so that XLA may encode or decode one run while another is
  on the wire. Values are those of ``pipeline=1`` up to rounding order and
  the random streams of stochastic compressors; the wire bytes grow at most
  by each run's last, partly filled packed word. The default is 1: no
  count helped where it was measured (docs/collectives.md#pipelining).
* ``batch_buckets``: equal buckets (the full buckets of fused leaves, or
  leaves of one shape reduced on their own) form a class, which runs either
  as one batch (`jax.vmap` over its buckets: each hop one message for all
  of them, one copy of the algorithm in the program) or traced once per
  bucket (`qc.runs_batched`). By default classes of buckets of at most
  4 MiB run batched, classes of larger buckets (large leaves reduced alone)
  traced unless more than 16 share a shape: the batch copies its buckets
  into a stack, which pays for itself only where each hop's fixed cost is
  high and the buckets small (docs/collectives.md#batch-or-trace). Values,
  wire bytes and random streams are the same either way, except that a
  constant payload array (PCA's weight) is sent once per batch, not once
  per bucket.

References:
  Yu et al. (GradiVeQ), NeurIPS 2018 <https://arxiv.org/abs/1811.03617>,
    Algorithm 1 and eq. 1, 4-5; Dryden et al., MLHPC 2016, section 3.4
    <https://doi.org/10.1109/MLHPC.2016.004>; Markov, Ramezani and
    Alistarh, "CGX: Adaptive System Support for Communication-Efficient
    Deep Learning", Middleware 2022; Wang et al. (ZeRO++), 2023
    <https://arxiv.org/abs/2306.10209>, qgZ.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from qcollect._payload import Compressor
from qcollect.checks import check_choice, check_floating_leaves, check_int
from qcollect.collectives._algorithms import (
    EXCHANGES,
    Chunks,
    Exchange,
    ReduceAlgorithm,
    reduce_pieces,
)
from qcollect.collectives._blocks import BlockSpecs, over_blocks
from qcollect.collectives._buckets import (
    BATCH_BUCKETS,
    BatchBuckets,
    check_batch_buckets,
    reduce_buckets,
)
from qcollect.collectives._hierarchical import reduce_hierarchical
from qcollect.collectives._layout import BUCKET_BYTES, plan_segments
from qcollect.collectives._result import AllReduceResult, AxisName
from qcollect.collectives._segments import Segment

__all__ = ["ALGORITHMS", "Algorithm", "AllReduceResult", "compressed_all_reduce",
           "hierarchy_axes"]

ALGORITHMS: tuple[ReduceAlgorithm, ...] = ("ring", "pairwise", "ring_requantize")
#: ``algorithm`` of the compressed all-reduce: one of `ALGORITHMS` or ``"auto"``.
Algorithm = Literal["auto", "ring", "pairwise", "ring_requantize"]


def hierarchy_axes(axis_name: AxisName) -> tuple[AxisName, AxisName] | None:
    """``(outer, inner)`` for a hierarchical collective, None for one axis.

    Raises ValueError for a tuple that is not two different axes."""
    if not isinstance(axis_name, (tuple, list)):
        return None
    names = tuple(axis_name)
    if len(names) == 1:
        return None
    if len(names) != 2 or len(set(names)) != 2:
        raise ValueError(f"axis_name must be one mesh axis or a pair (outer, inner) of two "
                         f"different axes, got {axis_name!r}")
    return names[0], names[1]


class _Settings(NamedTuple):
    """The checked settings of one `compressed_all_reduce` (``"auto"``
    resolved; ``axes`` the `hierarchy_axes` of its ``axis_name``)."""

    compressor: Compressor
    algorithm: ReduceAlgorithm
    mean: bool
    fuse: bool
    bucket_bytes: int | None
    pipeline: int
    batch_buckets: BatchBuckets
    exchange: Exchange
    axes: tuple[AxisName, AxisName] | None

    def result_specs(self, specs: Any) -> AllReduceResult:
        """The specs of the result, given those of ``x``: an owner error
        only for pairwise."""
        return AllReduceResult(specs, specs, specs if self.algorithm == "pairwise" else None)


def compressed_all_reduce(x: Any, axis_name: AxisName, compressor: Compressor,
                          key: jax.Array | None = None, *, algorithm: Algorithm = "auto",
                          mean: bool = False, fuse: bool = True,
                          bucket_bytes: int | None = BUCKET_BYTES, pipeline: int = 1,
                          owner_residual: Any = None,
                          batch_buckets: BatchBuckets = BATCH_BUCKETS,
                          exchange: Exchange = "permute",
                          block_specs: BlockSpecs = None) -> AllReduceResult:
    """All-reduce of an array or pytree with every hop compressed.

    Args:
      x: array or pytree of arrays, this device's contribution.
      axis_name: the mapped axis (inside `jax.shard_map` or `jax.pmap`), or
        a pair ``(outer, inner)`` of mesh axes for a hierarchical
        all-reduce over both: an uncompressed ``psum_scatter`` over
        ``inner`` (the devices of one node, fast links), ``algorithm`` over
        ``outer`` (across nodes) on each device's 1/L share, and an
        ``all_gather`` over ``inner``
        (docs/collectives.md#multi-node-meshes-the-hierarchical-all-reduce).
        Groups and error feedback are as with one axis; the result is
        invariant along both axes.
      compressor: any qcollect `Compressor`.
      key: PRNG key (needed by stochastic compressors); folded with the
        device index, so pass the same key on every device.
      algorithm: ``"ring"`` (linear compressors), ``"pairwise"``,
        ``"ring_requantize"`` or ``"auto"`` (ring where linear, else pairwise;
        docs/collectives.md#compressed_all_reduce-and-its-three-algorithms).
      mean: divide the sum by the number of devices (of both axes).
      fuse: leaves of one dtype side by side in one segment (default), or alone.
      bucket_bytes: the largest bucket of fused leaves (default 4 MiB); a
        leaf of that size or more is reduced on its own. None: no cap.
      pipeline: pieces per chunk of a row segment, each reduced by its own
        chain of collectives (default 1). Single axis only.
      owner_residual: ``"pairwise"`` only: the previous step's ``owner_error``
        (same structure as ``x``), added to the owner's reduced chunk before
        re-encoding.
      batch_buckets: which classes of equal buckets run as one batch
        (`qc.runs_batched`): ``"auto"`` (default: by bucket size),
        ``"always"``, ``"never"`` or an int ``K`` (more than ``K`` buckets).
      exchange: how ``"pairwise"`` and ``"ring"`` move each chunk's payloads
        to its owner: ``"permute"`` (default: N - 1 ``ppermute`` shifts or
        hops) or ``"all_to_all"`` (one `lax.all_to_all`; the ring's sums then
        happen at the owner, rounding in another order). The same wire bytes.
      block_specs: on a mesh with model axes, inside ``jax.shard_map(...,
        axis_names={axis_name})``: how those axes shard each leaf (a
        ``PartitionSpec`` for all, or a pytree of them like ``x``; default:
        read from the leaves' types where the axes are explicit). Each
        device then reduces its own block, as a leaf of its own, and the
        result is sharded as ``x`` is
        (docs/collectives.md#meshes-with-model-axes).

    Returns:
      `AllReduceResult` ``(value, contributed, owner_error)``, each like ``x``
      (owner_error None unless pairwise). ``value`` is the same on every
      device and typed invariant along ``axis_name`` (it can leave
      ``shard_map`` with ``out_specs=P()``); ``contributed`` and
      ``owner_error`` are this device's own, typed varying.

    Raises:
      ValueError: a leaf of ``x`` not floating point (named), unknown
        algorithm or exchange, ``"ring"`` with a non-linear compressor,
        ``owner_residual`` with another algorithm, an ``axis_name`` tuple
        that is not two different axes, or ``pipeline > 1`` with two.

    References:
      Yu et al. (GradiVeQ), NeurIPS 2018 <https://arxiv.org/abs/1811.03617>,
        Algorithm 1; Dryden et al., MLHPC 2016, section 3.4
        <https://doi.org/10.1109/MLHPC.2016.004>; Gibiansky, ring all-reduce
        <http://research.baidu.com/bringing-hpc-techniques-deep-learning/>;
      hierarchical: Wang et al. (ZeRO++), 2023 <https://arxiv.org/abs/2306.10209>;
        Markov, Ramezani and Alistarh (CGX), Middleware 2022.
    """
    check_floating_leaves(x, "x")
    settings = _checked_settings(
        compressor, key, axis_name, algorithm=algorithm, mean=mean, fuse=fuse,
        bucket_bytes=bucket_bytes, pipeline=pipeline, owner_residual=owner_residual,
        batch_buckets=batch_buckets, exchange=exchange)
    run = functools.partial(_all_reduce, axis_name=axis_name, settings=settings)
    return over_blocks(run, x, block_specs, jax.random.key(0) if key is None else key,
                       like_x=(owner_residual,), out_specs=settings.result_specs)


def _checked_settings(compressor: Compressor, key: jax.Array | None, axis_name: AxisName, *,
                      algorithm: object, mean: bool, fuse: bool, bucket_bytes: int | None,
                      pipeline: object, owner_residual: Any, batch_buckets: object,
                      exchange: object) -> _Settings:
    """The `_Settings` of one call, validated, ``"auto"`` resolved.

    Raises ValueError for an unknown algorithm, ``"ring"`` with a non-linear
    compressor, ``owner_residual`` with another algorithm than pairwise, a
    stochastic compressor without a key, ``pipeline > 1`` over two axes, or
    an unknown exchange.
    """
    options: tuple[Algorithm, ...] = ("auto", *ALGORITHMS)
    chosen = check_choice("algorithm", algorithm, options)
    pipeline = check_int("pipeline", pipeline, low=1)
    batch_buckets = check_batch_buckets(batch_buckets)
    resolved: ReduceAlgorithm = (("ring" if compressor.linear else "pairwise")
                                 if chosen == "auto" else chosen)
    if resolved == "ring" and not compressor.linear:
        raise ValueError(f"algorithm='ring' sums payloads in the compressed domain and needs "
                         f"a linear compressor; {compressor.name} is not (use 'pairwise')")
    if owner_residual is not None and resolved != "pairwise":
        raise ValueError("owner_residual is only used by algorithm='pairwise'")
    if compressor.stochastic and key is None:
        raise ValueError(f"{compressor.name} is stochastic: pass key")
    axes = hierarchy_axes(axis_name)
    if axes is not None and pipeline > 1:
        raise ValueError("pipeline > 1 needs a single axis_name; a hierarchical (outer, "
                         "inner) all-reduce runs one piece per chunk")
    return _Settings(compressor, resolved, mean, fuse, bucket_bytes, pipeline, batch_buckets,
                     check_choice("exchange", exchange, EXCHANGES), axes)


def _all_reduce(x: Any, owner_residual: Any, key: jax.Array, *, axis_name: AxisName,
                settings: _Settings) -> AllReduceResult:
    """`compressed_all_reduce` of checked settings, on whole leaves."""
    key = jax.random.fold_in(key, lax.axis_index(axis_name))
    n = int(lax.axis_size(axis_name))
    leaves, treedef = jax.tree.flatten(x)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    owners = (treedef.flatten_up_to(owner_residual) if owner_residual is not None
              else None)
    compressor = settings.compressor
    segments = plan_segments(leaves, compressor.grouping, compressor.block, n,
                             fuse=settings.fuse, bucket_bytes=settings.bucket_bytes)
    reduce_bucket = functools.partial(_reduce_bucket, axis_name=axis_name, settings=settings)
    reduced = reduce_buckets(segments, leaves, owners, key=key,
                             masks_padding=compressor.masks_padding,
                             reduce_bucket=reduce_bucket, batch_buckets=settings.batch_buckets)
    value, contributed, owner = _leaf_results(segments, reduced, leaves, treedef)
    if settings.mean:
        value = jax.tree.map(lambda v: (v / n).astype(v.dtype), value)
    return AllReduceResult(value, contributed,
                           owner if settings.algorithm == "pairwise" else None)


def _reduce_bucket(data: jax.Array, valid: Any, residual: jax.Array | None, *,
                   key: jax.Array | None, layout: Segment, axis_name: AxisName,
                   settings: _Settings) -> AllReduceResult:
    """One bucket's chunks reduced over ``axis_name``, or hierarchically over
    ``settings.axes``."""
    chunks = Chunks(data, layout)
    owned = None if residual is None else Chunks(residual, layout)
    if settings.axes is None:
        return reduce_pieces(chunks, axis_name, settings.compressor, valid=valid, key=key,
                             algorithm=settings.algorithm, residual=owned,
                             pipeline=settings.pipeline, exchange=settings.exchange)
    return reduce_hierarchical(chunks, settings.axes, settings.compressor, valid=valid,
                               key=key, algorithm=settings.algorithm, residual=owned,
                               exchange=settings.exchange)


def _leaf_results(segments: Sequence[Segment], reduced: list[AllReduceResult],
                  leaves: Sequence[jax.Array], treedef: Any) -> AllReduceResult:
    """The segments' reduced buckets cut back into trees like ``x``, field by
    field; empty leaves get zeros (a float32 owner error)."""
    out: dict[str, list[Any]] = {field: [None] * len(leaves) for field in AllReduceResult._fields}
    for seg, parts in zip(segments, reduced, strict=True):
        for field, stacked in zip(AllReduceResult._fields, parts, strict=True):
            if seg.length == 0:  # empty leaves
                for m in seg.members:
                    dtype = jnp.float32 if field == "owner_error" else leaves[m].dtype
                    out[field][m] = jnp.zeros(leaves[m].shape, dtype)
            elif stacked is not None:
                for m, leaf in zip(seg.members, seg.unbucketed(stacked), strict=True):
                    out[field][m] = leaf
    return AllReduceResult(*(treedef.unflatten(out[field]) for field in AllReduceResult._fields))
