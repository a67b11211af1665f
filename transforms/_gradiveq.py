"""`gradiveq`: GradiVeQ's schedule of sampled, PCA-fitted and compressed steps.

Yu et al., "GradiVeQ: Vector Quantization for Bandwidth-Efficient Gradient
Aggregation in Distributed CNN Training" (NeurIPS 2018), sections 2 and 3.

The step count picks the phase (`GradiVeQCycle`; its spans: `gradiveq_phases`),
so every device takes the same branch (`lax.cond`, collectives inside the
branches):

* lead-in (phase ``"lead-in"``), ``t < warmup_steps``: the compressed leaves
  are summed through ``sample_compressor`` (`qcollect.compressed_all_reduce`, by default QSGD-4
  with the pairwise algorithm, section 3: "we will apply a scalar
  quantization technique such as QSGD to these iterations"), or exactly
  (``lax.psum``) when it is None.
* then cycles of ``L_t + L_c`` steps. The first ``L_t = sample_steps``
  aggregate like the warm-up and store ``s = sample_slices`` evenly spaced
  ``K``-value slices of every compressed leaf's aggregated sum in a static
  ``(L_t, s * K)`` buffer; ``s = 1`` is the paper's first slice and
  compressor reuse factor ``s = inf``, more slices are pooled into the same
  fit. At the end of the ``L_t``-th step `qcollect.pca_fit` turns the buffer
  into ``U_d`` and ``mu`` per leaf (eq. 6). The fit reads aggregated data
  only, so it is identical on all devices without communication.
* the next ``L_c = compressed_steps`` steps send every slice as
  ``U_d^T (g - mu / N)`` (eq. 3) through the compressed-domain ring of
  Algorithm 1 (`qcollect.compressed_all_reduce` with `qcollect.pca`,
  ``algorithm="ring"``) and decode once (eq. 4-5). Then the next cycle
  samples again and refreshes the compressors.
* optional stop-early (section 3, "Number of compressed iterations"): with
  ``stop_loss`` each device computes its local compression loss, eq. (7)
  ``||g_n - (U_d g'_n + mu / N)||^2`` summed over the compressed leaves,
  relative to ``||g_n||^2``; if more than half of the devices exceed
  ``stop_loss`` (one ``lax.psum`` of the votes), the compressed phase ends
  and the next step starts a new cycle with sampling.

Static rank: with ``rank=d`` the basis has ``d`` columns. With
``loss_threshold=lambda``, eq. (6) picks the smallest ``d`` whose explained
energy reaches ``1 - lambda``; the shapes cannot depend on it, so the basis
has ``r = min(max_rank, K)`` columns of which ``d..r-1`` are zero. The wire
always carries ``r`` float32 coefficients per slice (compression ``K / r``);
the accuracy is that of ``d`` (zero columns send zeros). If ``d > r`` the
fit keeps ``r`` columns and loses more than ``lambda``; ``state.rank`` still
reports ``d``, and error feedback keeps what is lost.

Error feedback (``input = g + residual``, ``residual = input -
contributed``, float32) runs in all phases; in the compressed phase the
residual is this device's local compression loss, the vector whose norm is
eq. (7). Leaves with fewer than ``max(min_size, K)`` values, or failing
``compress_if`` (default: at least 2 dimensions, i.e. conv and dense
kernels; section 2, footnote 3 keeps biases out), are averaged exactly
(``qc.fused_psum``) every step. The update is the mean (or sum) over devices.

The ring cuts each leaf into ``N`` chunks of whole slices
(`qcollect.compressed_all_reduce` never splits a slice or lets one span two
leaves): the leaf is zero-padded to whole slices (a last partial slice is
compressed with zeros after it) and to a multiple of ``N`` slices, so a leaf
with fewer than ``N`` slices also sends ``d`` coefficients for each zero
slice of padding.

Flattening: Flax kernels ``(H, W, D, F)`` and ``(in, out)`` flatten
row-major with ``F`` (``out``) innermost, Fig. 3a's order; pick ``K`` a
multiple of ``F * D`` (section 3, "Slice size K").

Non-finite gradients: the reduced update is then non-finite on every device
(both aggregations propagate NaN/Inf), and that is what the step decides on,
so all devices agree. Such a step keeps the residuals, writes no sample (its
slot is marked invalid in ``state.valid``) and leaves basis and mean alone;
the count still advances. At a fit, invalid slots are filled with copies of
the cycle's valid samples; with none at all the previous compressors are
kept. The non-finite update is passed on: chain ``optax.apply_if_finite``
after this transformation to skip it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import qcollect as qc
from qcollect.checks import check_choice, check_float, check_int, check_key
from transforms._axes import AxisName, check_local_gradients
from transforms._blocks import leaves_like
from transforms._feedback import ResidualFeedback, keeps_residual, residual_feedback
from transforms._finite import all_finite
from transforms._gradiveq_cycle import GradiVeQCycle, LeafPlan, refreshed
from transforms._gradiveq_sums import aggregate
from transforms._placement import per_device
from transforms._policy import LeafPredicate, check_compressor, leaf_choices, sum_uncompressed
from transforms._residual import add_residual, residual_of
from transforms._state import (
    check_entries,
    kept_per_device,
    leaf_paths,
    read_per_device,
    zeros_or_masked,
)

#: Default compressor of the warm-up and sampling steps (section 3: QSGD).
_QSGD4 = qc.qsgd(bits=4)

#: ``K`` for every leaf, or ``f(path, leaf) -> K | None`` per leaf (None: uncompressed).
SliceSize = int | Callable[[Any, Any], int | None]

#: The fields of `GradiVeQState` with one entry per leaf.
_PER_LEAF = ("residual", "samples", "basis", "mean", "rank")


@per_device("residual")
class GradiVeQState(NamedTuple):
    """State of `gradiveq`.

    Leaves that are not compressed are ``optax.MaskedNode()`` in every
    per-leaf field. Only ``residual`` differs per device (``P(axis_name)``,
    see `transforms.state_specs`); every other field is computed from
    aggregated data and is the same on every device.

    Attributes:
      residual: per device: float32 tree like the gradients, what error
        feedback still owes, ``input - contributed`` (``MaskedNode`` without
        error feedback).
      samples: per compressed leaf, float32 ``(L_t, s * K)``: slot ``i`` holds
        the ``s`` sampled slices of the aggregated (summed over devices)
        gradient of the ``i``-th sampling step of the current cycle.
      valid: bool ``(L_t,)``: which slots hold a sample of this cycle (a step
        with non-finite gradients writes none).
      basis: per compressed leaf, float32 ``(K, r)``: ``U_d`` with ``r`` static
        columns; columns ``d..r-1`` are zero. All zero before the first fit.
      mean: per compressed leaf, float32 ``(K,)``: the whitening vector ``mu``.
      rank: per compressed leaf, int32 scalar: ``d`` of eq. (6) (or the fixed
        rank); 0 before the first fit.
      key: PRNG key; step ``t`` uses ``fold_in(key, t)``.
      count: int32 step count.
      cycle_start: int32 step at which the current cycle began (``warmup_steps``,
        then every ``L_t + L_c`` steps, or the step after a stop-early vote).
        The phase is ``(count - cycle_start) mod (L_t + L_c)`` compared with
        ``L_t``: values equal on all devices.
    """

    residual: Any
    samples: Any
    valid: jax.Array
    basis: Any
    mean: Any
    rank: Any
    key: jax.Array
    count: jax.Array
    cycle_start: jax.Array


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The validated static settings of one `gradiveq` transformation."""

    axis_name: AxisName
    slice_size: SliceSize
    rank: int | None
    loss_threshold: float | None
    max_rank: int | None
    schedule: GradiVeQCycle
    sample_slices: int
    min_size: int
    compress_if: LeafPredicate | None
    sample_compressor: qc.Compressor | None
    sample_algorithm: qc.Algorithm
    stop_loss: float | None
    mean: bool
    error_feedback: bool
    batch_buckets: qc.BatchBuckets


