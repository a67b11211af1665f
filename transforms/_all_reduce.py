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

``error_feedback="ef21"`` keeps EF21's estimates instead (and with
``ef21_momentum`` EF21-SGDM's momentum); ``mask_zero_rows`` gives rows
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
from collections.abc import Callable
from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import qcollect as qc
from qcollect.checks import check_choice, check_int, check_key
from transforms._axes import AxisName, check_local_gradients
from transforms._ef21 import (
    ErrorFeedback,
    Memory,
    Reduced,
    check_error_feedback,
    ef21_compressed,
    ef21_exact,
    live_rows,
    masked,
    owner_kept,
    where_live,
)
from transforms._finite import all_finite
from transforms._phases import COMPRESSED, WARM_UP
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


@per_device("residual", "owner_residual", "momentum")
class CompressedAllReduceState(NamedTuple):
    """State of `compressed_all_reduce`.

    Attributes:
      residual: per device (``P(axis_name)``, see `transforms.state_specs`):
        float32 tree like the gradients, what error feedback still owes,
        ``input - contributed`` (Seide; Grubic Alg. 2 line 4); under
        ``error_feedback="ef21"`` this device's estimate ``g_i`` of its own
        gradient (EF21 Algorithm 1). Leaves that are not compressed, or all
        of them without error feedback, are ``optax.MaskedNode()``.
      owner_residual: per device: with ``algorithm="pairwise"`` (under EF21
        also ``"auto"`` with a non-linear compressor), the owner's
        re-encoding error (two-level error feedback, as DeepSpeed's server
        error); else ``optax.MaskedNode()`` leaves.
      key: PRNG key (replicated); step ``t`` uses ``fold_in(key, t)``, then
        the collective folds in the device index.
      count: int32 step count (replicated).
      estimate: replicated (``P()``): under EF21 the float32 estimate ``g``
        (the update, in its units: the mean or the sum); else
        ``optax.MaskedNode()`` leaves.
      momentum: per device: with ``ef21_momentum``, EF21-SGDM's float32
        ``v_i``; else ``optax.MaskedNode()`` leaves.
    """

    residual: Any
    owner_residual: Any
    key: jax.Array
    count: jax.Array
    estimate: Any
    momentum: Any


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The validated static settings of one `compressed_all_reduce` transformation."""

    axis_name: AxisName
    compressor: CompressorSpec
    mean: bool
    error_feedback: str   # "residual", "none" or "ef21"
    algorithm: qc.Algorithm
    min_size: int
    compress_if: LeafPredicate | None
    fuse: bool
    bucket_bytes: int | None
    pipeline: int
    batch_buckets: qc.BatchBuckets
    exchange: qc.Exchange
    block_specs: BlockSpecs = None
    compress_after: int = 0
    ef21_momentum: float | None = None
    mask_zero_rows: bool = False

    def leaf_block_specs(self, tree: Any) -> list[P] | None:
        """Each leaf's block spec (flatten order), or None: read from the types."""
        if self.block_specs is None:
            return None
        return jax.tree.leaves(qc.block_spec_tree(tree, self.block_specs),
                               is_leaf=lambda s: isinstance(s, P))

    def keeps_owner(self, compressor: qc.Compressor) -> bool:
        """Whether leaves of ``compressor`` keep the owner's re-encoding error."""
        return owner_kept(self.error_feedback, self.algorithm, compressor)

    def compressors(self, tree: Any) -> list[qc.Compressor | None]:
        """Each leaf's compressor (flatten order), None for the uncompressed ones."""
        return leaf_compressors(tree, self.compressor, min_size=self.min_size,
                                compress_if=self.compress_if)


