"""`compressed_allreduce`: an optax transformation that all-reduces gradients
through a qcollect compressor, with error feedback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

import qcollect as qc
from transforms._policy import CompressorSpec, leaf_compressors


class CompressedAllReduceState(NamedTuple):
    """State of `compressed_allreduce` (per device; see `transforms.replicate`).

    Attributes:
      residual: float32 tree like the gradients: what error feedback still
        owes, ``input - contributed`` (Seide; Grubic Alg. 2 line 4). Leaves
        that are not compressed, or all of them without error feedback, hold
        empty ``(0,)`` arrays.
      owner_residual: with ``algorithm="pairwise"``, the owner's re-encoding
        error (two-level error feedback, as DeepSpeed's server error); else
        empty arrays.
      key: PRNG key; step ``t`` uses ``fold_in(key, t)``, then the collective
        folds in the device index.
      count: int32 step count.
    """

    residual: Any
    owner_residual: Any
    key: jax.Array
    count: jax.Array


_EMPTY = (0,)


def _empty_like_or(leaf, keep: bool):
    return jnp.zeros(jnp.shape(leaf), jnp.float32) if keep else jnp.zeros(_EMPTY, jnp.float32)


def all_finite(tree) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.array(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))


def compressed_allreduce(compressor: CompressorSpec, axis_name, *, key: jax.Array,
                         mean: bool = True, error_feedback: bool = True,
                         algorithm: str = "auto", min_size: int = 0,
                         compress_if: Callable | None = None,
                         fuse: bool = True, bucket_bytes: int | None = qc.BUCKET_BYTES
                         ) -> optax.GradientTransformation:
    """All-reduce the gradients through ``compressor``, with error feedback.

    Each step, on every device: ``input = g + residual`` (float32); the
    compressed leaves are summed by `qcollect.compressed_all_reduce` (leaves
    sharing a compressor ride together in segments of up to 4 MiB per dtype, each
    leaf keeping its own buckets, columns or ranges), the others by
    ``lax.psum``; ``residual = input - contributed``, where ``contributed`` is
    what this device's own encodings decode to (Seide; Grubic et al.
    Algorithm 2). With ``algorithm="pairwise"`` the owner's re-encoding error
    is kept too and added before the next re-encoding (two-level error
    feedback, like the worker and server errors of DeepSpeed's 1-bit Adam).
    The update is the mean (or sum) over devices, in the gradients' dtypes.

    Non-finite gradients: every compressor turns NaN/Inf into non-finite
    output, so if any device's gradient is non-finite the reduced update is
    non-finite on every device. That step then leaves the residuals unchanged
    (they are never poisoned) and passes the non-finite update on; chain
    ``optax.apply_if_finite(inner, ...)`` *after* this transformation to skip
    it. (Wrapping this transformation in ``apply_if_finite`` would let devices
    disagree on whether to run the collectives.)

    Args:
      compressor: a qcollect `Compressor`, or ``f(path, leaf) -> Compressor |
        None`` to choose per leaf (None: uncompressed). Leaves are fused per
        compressor object, so such a function should return the same object
        (built once, outside it) for leaves that should ride together.
      axis_name: the data-parallel axis (``shard_map`` or ``pmap``).
      key: PRNG key for stochastic compressors (the same on every device).
      mean: average over devices (default) rather than sum.
      error_feedback: keep residuals (default True).
      algorithm: ``"auto"``, ``"ring"``, ``"pairwise"`` or
        ``"ring_requantize"``; see `qcollect.compressed_all_reduce`.
      min_size: leaves with fewer values go uncompressed (Grubic: quantize
        >= 99% of the parameters; small biases ride along in full precision).
      compress_if: optional predicate ``(path, leaf) -> bool``.
      fuse: let leaves of one compressor share collectives (per dtype);
        never changes a leaf's statistics.
      bucket_bytes: cap of a fused segment (default 4 MiB); larger leaves are
        reduced on their own. None: one buffer per compressor and dtype. See
        `qcollect.compressed_all_reduce`.

    Returns:
      An ``optax.GradientTransformation``; ``update(grads, state, params=None)``.

    Example:
      >>> import jax, optax, qcollect as qc, transforms
      >>> tx = optax.chain(
      ...     transforms.compressed_allreduce(qc.qsgd(bits=4), "data",
      ...                                     key=jax.random.key(0)),
      ...     optax.adam(1e-3))
    """
    if algorithm not in ("auto",) + qc.ALGORITHMS:
        raise ValueError(f"algorithm must be one of {('auto',) + qc.ALGORITHMS}, got {algorithm!r}")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool)
                                     or not isinstance(bucket_bytes, int) or bucket_bytes < 0):
        raise ValueError(f"bucket_bytes must be None or an integer >= 0, got {bucket_bytes!r}")
    if not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"min_size must be an integer >= 0, got {min_size!r}")
    pairwise = algorithm == "pairwise"

    def plan(grads):
        return leaf_compressors(grads, compressor, min_size=min_size, compress_if=compress_if)

    def init(params):
        comps = plan(params)
        leaves, treedef = jax.tree.flatten(params)
        keep = [error_feedback and c is not None for c in comps]
        residual = treedef.unflatten([_empty_like_or(p, k) for p, k in zip(leaves, keep,
                                                                            strict=True)])
        owner = treedef.unflatten([_empty_like_or(p, k and pairwise)
                                   for p, k in zip(leaves, keep, strict=True)])
        return CompressedAllReduceState(residual, owner, key, jnp.zeros([], jnp.int32))

    def update(grads, state, params=None):
        del params
        comps = plan(grads)
        leaves, treedef = jax.tree.flatten(grads)
        residuals = treedef.flatten_up_to(state.residual)
        owners = treedef.flatten_up_to(state.owner_residual)
        step_key = jax.random.fold_in(state.key, state.count)
        inputs = [leaf.astype(jnp.float32) + r if r.size else leaf
                  for leaf, r in zip(leaves, residuals, strict=True)]

        out = [None] * len(leaves)
        new_res = list(residuals)
        new_owner = list(owners)
        groups: dict[qc.Compressor, list[int]] = {}
        for i, c in enumerate(comps):
            if c is None:
                reduce = lax.pmean if mean else lax.psum
                # Varying like the compressed leaves, so downstream state and
                # lax.cond branches see one type for the whole update.
                out[i] = qc.as_varying(reduce(inputs[i], axis_name), axis_name)
            else:
                groups.setdefault(c, []).append(i)
        for g, (c, members) in enumerate(groups.items()):
            xs = [inputs[i].astype(jnp.float32) for i in members]
            owner_in = [owners[i] for i in members] if pairwise and error_feedback else None
            result = qc.compressed_all_reduce(
                xs, axis_name, c, jax.random.fold_in(step_key, g), algorithm=algorithm,
                mean=mean, fuse=fuse, bucket_bytes=bucket_bytes, owner_residual=owner_in)
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
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        new_state = CompressedAllReduceState(
            residual=treedef.unflatten([keep(n, o) for n, o in zip(new_res, residuals,
                                                                    strict=True)]),
            owner_residual=treedef.unflatten([keep(n, o) for n, o in zip(new_owner, owners,
                                                                          strict=True)]),
            key=state.key,
            count=state.count + 1,
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init, update)