def gradiveq(axis_name: AxisName, *, key: jax.Array, slice_size: SliceSize,
             loss_threshold: float | None = None, rank: int | None = None,
             max_rank: int | None = None, warmup_steps: int = 0, sample_steps: int = 100,
             compressed_steps: int = 400, sample_slices: int = 1, min_size: int = 0,
             compress_if: LeafPredicate | None = None,
             sample_compressor: qc.Compressor | None = _QSGD4,
             sample_algorithm: qc.Algorithm = "auto", stop_loss: float | None = None,
             mean: bool = True,
             error_feedback: ResidualFeedback | None = residual_feedback(),
             batch_buckets: qc.BatchBuckets = qc.BATCH_BUCKETS) -> optax.GradientTransformation:
    """GradiVeQ: PCA compressors fitted on aggregated gradients, summed on a ring.

    ``warmup_steps`` steps through ``sample_compressor``, then cycles of
    ``sample_steps`` such steps that sample the aggregated gradients and fit a
    PCA compressor per leaf (eq. 6), and ``compressed_steps`` steps through
    those compressors on the compressed-domain ring (Algorithm 1), with error
    feedback throughout. docs/transforms.md ("GradiVeQ and PowerSGD") has
    the details.

    Args:
      axis_name: the data-parallel axis (``shard_map`` or ``pmap``).
      key: PRNG key for the sample compressor (the same on every device).
      slice_size: ``K >= 1``, values per slice, or ``f(path, leaf) -> K | None``
        per leaf (None: uncompressed).
      loss_threshold: ``lambda`` in [0, 1) of eq. (6); needs ``max_rank``.
        Exactly one of ``loss_threshold`` and ``rank``.
      rank: a fixed ``d >= 1`` (at most every compressed leaf's ``K``).
      max_rank: with ``loss_threshold``: static cap ``r >= 1`` on basis columns.
      warmup_steps: steps before the first cycle, ``>= 0``.
      sample_steps: ``L_t >= 1``, sampling steps per cycle.
      compressed_steps: ``L_c >= 1``, compressed steps per cycle.
      sample_slices: slices sampled per leaf and step, ``>= 1``.
      min_size: leaves with fewer values go uncompressed, ``>= 0``.
      compress_if: predicate ``(path, leaf) -> bool``; default ``leaf.ndim >= 2``.
      sample_compressor: a qcollect `Compressor` for warm-up and sampling
        steps, or None for exact sums.
      sample_algorithm: its `qcollect.compressed_all_reduce` algorithm.
      stop_loss: None, or a relative local compression loss (eq. 7) in
        (0, inf) above which a device votes to end the compressed phase.
      mean: average over devices (default) rather than sum.
      error_feedback: `transforms.residual_feedback()` (default: keep
        residuals) or None (True and False are deprecated spellings).
      batch_buckets: which classes of equal leaves or buckets run as one
        batch (`qcollect.runs_batched`): ``"auto"`` (default), ``"always"``,
        ``"never"`` or an int ``K`` (batch classes of more than ``K``).

    Returns:
      An ``optax.GradientTransformation``; its state is a `GradiVeQState`.

    Raises:
      ValueError: a setting out of its range (naming it). ``update`` raises
        ValueError (at trace time) on gradients that are not the tree ``init``
        saw, naming the first differing leaf path, or whose leaf has another
        shape, naming it and both shapes.

    References:
      Yu et al., `GradiVeQ: Vector Quantization for Bandwidth-Efficient
      Gradient Aggregation in Distributed CNN Training
      <https://arxiv.org/abs/1811.03617>`_, NeurIPS 2018, section 2
      (eq. 2-5, Algorithm 1) and section 3 ("System Overview", eq. 6,
      eq. 7, Fig. 6).

    Example:
      >>> import jax, optax, transforms
      >>> tx = optax.chain(
      ...     transforms.gradiveq("data", key=jax.random.key(0), slice_size=64,
      ...                         loss_threshold=0.05, max_rank=8, warmup_steps=10,
      ...                         sample_steps=20, compressed_steps=80),
      ...     optax.adam(1e-3))
    """
    settings = _validated(
        axis_name, slice_size=slice_size, loss_threshold=loss_threshold, rank=rank,
        max_rank=max_rank, schedule=(warmup_steps, sample_steps, compressed_steps),
        sample_slices=sample_slices, min_size=min_size, compress_if=compress_if,
        sample_compressor=sample_compressor, sample_algorithm=sample_algorithm,
        stop_loss=stop_loss, mean=mean, error_feedback=error_feedback,
        batch_buckets=batch_buckets)
    key = check_key("key", key)
    return optax.GradientTransformation(functools.partial(_init, key=key, settings=settings),
                                        functools.partial(_update, settings=settings))


