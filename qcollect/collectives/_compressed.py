"""Compressed all-reduce: three algorithms from the seed papers.

All three lay the leaves out into segments of whole compressor groups and cut
each segment into N chunks of whole groups, one per device of ``axis_name``
(`qcollect.collectives._layout`: no bucket, column or entropy range ever spans two leaves
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
(`qcollect.collectives._hierarchical`): uncompressed inside a node (``inner``), one of
the three algorithms above across nodes (``outer``) on each device's share.

Randomness: every device uses ``fold_in(key, axis_index)``, then one more
``fold_in`` per chunk, hop or buffer, so no two encodings share a stream.

Exchange (the ``exchange`` argument): the pairwise exchange's N - 1 transfers
of every chunk to its owner run as N - 1 ``ppermute`` shifts one after the
other (``"permute"``, the default) or as one `lax.all_to_all`, every device
sending to every other at once (``"all_to_all"``, as ZeRO++'s qgZ moves its
quantized reduce-scatter); with ``"all_to_all"`` the compressed-domain ring
likewise sends every payload straight to its owner, which adds the N
payloads, in place of N - 1 hops. The bytes are the same, and pairwise
gives the same values bit for bit. On the CPU backend the shifts were as
fast or faster in every measured setting but small messages over a slow
link: one process, and the MLP across 4 processes at 100 Mbit/s and
1 Gbit/s (`docs/collectives.md`, "One all-to-all or N - 1 shifts"); other
backends were not measured.

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
  by each run's last, partly filled packed word. On the CPU backend no
  count helped (`docs/collectives.md`, "Pipelining").
* ``batch_buckets``: equal buckets (the full buckets of fused leaves, or
  leaves of one shape reduced on their own) form a class, which runs either
  as one batch (`jax.vmap` over its buckets: each hop one message for all
  of them, one copy of the algorithm in the program) or traced once per
  bucket (`qc.runs_batched`, `qcollect.collectives._buckets`). By default classes of
  buckets of at most 4 MiB run batched, classes of larger buckets (large
  leaves reduced alone) traced unless more than 16 share a shape. The batch
  copies its buckets into a stack; measured across processes it pays for
  4 MiB buckets and not for 8 MiB and up, and in one process it is slower
  (`docs/benchmarks.md`, "Batch or trace"). Values, wire bytes and random
  streams are the same either way, except that a constant payload array
  (PCA's weight) is sent once per batch, not once per bucket.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from qcollect._config import check_choice, check_int
from qcollect._payload import Compressor
from qcollect.collectives._algorithms import EXCHANGES, Chunks, Exchange, reduce_pieces
from qcollect.collectives._blocks import over_blocks
from qcollect.collectives._buckets import (
    BATCH_BUCKETS,
    BatchBuckets,
    check_batch_buckets,
    reduce_buckets,
)
from qcollect.collectives._hierarchical import reduce_hierarchical
from qcollect.collectives._layout import BUCKET_BYTES, plan_segments
from qcollect.collectives._result import AllReduceResult

__all__ = ["ALGORITHMS", "AllReduceResult", "compressed_all_reduce"]

ALGORITHMS = ("ring", "pairwise", "ring_requantize")
#: ``algorithm`` of the compressed all-reduce: one of `ALGORITHMS` or ``"auto"``.
Algorithm = Literal["auto", "ring", "pairwise", "ring_requantize"]


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
                          algorithm: Algorithm = "auto", mean: bool = False, fuse: bool = True,
                          bucket_bytes: int | None = BUCKET_BYTES, pipeline: int = 1,
                          owner_residual=None,
                          batch_buckets: BatchBuckets = BATCH_BUCKETS,
                          exchange: Exchange = "permute", block_specs=None) -> AllReduceResult:
    """All-reduce of an array or pytree with every hop compressed.

    Args:
      x: array or pytree of arrays, this device's contribution.
      axis_name: the mapped axis (inside `jax.shard_map` or `jax.pmap`), or
        a pair ``(outer, inner)`` of mesh axes for a hierarchical
        all-reduce over both: an uncompressed ``psum_scatter`` over
        ``inner`` (the devices of one node, fast links), ``algorithm`` over
        ``outer`` (across nodes) on each device's 1/L share, and an
        ``all_gather`` over ``inner`` (module `qcollect.collectives._hierarchical`).
        Groups and error feedback are as with one axis; the result is
        invariant along both axes.
      compressor: any qcollect `Compressor`.
      key: PRNG key (needed by stochastic compressors); folded with the
        device index, so pass the same key on every device.
      algorithm: ``"ring"`` (linear compressors), ``"pairwise"``,
        ``"ring_requantize"``, or ``"auto"``: ring for linear compressors,
        else pairwise. See the module docstring.
      mean: divide the sum by the number of devices (of both axes).
      fuse: place leaves of one dtype side by side in one segment (default);
        with False every leaf is reduced on its own (module docstring).
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
      exchange: how ``"pairwise"`` sends each chunk's payloads to its owner
        and how ``"ring"`` sums them: ``"permute"`` (default: N - 1
        ``ppermute`` shifts, or the ring's N - 1 hops) or ``"all_to_all"``
        (one `lax.all_to_all`, every transfer at once; the ring's sums then
        happen at the owner). The same wire bytes and, for pairwise, the
        same values; the ring's sums round in another order (module
        docstring).
      block_specs: on a mesh with model axes, inside ``jax.shard_map(...,
        axis_names={axis_name})``: how those axes shard each leaf (a
        ``PartitionSpec`` for all, or a pytree of them like ``x``; default:
        read from the leaves' types where the axes are explicit). Each
        device then reduces its own block, as a leaf of its own, and the
        result is sharded as ``x`` is (`qcollect.collectives._blocks`).

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
      Yu et al. (GradiVeQ), NeurIPS 2018 <https://arxiv.org/abs/1811.03617>,
        Algorithm 1; Dryden et al., MLHPC 2016, section 3.4
        <https://doi.org/10.1109/MLHPC.2016.004>; Gibiansky, ring all-reduce
        <http://research.baidu.com/bringing-hpc-techniques-deep-learning/>;
      hierarchical: Wang et al. (ZeRO++), 2023 <https://arxiv.org/abs/2306.10209>;
        CGX (Markov et al. 2022).
    """
    algorithm, pipeline, batch_buckets, axes = _checked_settings(
        compressor, key, axis_name, algorithm=algorithm, pipeline=pipeline,
        owner_residual=owner_residual, batch_buckets=batch_buckets)
    check_choice("exchange", exchange, EXCHANGES)
    run = functools.partial(_all_reduce, axis_name=axis_name, compressor=compressor,
                            algorithm=algorithm, mean=mean, fuse=fuse,
                            bucket_bytes=bucket_bytes, pipeline=pipeline,
                            batch_buckets=batch_buckets, exchange=exchange, axes=axes)
    key = jax.random.key(0) if key is None else key
    owned = algorithm == "pairwise"
    return over_blocks(run, x, block_specs, key, like_x=(owner_residual,),
                       out_specs=lambda s: AllReduceResult(s, s, s if owned else None))


def _all_reduce(x, owner_residual, key, *, axis_name, compressor, algorithm, mean, fuse,
                bucket_bytes, pipeline, batch_buckets, exchange, axes) -> AllReduceResult:
    """`compressed_all_reduce` of checked settings, on whole leaves."""
    key = jax.random.fold_in(key, lax.axis_index(axis_name))
    n = int(lax.axis_size(axis_name))
    leaves, treedef = jax.tree.flatten(x)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    owners = (treedef.flatten_up_to(owner_residual) if owner_residual is not None
              else None)
    segments = plan_segments(leaves, compressor.grouping, compressor.block, n,
                             fuse=fuse, bucket_bytes=bucket_bytes)
    reduce_bucket = functools.partial(_reduce_bucket, axis_name=axis_name, axes=axes,
                                      compressor=compressor, algorithm=algorithm,
                                      pipeline=pipeline, exchange=exchange)
    reduced = reduce_buckets(segments, leaves, owners, key=key,
                             masks_padding=compressor.masks_padding,
                             reduce_bucket=reduce_bucket, batch_buckets=batch_buckets)
    value, contributed, owner = _leaf_results(segments, reduced, leaves, treedef)
    if mean:
        value = jax.tree.map(lambda v: (v / n).astype(v.dtype), value)
    return AllReduceResult(value, contributed, owner if algorithm == "pairwise" else None)


def _checked_settings(compressor: Compressor, key, axis_name, *, algorithm: str,
                      pipeline: int, owner_residual, batch_buckets):
    """``(algorithm, pipeline, batch_buckets, axes)`` validated, ``"auto"``
    resolved, ``axes`` the `_hierarchy` of ``axis_name``.

    Raises ValueError for an unknown algorithm, ``"ring"`` with a non-linear
    compressor, ``owner_residual`` with another algorithm than pairwise, a
    stochastic compressor without a key, or ``pipeline > 1`` over two axes.
    """
    check_choice("algorithm", algorithm, ("auto",) + ALGORITHMS)
    pipeline = check_int("pipeline", pipeline, low=1)
    batch_buckets = check_batch_buckets(batch_buckets)
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
    return algorithm, pipeline, batch_buckets, axes


def _reduce_bucket(data, valid, residual, *, key, layout, axis_name, axes,
                   compressor: Compressor, algorithm: str, pipeline: int,
                   exchange: str) -> AllReduceResult:
    """One bucket's chunks reduced over ``axis_name``, or hierarchically over ``axes``."""
    chunks = Chunks(data, layout)
    residual = None if residual is None else Chunks(residual, layout)
    if axes is None:
        return reduce_pieces(chunks, axis_name, compressor, valid=valid, key=key,
                             algorithm=algorithm, residual=residual, pipeline=pipeline,
                             exchange=exchange)
    return reduce_hierarchical(chunks, axes, compressor, valid=valid, key=key,
                               algorithm=algorithm, residual=residual, exchange=exchange)


def _leaf_results(segments, reduced: list[AllReduceResult], leaves, treedef) -> AllReduceResult:
    """The segments' reduced buckets cut back into trees like ``x``, field by
    field; empty leaves get zeros (a float32 owner error)."""
    out = {field: [None] * len(leaves) for field in AllReduceResult._fields}
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
