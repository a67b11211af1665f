"""`compressed_all_reduce`: an optax transformation that all-reduces gradients
through a qcollect compressor, with error feedback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import qcollect as qc
from transforms._policy import CompressorSpec, leaf_compressors, sum_uncompressed
from transforms._sharding import (
    all_finite,
    as_block,
    check_local_gradients,
    device_block,
    keep_if_finite,
    leaves_like,
)


class CompressedAllReduceState(NamedTuple):
    """State of `compressed_all_reduce`.

    Attributes:
      residual: per device (``P(axis_name)``, see `transforms.state_specs`):
        float32 tree like the gradients, what error feedback still owes,
        ``input - contributed`` (Seide; Grubic Alg. 2 line 4). Leaves that
        are not compressed, or all of them without error feedback, are
        ``optax.MaskedNode()``.
      owner_residual: per device: with ``algorithm="pairwise"``, the owner's
        re-encoding error (two-level error feedback, as DeepSpeed's server
        error); else ``optax.MaskedNode()`` leaves.
      key: PRNG key (replicated); step ``t`` uses ``fold_in(key, t)``, then
        the collective folds in the device index.
      count: int32 step count (replicated).
    """

    residual: Any
    owner_residual: Any
    key: jax.Array
    count: jax.Array

    per_device_fields = ("residual", "owner_residual")


def _zeros_or_masked(leaf, keep: bool):
    return jnp.zeros(jnp.shape(leaf), jnp.float32) if keep else optax.MaskedNode()


def compressed_all_reduce(axis_name, *, compressor: CompressorSpec, key: jax.Array,
                          mean: bool = True, error_feedback: bool = True,
                          algorithm: str = "auto", min_size: int = 0,
                          compress_if: Callable | None = None,
                          fuse: bool = True, bucket_bytes: int | None = qc.BUCKET_BYTES,
                          pipeline: int = 1,
                          unroll_buckets: int | str | None = qc.UNROLL_BUCKETS
                          ) -> optax.GradientTransformation:
    """All-reduce the gradients through ``compressor``, with error feedback.

    Each step, on every device: ``input = g + residual`` (float32); the
    compressed leaves are summed by `qcollect.compressed_all_reduce` (leaves
    with equal compressors ride together in segments of up to 4 MiB per
    dtype, each leaf keeping its own buckets, columns or ranges), the others
    by ``qc.fused_psum``; ``residual = input - contributed``, where
    ``contributed`` is what this device's own encodings decode to (Seide;
    Grubic et al. Algorithm 2). With ``algorithm="pairwise"`` the owner's
    re-encoding error is kept too and added before the next re-encoding
    (two-level error feedback, like the worker and server errors of
    DeepSpeed's 1-bit Adam). The update is the mean (or sum) over devices,
    in the gradients' dtypes, and is invariant along ``axis_name``: apply it
    to replicated (``P()``) parameters. The residuals are the only per-device
    state (`transforms.state_specs`, `transforms.init_sharded`).

    Gradients must be this device's own: under ``shard_map``, differentiate
    with respect to ``jax.lax.pcast(params, axis_name, to="varying")``
    (``jax.grad`` with respect to replicated parameters returns gradients
    already summed by an uncompressed ``psum``; that raises ValueError).

    Non-finite gradients: every compressor turns NaN/Inf into non-finite
    output, so if any device's gradient is non-finite the reduced update is
    non-finite on every device. That step then leaves the residuals unchanged
    (they are never poisoned) and passes the non-finite update on; chain
    ``optax.apply_if_finite(inner, ...)`` *after* this transformation to skip
    it. (Wrapping this transformation in ``apply_if_finite`` would let devices
    disagree on whether to run the collectives.)

    Args:
      axis_name: the data-parallel axis (``shard_map`` or ``pmap``), or a
        pair ``(outer, inner)`` of mesh axes for multi-node meshes: a
        hierarchical all-reduce, uncompressed inside a node and compressed
        across nodes, whose error feedback keeps what the compression across
        nodes loses (`qcollect.compressed_all_reduce`); the residuals are
        then ``P((outer, inner))``.
      compressor: a qcollect `Compressor`, or ``f(path, leaf) -> Compressor |
        None`` to choose per leaf (None: uncompressed). Leaves whose
        compressors are equal (same settings) are fused.
      key: PRNG key for stochastic compressors (the same on every device).
      mean: average over devices (default) rather than sum.
      error_feedback: keep residuals (default True).
      algorithm: ``"auto"``, ``"ring"``, ``"pairwise"`` or
        ``"ring_requantize"``; see `qcollect.compressed_all_reduce`.
      min_size: leaves with fewer values go uncompressed (Grubic: quantize
        >= 99% of the parameters; small biases ride along in full precision).
      compress_if: optional predicate ``(path, leaf) -> bool``. To give
        other leaves another transformation altogether, use
        ``optax.partition``.
      fuse: let leaves of one compressor share collectives (per dtype);
        never changes a leaf's statistics.
      bucket_bytes: cap of a fused segment (default 4 MiB); larger leaves are
        reduced on their own. None: one buffer per compressor and dtype. See
        `qcollect.compressed_all_reduce`.
      pipeline: pieces per device's chunk, each reduced by its own chain of
        collectives (`qcollect.compressed_all_reduce`; 1, the default, is
        the fastest measured on the CPU backend).
      unroll_buckets: which classes of equal buckets run as one batch
        (default ``"auto"``: buckets of at most 4 MiB; an int ``K``: more
        than ``K`` buckets; None: never). See `qcollect.compressed_all_reduce`
        and `qcollect.runs_batched`.

    Returns:
      An ``optax.GradientTransformation``; ``update(grads, state, params=None)``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, qcollect as qc, transforms
      >>> tx = optax.chain(
      ...     transforms.compressed_all_reduce("data", compressor=qc.qsgd(bits=4),
      ...                                      key=jax.random.key(0)),
      ...     optax.adam(1e-3))
      >>> state = tx.init({"w": jnp.zeros((4, 4)), "b": jnp.zeros(4)})
      >>> state[0].residual["w"].shape
      (4, 4)
    """
    if algorithm not in ("auto",) + qc.ALGORITHMS:
        raise ValueError(f"algorithm must be one of {('auto',) + qc.ALGORITHMS}, got {algorithm!r}")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool)
                                     or not isinstance(bucket_bytes, int) or bucket_bytes < 0):
        raise ValueError(f"bucket_bytes must be None or an integer >= 0, got {bucket_bytes!r}")
    qc.runs_batched(1, 0, unroll_buckets)  # ValueError naming unroll_buckets
    if isinstance(pipeline, bool) or not isinstance(pipeline, int) or pipeline < 1:
        raise ValueError(f"pipeline must be an integer >= 1, got {pipeline!r}")
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"min_size must be an integer >= 0, got {min_size!r}")
    if not (isinstance(compressor, qc.Compressor) or callable(compressor)):
        raise ValueError(f"compressor must be a qcollect Compressor or a function "
                         f"(path, leaf) -> Compressor | None, got {compressor!r}")
    pairwise = algorithm == "pairwise"

    def plan(grads):
        return leaf_compressors(grads, compressor, min_size=min_size, compress_if=compress_if)

    def init(params):
        comps = plan(params)
        leaves, treedef = jax.tree.flatten(params)
        keep = [error_feedback and c is not None for c in comps]
        residual = treedef.unflatten([_zeros_or_masked(p, k)
                                      for p, k in zip(leaves, keep, strict=True)])
        owner = treedef.unflatten([_zeros_or_masked(p, k and pairwise)
                                   for p, k in zip(leaves, keep, strict=True)])
        return CompressedAllReduceState(residual, owner, key, jnp.zeros([], jnp.int32))

    def update(grads, state, params=None):
        del params
        check_local_gradients(grads, axis_name)
        comps = plan(grads)
        leaves, treedef = jax.tree.flatten(grads)
        stored = leaves_like(grads, state.residual, "error-feedback residuals")
        stored_owner = leaves_like(grads, state.owner_residual, "owner residuals")
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
        residuals = [None if isinstance(r, optax.MaskedNode)
                     else device_block(r, g, axis_name, f"the error-feedback residual of {path}")
                     for r, g, path in zip(stored, leaves, paths, strict=True)]
        owners = [None if isinstance(r, optax.MaskedNode)
                  else device_block(r, g, axis_name, f"the owner residual of {path}")
                  for r, g, path in zip(stored_owner, leaves, paths, strict=True)]
        step_key = jax.random.fold_in(state.key, state.count)
        inputs = [leaf if r is None else leaf.astype(jnp.float32) + r
                  for leaf, r in zip(leaves, residuals, strict=True)]

        out = sum_uncompressed(inputs, [c is not None for c in comps], axis_name, mean=mean)
        new_res = list(residuals)
        new_owner = list(owners)
        groups: dict[qc.Compressor, list[int]] = {}
        for i, c in enumerate(comps):
            if c is not None:
                groups.setdefault(c, []).append(i)
        for g, (c, members) in enumerate(groups.items()):
            xs = [inputs[i].astype(jnp.float32) for i in members]
            owner_in = [owners[i] for i in members] if pairwise and error_feedback else None
            result = qc.compressed_all_reduce(
                xs, axis_name, c, jax.random.fold_in(step_key, g), algorithm=algorithm,
                mean=mean, fuse=fuse, bucket_bytes=bucket_bytes, pipeline=pipeline,
                owner_residual=owner_in, unroll_buckets=unroll_buckets)
            for j, i in enumerate(members):
                out[i] = result.value[j]
                if error_feedback:
                    new_res[i] = xs[j] - result.contributed[j].astype(jnp.float32)
                    if owner_in is not None:
                        new_owner[i] = result.owner_error[j]
        out = [o.astype(leaf.dtype) for o, leaf in zip(out, leaves, strict=True)]
        # Non-finite anywhere makes the reduced update non-finite everywhere,
        # so this flag agrees across devices without another collective.
        finite = all_finite(out)

        def stored_like(new, old, blocks):
            return treedef.unflatten([
                b if o is None else as_block(keep_if_finite(finite, n, o), b)
                for n, o, b in zip(new, old, blocks, strict=True)])

        new_state = CompressedAllReduceState(
            residual=stored_like(new_res, residuals, stored),
            owner_residual=stored_like(new_owner, owners, stored_owner),
            key=state.key,
            count=state.count + 1,
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init, update)