def _validated(axis_name: AxisName, *, slice_size: SliceSize, loss_threshold: float | None,
               rank: int | None, max_rank: int | None, schedule: tuple[int, int, int],
               sample_slices: int, min_size: int, compress_if: LeafPredicate | None,
               sample_compressor: qc.Compressor | None, sample_algorithm: qc.Algorithm,
               stop_loss: float | None, mean: bool,
               error_feedback: ResidualFeedback | None,
               batch_buckets: qc.BatchBuckets) -> _Settings:
    """The settings of `gradiveq`, checked; ValueError naming the first bad one."""
    if (loss_threshold is None) == (rank is None):
        raise ValueError("exactly one of loss_threshold and rank must be given, got "
                         f"loss_threshold={loss_threshold!r}, rank={rank!r}")
    if loss_threshold is not None:
        loss_threshold = check_float("loss_threshold", loss_threshold, low=0.0, high=1.0,
                                     low_inclusive=True, high_inclusive=False)
        if max_rank is None:
            raise ValueError("max_rank (an integer in [1, inf]) is required with loss_threshold: "
                             "the static number of basis columns")
        max_rank = check_int("max_rank", max_rank, low=1)
    else:
        rank = check_int("rank", rank, low=1)
        if max_rank is not None:
            raise ValueError(f"max_rank applies to loss_threshold only, got max_rank={max_rank!r}")
    warmup_steps, sample_steps, compressed_steps = schedule
    qc.runs_batched(1, 0, batch_buckets)  # ValueError naming batch_buckets
    return _Settings(
        axis_name=axis_name,
        slice_size=slice_size if callable(slice_size) else check_int("slice_size", slice_size),
        rank=rank, loss_threshold=loss_threshold, max_rank=max_rank,
        schedule=GradiVeQCycle.checked(warmup_steps, sample_steps, compressed_steps),
        sample_slices=check_int("sample_slices", sample_slices),
        min_size=check_int("min_size", min_size, low=0), compress_if=compress_if,
        sample_compressor=check_compressor("sample_compressor", sample_compressor,
                                           per_leaf=False, allow_none=True),
        sample_algorithm=check_choice("sample_algorithm", sample_algorithm,
                                      get_args(qc.Algorithm)),
        stop_loss=check_float("stop_loss", stop_loss, low=0.0, allow_none=True),
        mean=mean, error_feedback=keeps_residual(error_feedback, "gradiveq"),
        batch_buckets=batch_buckets)


