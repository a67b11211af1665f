"""`compressed_all_reduce`: an optax transformation that all-reduces gradients
through a qcollect compressor, with error feedback.

Each step, on every device: ``input = g + residual`` (float32); the
compressed leaves are summed by `qcollect.compressed_all_reduce` (leaves
with equal compressors ride together in segments of up to 4 MiB per dtype,
each leaf keeping its own buckets, columns or ranges), the others by
``qc.fused_psum``; ``residual = input - contributed``, where ``contributed``
is what this device's own encodings decode to (Seide; Grubic et al.
Algorithm 2). With ``algorithm="pairwise"`` the owner's re-encoding error is
kept too and added before the next re-encoding (two-level error feedback,
like the worker and server errors of DeepSpeed's 1-bit Adam). The update is
the mean (or sum) over devices, in the gradients' dtypes, and is invariant
along ``axis_name``: apply it to replicated (``P()``) parameters. The
residuals are the only per-device state (`transforms.state_specs`,
`transforms.init_sharded`).

Gradients must be this device's own: under ``shard_map``, differentiate with
respect to ``jax.lax.pcast(params, axis_name, to="varying")`` (``jax.grad``
with respect to replicated parameters returns gradients already summed by an
uncompressed ``psum``; that raises ValueError).

Non-finite gradients: every compressor turns NaN/Inf into non-finite output,
so if any device's gradient is non-finite the reduced update is non-finite
on every device. That step then leaves the residuals unchanged (they are
never poisoned) and passes the non-finite update on; chain
``optax.apply_if_finite(inner, ...)`` *after* this transformation to skip
it. (Wrapping this transformation in ``apply_if_finite`` would let devices
disagree on whether to run the collectives.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import qcollect as qc
from qcollect.checks import check_choice, check_int, check_key
from transforms._axes import AxisName, check_local_gradients
from transforms._finite import all_finite
from transforms._placement import per_device
from transforms._policy import (
    BlockSpecs,
    CompressorSpec,
    LeafPredicate,
    check_compressor,
    group_indices,
    leaf_compressors,
    sum_uncompressed,
)
from transforms._state import kept_per_device, read_per_device, zeros_or_masked


@per_device("residual", "owner_residual")
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


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The validated static settings of one `compressed_all_reduce` transformation."""

    axis_name: AxisName
    compressor: CompressorSpec
    mean: bool
    error_feedback: bool
    algorithm: qc.Algorithm
    min_size: int
    compress_if: LeafPredicate | None
    fuse: bool
    bucket_bytes: int | None
    pipeline: int
    batch_buckets: qc.BatchBuckets
    exchange: qc.Exchange
    block_specs: BlockSpecs = None

    def leaf_block_specs(self, tree: Any) -> list[P] | None:
        """Each leaf's block spec (flatten order), or None: read from the types."""
        if self.block_specs is None:
            return None
        return jax.tree.leaves(qc.block_spec_tree(tree, self.block_specs),
                               is_leaf=lambda s: isinstance(s, P))

    @property
    def keeps_owner_residual(self) -> bool:
        return self.error_feedback and self.algorithm == "pairwise"

    def compressors(self, tree: Any) -> list[qc.Compressor | None]:
        """Each leaf's compressor (flatten order), None for the uncompressed ones."""
        return leaf_compressors(tree, self.compressor, min_size=self.min_size,
                                compress_if=self.compress_if)


