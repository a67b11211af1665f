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
residuals (and EF21-SGDM's momentum) are the only per-device state
(`transforms.state_specs`, `transforms.init_sharded`).

``error_feedback=transforms.ef21()`` keeps EF21's estimates instead (with
``momentum``, EF21-SGDM's); the strategy is a value with its own state
(`transforms._feedback`: `transforms.ResidualState` or
`transforms.EF21State` in ``state.feedback``); ``mask_zero_rows`` gives rows
without gradient on any device a zero update and leaves their state as it
was (`transforms._ef21` has both).

Gradients must be this device's own: under ``shard_map``, differentiate with
respect to ``jax.lax.pcast(params, axis_name, to="varying")`` (``jax.grad``
with respect to replicated parameters returns gradients already summed by an
uncompressed ``psum``; that raises ValueError).

Non-finite gradients: every compressor turns NaN/Inf into non-finite output,
so if any device's gradient is non-finite the reduced update is non-finite
on every device. That step then leaves the state unchanged (residuals
and estimates are never poisoned) and passes the non-finite update on; chain
``optax.apply_if_finite(inner, ...)`` *after* this transformation to skip
it. (Wrapping this transformation in ``apply_if_finite`` would let devices
disagree on whether to run the collectives.)

References:
  Seide et al., INTERSPEECH 2014
  <https://doi.org/10.21437/Interspeech.2014-274> (error feedback);
  Grubic et al., EDBT 2018 <https://doi.org/10.3929/ethz-b-000319485>,
  Algorithm 2; Dryden et al., MLHPC 2016, section 3.4 (pairwise exchange)
  <https://doi.org/10.1109/MLHPC.2016.004>.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import qcollect as qc
from qcollect.checks import check_choice, check_int, check_key
from transforms._axes import AxisName, check_local_gradients
from transforms._ef21 import Context, EF21State, Reduced
from transforms._feedback import EF21, Feedback, ResidualFeedback, feedback_from, residual_feedback
from transforms._finite import all_finite
from transforms._phases import COMPRESSED, CompressAfter, as_schedule
from transforms._policy import (
    BlockSpecs,
    CompressorSpec,
    LeafPredicate,
    check_compressor,
    group_indices,
    leaf_compressors,
    sum_uncompressed,
)
from transforms._residual import ResidualState
from transforms._state import kept_per_device, read_per_device


class CompressedAllReduceState(NamedTuple):
    """State of `compressed_all_reduce`.

    Attributes:
      feedback: the error-feedback strategy's state: a
        `transforms.ResidualState` (`transforms.residual_feedback`, the
        default; every leaf masked with ``error_feedback=None``) or a
        `transforms.EF21State` (`transforms.ef21`). Its per-device fields are
        ``P(axis_name)`` (`transforms.state_specs`).
      key: PRNG key (replicated); step ``t`` uses ``fold_in(key, t)``, then
        the collective folds in the device index.
      count: int32 step count (replicated).
    """

    feedback: ResidualState | EF21State
    key: jax.Array
    count: jax.Array


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The validated static settings of one `compressed_all_reduce` transformation."""

    axis_name: AxisName
    compressor: CompressorSpec
    mean: bool
    feedback: ResidualFeedback | EF21
    algorithm: qc.Algorithm
    min_size: int
    compress_if: LeafPredicate | None
    fuse: bool
    bucket_bytes: int | None
    pipeline: int
    batch_buckets: qc.BatchBuckets
    exchange: qc.Exchange
    block_specs: BlockSpecs = None
    compress_after: CompressAfter = CompressAfter(0)
    mask_zero_rows: bool = False

    def leaf_block_specs(self, tree: Any) -> list[P] | None:
        """Each leaf's block spec (flatten order), or None: read from the types."""
        if self.block_specs is None:
            return None
        return jax.tree.leaves(qc.block_spec_tree(tree, self.block_specs),
                               is_leaf=lambda s: isinstance(s, P))

    def keeps_owner(self, compressor: qc.Compressor) -> bool:
        """Whether leaves of ``compressor`` keep the owner's re-encoding error."""
        return self.feedback.keeps_owner(self.algorithm, compressor)

    def compressors(self, tree: Any) -> list[qc.Compressor | None]:
        """Each leaf's compressor (flatten order), None for the uncompressed ones."""
        return leaf_compressors(tree, self.compressor, min_size=self.min_size,
                                compress_if=self.compress_if)


def compressed_all_reduce(axis_name: AxisName, *, compressor: CompressorSpec, key: jax.Array,
                          mean: bool = True,
                          error_feedback: Feedback | bool | str = residual_feedback(),
                          ef21_momentum: float | None = None, mask_zero_rows: bool = False,
                          algorithm: qc.Algorithm = "auto", min_size: int = 0,
                          compress_if: LeafPredicate | None = None, fuse: bool = True,
                          bucket_bytes: int | None = qc.BUCKET_BYTES, pipeline: int = 1,
                          batch_buckets: qc.BatchBuckets = qc.BATCH_BUCKETS,
                          exchange: qc.Exchange = "permute", block_specs: BlockSpecs = None,
                          compress_after: int | CompressAfter = 0) -> optax.GradientTransformation:
    """All-reduce the gradients through ``compressor``, with error feedback.

    The update is the mean (or sum) over devices, invariant along
    ``axis_name``; gradients must be each device's own (docs/transforms.md,
    "The data-parallel step"). The module's docstring has the step.

    Args:
      axis_name: the data-parallel axis (``shard_map`` or ``pmap``), or a
        pair ``(outer, inner)`` of mesh axes: a hierarchical all-reduce,
        compressed across nodes only; the residuals are ``P((outer, inner))``.
      compressor: a qcollect `Compressor`, or ``f(path, leaf) -> Compressor |
        None`` per leaf (None: uncompressed); leaves of equal ones are fused.
      key: PRNG key for stochastic compressors (the same on every device).
      mean: average over devices (default) rather than sum.
      error_feedback: `transforms.residual_feedback()` (default), `transforms.ef21`
        or None (docs/transforms.md, "Error feedback: residual or EF21"); True,
        False, ``"residual"``, ``"none"``, ``"ef21"`` and ``ef21_momentum``
        are deprecated spellings (DeprecationWarning).
      ef21_momentum: deprecated: ``error_feedback=transforms.ef21(momentum=eta)``.
      mask_zero_rows: rows (first-axis slices) of the compressed leaves whose
        gradient is zero on every device get a zero update and keep their
        error-feedback state; one more all-reduce, of a uint8 per row.
      algorithm: ``"auto"``, ``"ring"``, ``"pairwise"`` (also keeps the
        owner's re-encoding error) or ``"ring_requantize"`` (not with EF21).
      min_size: leaves with fewer values go uncompressed (Grubic 3.2.2).
      compress_if: optional predicate ``(path, leaf) -> bool``; to give other
        leaves another transformation, use ``optax.partition``.
      fuse: let leaves of one compressor share collectives (per dtype).
      bucket_bytes: cap of a fused segment (default 4 MiB); None: no cap.
      pipeline: pieces per device's chunk, each with its own collectives (1).
      batch_buckets: which classes of equal buckets run as one batch
        (`qcollect.runs_batched`): ``"auto"`` (default), ``"always"``,
        ``"never"`` or an int ``K`` (batch classes of more than ``K``).
      exchange: ``"permute"`` (default) or ``"all_to_all"``: how the
        pairwise and ring algorithms move payloads to their owners.
      block_specs: on a mesh with model axes, how they shard each leaf (a
        ``PartitionSpec``, a pytree of them or ``f(path, leaf)``; default: the
        gradients' types; docs/transforms.md, "Meshes with model axes").
      compress_after: exact steps first, an int ``K`` or a `transforms.CompressAfter`
        (default 0; Tang et al. 2021, section 3; the same value suits
        `transforms.frozen_adamw`), residuals untouched (EF21: ``g_i``, ``g``
        set from it); phases ``"exact"`` and ``"compressed"``.

    Returns:
      An ``optax.GradientTransformation``; ``update(grads, state, params=None)``.

    Raises:
      ValueError: a setting out of range (naming it); invariant gradients.

    References:
      Seide et al., INTERSPEECH 2014; Grubic et al., EDBT 2018, Algorithm 2;
      Dryden et al., MLHPC 2016, section 3.4 (links in the module's docstring);
      EF21, EF21-SGDM and 1-bit Adam's masks: `transforms._ef21`.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc, transforms
      >>> tx = transforms.compressed_all_reduce("data", compressor=qc.qsgd(bits=4),
      ...                                       key=jax.random.key(0))
      >>> tx.init({"w": jnp.zeros((4, 4)), "b": jnp.zeros(4)}).feedback.residual["w"].shape
      (4, 4)
    """
    settings = _validated(
        axis_name, compressor=compressor, mean=mean, error_feedback=error_feedback,
        ef21_momentum=ef21_momentum, mask_zero_rows=mask_zero_rows, algorithm=algorithm,
        min_size=min_size, compress_if=compress_if, fuse=fuse, bucket_bytes=bucket_bytes,
        pipeline=pipeline, batch_buckets=batch_buckets, exchange=exchange,
        block_specs=block_specs, compress_after=compress_after)
    return optax.GradientTransformation(
        functools.partial(_init, key=check_key("key", key), settings=settings),
        functools.partial(_update, settings=settings))


def _validated(axis_name: AxisName, *, compressor: CompressorSpec, mean: bool,
               error_feedback: Feedback | bool | str, ef21_momentum: float | None,
               mask_zero_rows: bool, algorithm: qc.Algorithm, min_size: int,
               compress_if: LeafPredicate | None, fuse: bool, bucket_bytes: int | None,
               pipeline: int, batch_buckets: qc.BatchBuckets, exchange: qc.Exchange,
               block_specs: BlockSpecs, compress_after: int | CompressAfter) -> _Settings:
    """The settings of `compressed_all_reduce`, checked; ValueError naming the first bad one."""
    algorithm = check_choice("algorithm", algorithm, get_args(qc.Algorithm))
    feedback = feedback_from(error_feedback, ef21_momentum)
    feedback.check(algorithm)
    schedule = as_schedule(compress_after)
    if schedule.warm_up is not None and isinstance(feedback, EF21):
        raise ValueError("compress_after with a warm_up compressor needs the residual error "
                         "feedback: EF21's first steps set each device's estimate to its exact "
                         "gradient")
    bucket_bytes = check_int("bucket_bytes", bucket_bytes, low=0, allow_none=True)
    qc.runs_batched(1, 0, batch_buckets)  # ValueError naming batch_buckets
    exchange = check_choice("exchange", exchange, get_args(qc.Exchange))
    return _Settings(
        axis_name=axis_name, compressor=check_compressor("compressor", compressor),
        mean=mean, feedback=feedback, algorithm=algorithm,
        min_size=check_int("min_size", min_size, low=0), compress_if=compress_if, fuse=fuse,
        bucket_bytes=bucket_bytes, pipeline=check_int("pipeline", pipeline),
        batch_buckets=batch_buckets, exchange=exchange, block_specs=block_specs,
        compress_after=schedule,
        mask_zero_rows=check_choice("mask_zero_rows", mask_zero_rows, (False, True)))


def _init(params: optax.Params, *, key: jax.Array,
          settings: _Settings) -> CompressedAllReduceState:
    return CompressedAllReduceState(
        feedback=settings.feedback.init(params, settings.compressors(params),
                                        settings.algorithm),
        key=key, count=jnp.zeros([], jnp.int32))


#: How a state field names one entry and itself in errors.
_NAMES = {"residual": ("the error-feedback residual", "error-feedback residuals"),
          "owner_residual": ("the owner residual", "owner residuals"),
          "local_estimate": ("the EF21 local estimate", "EF21 local estimates"),
          "estimate": ("the EF21 estimate", "EF21 estimates"),
          "momentum": ("the EF21 momentum", "EF21 momenta")}


def _read(grads: optax.Updates, feedback: ResidualState | EF21State, want: type[Any],
          axis_name: AxisName) -> tuple[list[list[Any]], Any]:
    """The strategy's state at the leaves of ``grads``: each field's entries
    as stored, and a state of the same type holding this device's values.

    Raises:
      ValueError: the state is another strategy's (``want`` is the type this
        transformation's strategy keeps).
    """
    if not isinstance(feedback, want):
        raise ValueError(
            f"the state's error feedback is of type {type(feedback).__name__}, but this "
            f"transformation keeps a {want.__name__}: the state was made by a "
            "compressed_all_reduce with another error_feedback (restore it into a target made "
            "by the same transformation)")
    per_device = type(feedback).per_device_fields
    read = [read_per_device(grads, getattr(feedback, name), axis_name, _NAMES[name][0],
                            field_name=_NAMES[name][1], replicated=name not in per_device)
            for name in feedback._fields]
    return [stored for stored, _ in read], type(feedback)(*(values for _, values in read))


def _update(grads: optax.Updates, state: CompressedAllReduceState,
            params: optax.Params | None = None, *,
            settings: _Settings) -> tuple[optax.Updates, CompressedAllReduceState]:
    """One step: the reduced update (mean or sum over devices) and the next state.

    With ``compress_after=K`` the schedule picks the phase from the step
    count in a ``lax.cond`` (the same branch on every device): the exact
    mean of the gradients (``"exact"``) or the compressed step
    (``"compressed"``).
    """
    del params
    check_local_gradients(grads, settings.axis_name)
    leaves, treedef = jax.tree.flatten(grads)
    stored, memory = _read(grads, state.feedback, settings.feedback.state, settings.axis_name)
    exact_step, step = settings.feedback.steps(_context(settings, grads))
    if settings.compress_after.warm_up is not None:
        exact_step = functools.partial(_lead_in_step, settings=settings,
                                       comps=settings.compressors(grads),
                                       blocks=settings.leaf_block_specs(grads))
    if settings.compress_after.steps == 0:
        out, new = step(leaves, memory, state.key, state.count)
    else:
        def exact(*args: Any) -> _Step:
            with qc.phase(settings.compress_after.first):
                return exact_step(*args)

        def compressed(*args: Any) -> _Step:
            with qc.phase(COMPRESSED):
                return step(*args)

        out, new = lax.cond(settings.compress_after.at(state.count), exact, compressed,
                            leaves, memory, state.key, state.count)
    # Non-finite anywhere makes the reduced update non-finite everywhere,
    # so this flag agrees across devices without another collective.
    finite = all_finite(out)
    kept = [treedef.unflatten(kept_per_device(n, o, s, finite))
            for n, o, s in zip(new, memory, stored, strict=True)]
    return treedef.unflatten(out), CompressedAllReduceState(
        feedback=type(memory)(*kept), key=state.key,
        count=optax.safe_int32_increment(state.count))


#: ``(updates, error-feedback state of lists)`` of one step, leaf by leaf.
_Step = tuple[list[jax.Array], Any]


def _lead_in_step(leaves: list[jax.Array], memory: Any, key: jax.Array, count: jax.Array, *,
                  settings: _Settings, comps: list[qc.Compressor | None],
                  blocks: list[P] | None) -> _Step:
    """The first steps through the warm-up compressor of ``compress_after``:
    the leaves that are compressed later go through it together (no error
    feedback: the state is untouched, as in the exact steps), the others
    exactly; the updates in the gradients' dtypes."""
    s = settings
    compressed = [c is not None for c in comps]
    out = sum_uncompressed(leaves, compressed, s.axis_name, mean=s.mean, block_specs=blocks)
    which = [i for i, c in enumerate(compressed) if c]
    if which:
        result = qc.compressed_all_reduce(
            [leaves[i].astype(jnp.float32) for i in which], s.axis_name,
            s.compress_after.warm_up, jax.random.fold_in(key, count),
            mean=s.mean, fuse=s.fuse, bucket_bytes=s.bucket_bytes,
            batch_buckets=s.batch_buckets, exchange=s.exchange,
            block_specs=None if blocks is None else [blocks[i] for i in which])
        for j, i in enumerate(which):
            out[i] = result.value[j]
    return [o.astype(g.dtype) for o, g in zip(out, leaves, strict=True)], memory


def _context(settings: _Settings, grads: optax.Updates) -> Context:
    """What the strategy's steps work with, for gradients like ``grads``."""
    comps, blocks = settings.compressors(grads), settings.leaf_block_specs(grads)

    def reduce(inputs: list[Any], owners: list[Any], step_key: jax.Array) -> dict[int, Reduced]:
        return _reduce_compressed(inputs, comps, owners, step_key, settings, blocks)

    return Context(comps=comps, axis_name=settings.axis_name, mean=settings.mean,
                   blocks=blocks, mask=settings.mask_zero_rows, reduce=reduce)


def _reduce_compressed(inputs: list[jax.Array], comps: list[qc.Compressor | None],
                       owners: list[jax.Array | None], step_key: jax.Array,
                       settings: _Settings, blocks: list[P] | None) -> dict[int, Reduced]:
    """The compressed leaves summed, one `qcollect.compressed_all_reduce` per
    group of equal compressors (group ``g`` draws ``fold_in(step_key, g)``).

    Returns:
      ``{i: Reduced(value, contributed, owner_error)}`` per compressed leaf
      ``i``: the reduced value, what this device's encodings decode to and
      the owner's re-encoding error (None unless `_Settings.keeps_owner`).
    """
    s = settings
    reduced = {}
    for g, (compressor, members) in enumerate(group_indices(comps).items()):
        xs = [inputs[i].astype(jnp.float32) for i in members]
        owner_in = [owners[i] for i in members] if s.keeps_owner(compressor) else None
        result = qc.compressed_all_reduce(
            xs, s.axis_name, compressor, jax.random.fold_in(step_key, g),
            algorithm=s.algorithm, mean=s.mean, fuse=s.fuse, bucket_bytes=s.bucket_bytes,
            pipeline=s.pipeline, owner_residual=owner_in, batch_buckets=s.batch_buckets,
            exchange=s.exchange,
            block_specs=None if blocks is None else [blocks[i] for i in members])
        for j, i in enumerate(members):
            owner_error = result.owner_error[j] if owner_in is not None else None
            reduced[i] = Reduced(result.value[j], result.contributed[j], owner_error)
    return reduced