def _leaf_plan(path: Any, leaf: Any, settings: _Settings) -> LeafPlan | None:
    """The static layout of a leaf the policy keeps, or None for one smaller than a slice."""
    size = int(np.prod(np.shape(leaf)))
    k = settings.slice_size(path, leaf) if callable(settings.slice_size) else settings.slice_size
    if k is None:
        return None
    k = check_int(f"slice_size for {jax.tree_util.keystr(path)}", k)
    if size < k:
        return None
    rank = settings.rank
    if rank is not None and rank > k:
        raise ValueError(f"rank must be an integer in [1, {k}] (the slice size of "
                         f"{jax.tree_util.keystr(path)}), got {rank!r}")
    columns = rank if rank is not None else min(settings.max_rank or k, k)  # max_rank: set
    return LeafPlan(k, columns, min(settings.sample_slices, size // k), size // k)


def _plan(tree: Any, settings: _Settings) -> list[LeafPlan | None]:
    """Each leaf's `LeafPlan` (flatten order), None for the leaves that go uncompressed."""
    compress_if = settings.compress_if or (lambda path, leaf: np.ndim(leaf) >= 2)
    return leaf_choices(tree, functools.partial(_leaf_plan, settings=settings),
                        min_size=settings.min_size, compress_if=compress_if)


def _init(params: optax.Params, *, key: jax.Array, settings: _Settings) -> GradiVeQState:
    leaves, treedef = jax.tree.flatten(params)
    plans = _plan(params, settings)
    sample_steps = settings.schedule.sample_steps

    def per_leaf(make: Callable[[LeafPlan], jax.Array]) -> Any:
        return treedef.unflatten([optax.MaskedNode() if p is None else make(p) for p in plans])

    return GradiVeQState(
        residual=treedef.unflatten([
            zeros_or_masked(leaf, p is not None and settings.error_feedback)
            for p, leaf in zip(plans, leaves, strict=True)]),
        samples=per_leaf(lambda p: jnp.zeros((sample_steps, p.sampled * p.slice_size),
                                             jnp.float32)),
        valid=jnp.zeros((sample_steps,), jnp.bool_),
        basis=per_leaf(lambda p: jnp.zeros((p.slice_size, p.columns), jnp.float32)),
        mean=per_leaf(lambda p: jnp.zeros((p.slice_size,), jnp.float32)),
        rank=per_leaf(lambda p: jnp.zeros((), jnp.int32)),
        key=key,
        count=jnp.zeros([], jnp.int32),
        cycle_start=jnp.full([], settings.schedule.warmup_steps, jnp.int32),
    )


def _expected_shapes(plan: LeafPlan | None,
                     settings: _Settings) -> dict[str, tuple[int, ...] | None]:
    """The per-leaf entries `_init` keeps for a leaf of this plan, and their shapes."""
    if plan is None:
        return {}
    want: dict[str, tuple[int, ...] | None] = {
        "residual": None,  # checked by read_per_device
        "samples": (settings.schedule.sample_steps, plan.sampled * plan.slice_size),
        "basis": (plan.slice_size, plan.columns), "mean": (plan.slice_size,), "rank": ()}
    if not settings.error_feedback:
        del want["residual"]
    return want


def _read_state(grads: optax.Updates, leaves: list[jax.Array], plans: list[LeafPlan | None],
                state: GradiVeQState, settings: _Settings) -> dict[str, list[Any]]:
    """The per-leaf entries of ``state`` at the leaves of ``grads``, checked
    against ``init``'s: name -> list, ``"residual"`` this device's (None where
    there is none), and ``"block"`` the residuals as stored."""
    entries = {}
    entries["block"], entries["residual"] = read_per_device(
        grads, state.residual, settings.axis_name, "the error-feedback residual",
        field_name="GradiVeQ residual")
    for name in _PER_LEAF[1:]:
        entries[name] = leaves_like(grads, getattr(state, name), f"GradiVeQ {name}")
    for i, (plan, leaf, path) in enumerate(zip(plans, leaves, leaf_paths(grads), strict=True)):
        check_entries(path, leaf, plan is not None,
                      {name: entries[name][i] for name in _PER_LEAF},
                      _expected_shapes(plan, settings), owner="GradiVeQ")
    return entries


def _update(grads: optax.Updates, state: GradiVeQState, params: optax.Params | None = None,
            *, settings: _Settings) -> tuple[optax.Updates, GradiVeQState]:
    """One step: the reduced update (mean or sum over devices) and the next state."""
    del params
    check_local_gradients(grads, settings.axis_name)
    leaves, treedef = jax.tree.flatten(grads)
    plans = _plan(grads, settings)
    entries = _read_state(grads, leaves, plans, state, settings)
    idx = [i for i, p in enumerate(plans) if p is not None]
    n = int(lax.axis_size(settings.axis_name))
    phase = settings.schedule.phase(state.count, state.cycle_start)
    mine = {name: [entries[name][i] for i in idx] for name in _PER_LEAF}
    cplans = [plan for plan in plans if plan is not None]  # the plans at idx

    out = sum_uncompressed(leaves, [p is not None for p in plans], settings.axis_name,
                           mean=settings.mean)
    xs = [add_residual(leaves[i].astype(jnp.float32), r if settings.error_feedback else None)
          for i, r in zip(idx, mine["residual"], strict=True)]
    if idx:
        step_key = jax.random.fold_in(state.key, state.count)
        sums, contributed, votes = aggregate(xs, mine["basis"], mine["mean"],
                                             phase.compressing, step_key, settings)
        for j, i in enumerate(idx):
            value = sums[j] / n if settings.mean else sums[j]
            out[i] = value.astype(leaves[i].dtype)
    out = [o.astype(leaf.dtype) for o, leaf in zip(out, leaves, strict=True)]
    # Non-finite anywhere makes the reduced update non-finite everywhere,
    # so this flag agrees across devices without another collective.
    finite = all_finite(out)

    new = {name: list(entries[name]) for name in _PER_LEAF}
    valid, ended = state.valid, phase.ends
    if idx:
        if settings.stop_loss is not None:  # a cycle also ends early on a majority vote
            ended = ended | (phase.compressing & finite & (2 * votes > n))
        valid = jnp.where(phase.sampling, valid.at[phase.slot].set(finite), valid)
        fresh = refreshed(mine, sums, cplans, valid, phase, finite, rank=settings.rank,
                          loss_threshold=settings.loss_threshold)
        if settings.error_feedback:
            fresh["residual"] = [residual_of(x, c) for x, c in zip(xs, contributed, strict=True)]
        for name, values in fresh.items():
            for j, i in enumerate(idx):
                new[name][i] = values[j]
    next_count = optax.safe_int32_increment(state.count)
    return treedef.unflatten(out), GradiVeQState(
        residual=treedef.unflatten(kept_per_device(new["residual"], entries["residual"],
                                                   entries["block"], finite)),
        samples=treedef.unflatten(new["samples"]),
        valid=valid,
        basis=treedef.unflatten(new["basis"]),
        mean=treedef.unflatten(new["mean"]),
        rank=treedef.unflatten(new["rank"]),
        key=state.key,
        count=next_count,
        cycle_start=jnp.where(ended, next_count, state.cycle_start),
    )