def compressed_all_reduce(axis_name: AxisName, *, compressor: CompressorSpec, key: jax.Array,
                          mean: bool = True, error_feedback: ErrorFeedback = True,
                          ef21_momentum: float | None = None, mask_zero_rows: bool = False,
                          algorithm: qc.Algorithm = "auto", min_size: int = 0,
                          compress_if: LeafPredicate | None = None, fuse: bool = True,
                          bucket_bytes: int | None = qc.BUCKET_BYTES, pipeline: int = 1,
                          batch_buckets: qc.BatchBuckets = qc.BATCH_BUCKETS,
                          exchange: qc.Exchange = "permute", block_specs: BlockSpecs = None,
                          compress_after: int = 0) -> optax.GradientTransformation:
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
      error_feedback: True or ``"residual"`` (default, the residual above),
        False or ``"none"``, or ``"ef21"``: EF21's estimates, the update their
        mean (docs/transforms.md, "Error feedback: residual or EF21").
      ef21_momentum: EF21-SGDM's ``eta`` in ``(0, 1]``; needs ``"ef21"``.
      mask_zero_rows: rows (first-axis slices) of the compressed leaves whose
        gradient is zero on every device get a zero update and keep their
        error-feedback state; one more all-reduce, of a uint8 per row.
      algorithm: ``"auto"``, ``"ring"``, ``"pairwise"`` (also keeps the
        owner's re-encoding error) or ``"ring_requantize"`` (not with EF21).
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
      block_specs: on a mesh with model axes, how they shard each leaf (a
        ``PartitionSpec``, a pytree of them or ``f(path, leaf)``; default: the
        gradients' types; docs/transforms.md, "Meshes with model axes").
      compress_after: steps that send the exact mean first (default 0; 1-bit
        Adam's warm-up, Tang et al. 2021, section 3), residuals untouched (EF21:
        ``g_i``, ``g`` set from it); phases ``"warm-up"`` and ``"compressed"``
        (`qcollect.wire_bytes_by_phase`, `transforms.warm_up_phases`).

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
      >>> tx.init({"w": jnp.zeros((4, 4)), "b": jnp.zeros(4)}).residual["w"].shape
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
               error_feedback: ErrorFeedback, ef21_momentum: float | None,
               mask_zero_rows: bool, algorithm: qc.Algorithm, min_size: int,
               compress_if: LeafPredicate | None, fuse: bool, bucket_bytes: int | None,
               pipeline: int, batch_buckets: qc.BatchBuckets, exchange: qc.Exchange,
               block_specs: BlockSpecs, compress_after: int) -> _Settings:
    """The settings of `compressed_all_reduce`, checked; ValueError naming the first bad one."""
    algorithm = check_choice("algorithm", algorithm, get_args(qc.Algorithm))
    mode, eta = check_error_feedback(error_feedback, ef21_momentum, algorithm=algorithm)
    bucket_bytes = check_int("bucket_bytes", bucket_bytes, low=0, allow_none=True)
    qc.runs_batched(1, 0, batch_buckets)  # ValueError naming batch_buckets
    exchange = check_choice("exchange", exchange, get_args(qc.Exchange))
    return _Settings(
        axis_name=axis_name, compressor=check_compressor("compressor", compressor),
        mean=mean, error_feedback=mode, algorithm=algorithm,
        min_size=check_int("min_size", min_size, low=0), compress_if=compress_if, fuse=fuse,
        bucket_bytes=bucket_bytes, pipeline=check_int("pipeline", pipeline),
        batch_buckets=batch_buckets, exchange=exchange, block_specs=block_specs,
        compress_after=check_int("compress_after", compress_after, low=0),
        ef21_momentum=eta,
        mask_zero_rows=check_choice("mask_zero_rows", mask_zero_rows, (False, True)))


def _init(params: optax.Params, *, key: jax.Array,
          settings: _Settings) -> CompressedAllReduceState:
    leaves, treedef = jax.tree.flatten(params)
    comps = settings.compressors(params)

    def field(keep: Callable[[qc.Compressor], bool]) -> Any:
        return treedef.unflatten([zeros_or_masked(leaf, c is not None and keep(c))
                                  for leaf, c in zip(leaves, comps, strict=True)])

    mode = settings.error_feedback
    return CompressedAllReduceState(
        residual=field(lambda c: mode != "none"),
        owner_residual=field(settings.keeps_owner),
        key=key,
        count=jnp.zeros([], jnp.int32),
        estimate=field(lambda c: mode == "ef21"),
        momentum=field(lambda c: settings.ef21_momentum is not None))


def _read(grads: optax.Updates, state: CompressedAllReduceState,
          axis_name: AxisName) -> tuple[list[list[Any]], Memory]:
    """The state's error-feedback fields at the leaves of ``grads``: their
    entries as stored (`Memory` order) and this device's values."""
    fields = [("residual", "the error-feedback residual", "error-feedback residuals"),
              ("owner_residual", "the owner residual", "owner residuals"),
              ("estimate", "the EF21 estimate", "EF21 estimates"),   # replicated
              ("momentum", "the EF21 momentum", "EF21 momenta")]
    per_device = CompressedAllReduceState.per_device_fields  # type: ignore[attr-defined]
    read = [read_per_device(grads, getattr(state, attr), axis_name, what, field_name=name,
                            replicated=attr not in per_device)
            for attr, what, name in fields]
    return [stored for stored, _ in read], Memory(*(values for _, values in read))


def _update(grads: optax.Updates, state: CompressedAllReduceState,
            params: optax.Params | None = None, *,
            settings: _Settings) -> tuple[optax.Updates, CompressedAllReduceState]:
    """One step: the reduced update (mean or sum over devices) and the next state.

    With ``compress_after=K`` the step count picks the phase in a
    ``lax.cond`` (the same branch on every device): the exact mean of the
    gradients (``"warm-up"``) or the compressed step (``"compressed"``).
    """
    del params
    check_local_gradients(grads, settings.axis_name)
    leaves, treedef = jax.tree.flatten(grads)
    stored, memory = _read(grads, state, settings.axis_name)
    exact_step, step = _steps(settings, settings.compressors(grads),
                              settings.leaf_block_specs(grads))
    if settings.compress_after == 0:
        out, new = step(leaves, memory, state.key, state.count)
    else:
        def exact(*args: Any) -> _Step:
            with qc.phase(WARM_UP):
                return exact_step(*args)

        def compressed(*args: Any) -> _Step:
            with qc.phase(COMPRESSED):
                return step(*args)

        out, new = lax.cond(state.count < settings.compress_after, exact, compressed,
                            leaves, memory, state.key, state.count)
    # Non-finite anywhere makes the reduced update non-finite everywhere,
    # so this flag agrees across devices without another collective.
    finite = all_finite(out)
    kept = [treedef.unflatten(kept_per_device(n, o, s, finite))
            for n, o, s in zip(new, memory, stored, strict=True)]
    return treedef.unflatten(out), CompressedAllReduceState(
        residual=kept[0], owner_residual=kept[1], key=state.key,
        count=optax.safe_int32_increment(state.count), estimate=kept[2], momentum=kept[3])


#: ``(updates, error-feedback memory)`` of one step, leaf by leaf.
_Step = tuple[list[jax.Array], Memory]


def _steps(settings: _Settings, comps: list[qc.Compressor | None],
           blocks: list[P] | None) -> tuple[Callable[..., _Step], Callable[..., _Step]]:
    """``(exact, compressed)``: the warm-up and the compressed step of
    ``settings``' error feedback, each ``(leaves, memory, key, count) -> _Step``."""
    if settings.error_feedback != "ef21":
        return (functools.partial(_exact_step, settings=settings, blocks=blocks),
                functools.partial(_compressed_step, comps=comps, settings=settings,
                                  blocks=blocks))

    def reduce(inputs: list[Any], owners: list[Any], step_key: jax.Array) -> dict[int, Reduced]:
        return _reduce_compressed(inputs, comps, owners, step_key, settings, blocks)

    common: dict[str, Any] = dict(comps=comps, axis_name=settings.axis_name,
                                  mean=settings.mean, eta=settings.ef21_momentum, blocks=blocks)
    return (functools.partial(ef21_exact, **common),
            functools.partial(ef21_compressed, mask=settings.mask_zero_rows, reduce=reduce,
                              **common))


def _exact_step(leaves: list[jax.Array], memory: Memory, key: jax.Array, count: jax.Array, *,
                settings: _Settings, blocks: list[P] | None) -> _Step:
    """The warm-up: every leaf's exact mean (or sum) in its own dtype; the
    residuals untouched."""
    out = sum_uncompressed(leaves, [False] * len(leaves), settings.axis_name,
                           mean=settings.mean, block_specs=blocks)
    return [o.astype(g.dtype) for o, g in zip(out, leaves, strict=True)], memory


def _compressed_step(leaves: list[jax.Array], memory: Memory, key: jax.Array,
                     count: jax.Array, *, comps: list[qc.Compressor | None],
                     settings: _Settings, blocks: list[P] | None) -> _Step:
    """The compressed leaves through their compressors with the classic
    residual (or none), the others summed exactly; the updates in the
    gradients' dtypes. With ``mask_zero_rows`` the dead rows go as zeros,
    come back as zeros and keep their residuals."""
    live = (live_rows(leaves, comps, settings.axis_name) if settings.mask_zero_rows
            else [None] * len(leaves))
    inputs = [leaf if r is None else leaf.astype(jnp.float32) + r
              for leaf, r in zip(leaves, memory.residual, strict=True)]
    inputs = [x if c is None else masked(lv, x)
              for x, c, lv in zip(inputs, comps, live, strict=True)]
    owners = [masked(lv, o) for lv, o in zip(live, memory.owner, strict=True)]
    out = sum_uncompressed(inputs, [c is not None for c in comps], settings.axis_name,
                           mean=settings.mean, block_specs=blocks)
    new_residuals, new_owners = list(memory.residual), list(memory.owner)
    step_key = jax.random.fold_in(key, count)
    for i, r in _reduce_compressed(inputs, comps, owners, step_key, settings, blocks).items():
        out[i] = masked(live[i], r.value)
        if r.residual is not None:
            new_residuals[i] = where_live(live[i], r.residual, memory.residual[i])
        if r.owner_error is not None:
            new_owners[i] = where_live(live[i], r.owner_error, memory.owner[i])
    return [o.astype(leaf.dtype) for o, leaf in zip(out, leaves, strict=True)], \
        memory._replace(residual=new_residuals, owner=new_owners)


def _reduce_compressed(inputs: list[jax.Array], comps: list[qc.Compressor | None],
                       owners: list[jax.Array | None], step_key: jax.Array,
                       settings: _Settings, blocks: list[P] | None) -> dict[int, Reduced]:
    """The compressed leaves summed, one `qcollect.compressed_all_reduce` per
    group of equal compressors (group ``g`` draws ``fold_in(step_key, g)``).

    Returns:
      ``{i: Reduced(value, contributed, residual, owner_error)}`` per
      compressed leaf ``i``: the reduced value, what this device's encodings
      decode to, ``input - contributed`` (float32; None unless the classic
      residual is kept) and the owner's re-encoding error (None unless
      `_Settings.keeps_owner`).
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
            residual = (xs[j] - result.contributed[j].astype(jnp.float32)
                        if s.error_feedback == "residual" else None)
            owner_error = result.owner_error[j] if owner_in is not None else None
            reduced[i] = Reduced(result.value[j], result.contributed[j], residual, owner_error)
    return reduced