def compressed_all_reduce(axis_name: AxisName, *, compressor: CompressorSpec, key: jax.Array,
                          mean: bool = True, error_feedback: bool = True,
                          algorithm: qc.Algorithm = "auto", min_size: int = 0,
                          compress_if: LeafPredicate | None = None, fuse: bool = True,
                          bucket_bytes: int | None = qc.BUCKET_BYTES, pipeline: int = 1,
                          batch_buckets: qc.BatchBuckets = qc.BATCH_BUCKETS,
                          exchange: qc.Exchange = "permute", block_specs: BlockSpecs = None
                          ) -> optax.GradientTransformation:
    """All-reduce the gradients through ``compressor``, with error feedback.

    Each device adds its residual to its gradient; the compressed leaves are
    summed by `qcollect.compressed_all_reduce`, the others by ``qc.fused_psum``;
    the residual keeps what this device's encodings lost, so what one step
    drops is sent in later ones. The update is the mean (or sum) over
    devices, invariant along ``axis_name``. Gradients must be each device's
    own (docs/transforms.md, "The data-parallel step", has the details).

    Args:
      axis_name: the data-parallel axis (``shard_map`` or ``pmap``), or a
        pair ``(outer, inner)`` of mesh axes: a hierarchical all-reduce,
        compressed across nodes only; the residuals are ``P((outer, inner))``.
      compressor: a qcollect `Compressor`, or ``f(path, leaf) -> Compressor |
        None`` to choose per leaf (None: uncompressed). Leaves whose
        compressors are equal (same settings) are fused.
      key: PRNG key for stochastic compressors (the same on every device).
      mean: average over devices (default) rather than sum.
      error_feedback: keep residuals (default True).
      algorithm: ``"auto"``, ``"ring"``, ``"pairwise"`` (also keeps the
        owner's re-encoding error) or ``"ring_requantize"``.
      min_size: leaves with fewer values go uncompressed (Grubic 3.2.2).
      compress_if: optional predicate ``(path, leaf) -> bool``; to give other
        leaves another transformation, use ``optax.partition``.
      fuse: let leaves of one compressor share collectives (per dtype).
      bucket_bytes: cap of a fused segment (default 4 MiB); None: one buffer
        per compressor and dtype.
      pipeline: pieces per device's chunk, each reduced by its own chain of
        collectives (default 1, as measured in docs/collectives.md#pipelining).
      batch_buckets: which classes of equal buckets run as one batch
        (`qcollect.runs_batched`): ``"auto"`` (default), ``"always"``,
        ``"never"`` or an int ``K`` (batch classes of more than ``K``).
      exchange: ``"permute"`` (default) or ``"all_to_all"``: how the
        pairwise and ring algorithms move payloads to their owners.
      block_specs: on a mesh with model axes, how they shard each leaf: a
        ``PartitionSpec``, a pytree of them, or ``f(path, leaf) ->
        PartitionSpec``; default: read from the gradients' types. Each device
        reduces its own block (docs/transforms.md, "Meshes with model axes").

    Returns:
      An ``optax.GradientTransformation``; ``update(grads, state, params=None)``.

    Raises:
      ValueError: a setting out of its range (naming it), or invariant
        gradients in ``update``.

    References:
      Seide et al., INTERSPEECH 2014
      <https://doi.org/10.21437/Interspeech.2014-274> (error feedback);
      Grubic et al., EDBT 2018 <https://doi.org/10.3929/ethz-b-000319485>,
      Algorithm 2; Dryden et al., MLHPC 2016, section 3.4 (pairwise
      exchange) <https://doi.org/10.1109/MLHPC.2016.004>.

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
    settings = _validated(
        axis_name, compressor=compressor, mean=mean, error_feedback=error_feedback,
        algorithm=algorithm, min_size=min_size, compress_if=compress_if, fuse=fuse,
        bucket_bytes=bucket_bytes, pipeline=pipeline, batch_buckets=batch_buckets,
        exchange=exchange, block_specs=block_specs)
    return optax.GradientTransformation(
        functools.partial(_init, key=check_key("key", key), settings=settings),
        functools.partial(_update, settings=settings))


def _validated(axis_name: AxisName, *, compressor: CompressorSpec, mean: bool,
               error_feedback: bool, algorithm: qc.Algorithm, min_size: int,
               compress_if: LeafPredicate | None, fuse: bool, bucket_bytes: int | None,
               pipeline: int, batch_buckets: qc.BatchBuckets, exchange: qc.Exchange,
               block_specs: BlockSpecs) -> _Settings:
    """The settings of `compressed_all_reduce`, checked; ValueError naming the first bad one."""
    algorithm = check_choice("algorithm", algorithm, get_args(qc.Algorithm))
    bucket_bytes = check_int("bucket_bytes", bucket_bytes, low=0, allow_none=True)
    qc.runs_batched(1, 0, batch_buckets)  # ValueError naming batch_buckets
    exchange = check_choice("exchange", exchange, get_args(qc.Exchange))
    return _Settings(
        axis_name=axis_name, compressor=check_compressor("compressor", compressor),
        mean=mean, error_feedback=error_feedback, algorithm=algorithm,
        min_size=check_int("min_size", min_size, low=0), compress_if=compress_if, fuse=fuse,
        bucket_bytes=bucket_bytes, pipeline=check_int("pipeline", pipeline),
        batch_buckets=batch_buckets, exchange=exchange, block_specs=block_specs)


def _init(params: optax.Params, *, key: jax.Array,
          settings: _Settings) -> CompressedAllReduceState:
    leaves, treedef = jax.tree.flatten(params)
    compressed = [c is not None for c in settings.compressors(params)]
    return CompressedAllReduceState(
        residual=treedef.unflatten([zeros_or_masked(leaf, c and settings.error_feedback)
                                    for leaf, c in zip(leaves, compressed, strict=True)]),
        owner_residual=treedef.unflatten([
            zeros_or_masked(leaf, c and settings.keeps_owner_residual)
            for leaf, c in zip(leaves, compressed, strict=True)]),
        key=key,
        count=jnp.zeros([], jnp.int32))


def _update(grads: optax.Updates, state: CompressedAllReduceState,
            params: optax.Params | None = None, *,
            settings: _Settings) -> tuple[optax.Updates, CompressedAllReduceState]:
    """One step: the reduced update (mean or sum over devices) and the next state."""
    del params
    check_local_gradients(grads, settings.axis_name)
    comps = settings.compressors(grads)
    leaves, treedef = jax.tree.flatten(grads)
    stored, residuals = read_per_device(grads, state.residual, settings.axis_name,
                                        "the error-feedback residual",
                                        field_name="error-feedback residuals")
    stored_owner, owners = read_per_device(grads, state.owner_residual, settings.axis_name,
                                           "the owner residual", field_name="owner residuals")
    inputs = [leaf if r is None else leaf.astype(jnp.float32) + r
              for leaf, r in zip(leaves, residuals, strict=True)]

    blocks = settings.leaf_block_specs(grads)
    out = sum_uncompressed(inputs, [c is not None for c in comps], settings.axis_name,
                           mean=settings.mean, block_specs=blocks)
    new_residuals, new_owners = list(residuals), list(owners)
    step_key = jax.random.fold_in(state.key, state.count)
    for i, (value, residual, owner) in _reduce_compressed(inputs, comps, owners, step_key,
                                                          settings, blocks).items():
        out[i] = value
        if residual is not None:
            new_residuals[i] = residual
        if owner is not None:
            new_owners[i] = owner
    out = [o.astype(leaf.dtype) for o, leaf in zip(out, leaves, strict=True)]
    # Non-finite anywhere makes the reduced update non-finite everywhere,
    # so this flag agrees across devices without another collective.
    finite = all_finite(out)
    return treedef.unflatten(out), CompressedAllReduceState(
        residual=treedef.unflatten(kept_per_device(new_residuals, residuals, stored, finite)),
        owner_residual=treedef.unflatten(kept_per_device(new_owners, owners, stored_owner,
                                                         finite)),
        key=state.key,
        count=optax.safe_int32_increment(state.count),
    )


def _reduce_compressed(inputs: list[jax.Array], comps: list[qc.Compressor | None],
                       owners: list[jax.Array | None], step_key: jax.Array,
                       settings: _Settings, blocks: list[P] | None
                       ) -> dict[int, tuple[jax.Array, jax.Array | None, jax.Array | None]]:
    """The compressed leaves summed, one `qcollect.compressed_all_reduce` per
    group of equal compressors (group ``g`` draws ``fold_in(step_key, g)``).

    Returns:
      ``{i: (value, residual, owner_error)}`` per compressed leaf ``i``: the
      reduced value, ``input - contributed`` (float32; None without error
      feedback) and the owner's re-encoding error (None unless
      `_Settings.keeps_owner_residual`).
    """
    s = settings
    reduced = {}
    for g, (compressor, members) in enumerate(group_indices(comps).items()):
        xs = [inputs[i].astype(jnp.float32) for i in members]
        owner_in = [owners[i] for i in members] if s.keeps_owner_residual else None
        result = qc.compressed_all_reduce(
            xs, s.axis_name, compressor, jax.random.fold_in(step_key, g),
            algorithm=s.algorithm, mean=s.mean, fuse=s.fuse, bucket_bytes=s.bucket_bytes,
            pipeline=s.pipeline, owner_residual=owner_in, batch_buckets=s.batch_buckets,
            exchange=s.exchange,
            block_specs=None if blocks is None else [blocks[i] for i in members])
        for j, i in enumerate(members):
            residual = (xs[j] - result.contributed[j].astype(jnp.float32)
                        if s.error_feedback else None)
            owner_error = result.owner_error[j] if owner_in is not None else None
            reduced[i] = (result.value[j], residual, owner_error)
    return reduced
