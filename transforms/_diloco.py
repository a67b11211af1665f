"""`diloco`: infrequent synchronisation with compressed outer gradients.

DiLoCo (Douillard et al. 2023, Algorithm 1): each worker runs ``H`` inner
optimizer steps on its own replica with no communication; then the
*outer gradient* (pseudo-gradient) ``delta_i = theta - theta_i``, the round's
starting parameters minus the worker's current ones, is averaged over the
workers and an outer optimizer (SGD with Nesterov momentum 0.9 at learning
rate 0.7 in the paper) steps from ``theta`` with it. Every worker starts the
next round from the new ``theta``. The inner optimizer's state stays with
its worker across rounds.

Here the average goes through ``reduce``: `compressed_all_reduce` (any
compressor, with error feedback: one residual per device and fragment) or
any transformation that averages over the axis; by default an exact
float32 mean (`qcollect.fused_psum`).

Streaming DiLoCo (Douillard et al. 2025, sections 2.1-2.3): with
``fragments=F`` the leaves are split into F fragments (contiguous in
flatten order, balanced by size; or ``fragment_of(path, leaf)``), and
fragment ``f`` synchronises at inner step ``(f + 1) H / F`` of each round,
so each sync sends about 1/F of the model and the peak bytes per step fall
F-fold. With ``delay=tau`` the averaged fragment is applied ``tau`` inner
steps after its exchange began (the paper's overlap of communication with
computation), merged with the worker's parameters of that step as
``mix * local + (1 - mix) * global`` (the paper's alpha, 0.5). On this
backend a collective ends inside the step that starts it, so the delay
reproduces the algorithm's arithmetic, not the wall-clock overlap.

SparseLoCo (Sarfi et al. 2025) replaces the outer momentum by error
feedback and sends a sparse outer gradient: ``reduce=`` a
`compressed_all_reduce` with a sparsifying compressor (`qcollect.adaptive`:
the top values of each column with one mean per sign, Dryden et al., in
place of the paper's chunk-wise top-k and 2-bit values) and error feedback,
and ``outer=optax.sgd(lr)``. The paper decays its accumulator (``e <- beta
e + delta``); the residual here is not decayed (beta = 1).

Per device and shared state (`DiLoCoState`): the parameters themselves are
per device (each worker's replica, stacked along a leading device axis and
sharded ``P(axis_name)``, as for `compressed_model_averaging`), and so are
the inner optimizer's state and the error-feedback residuals; the round's
starting parameters, the outer optimizer's state, the delayed fragment and
the counters are the same on every device (``P()``). `state_specs` and
`init_sharded` place them.

Warm start (``sync_first=K``): the papers start DiLoCo from a model
pretrained synchronously (DiLoCo section 3: 24k of 88k steps). The first K
steps are synchronous data parallelism: every worker's gradients are
averaged exactly (`qcollect.fused_psum`, a full all-reduce each step) before
the inner optimizer, so the replicas and their inner states stay equal; at
step K the anchor becomes their (exact) mean and the rounds begin.

The schedule is a function of the step count alone (`diloco_schedule`):
which step is an inner step, a warm-start step, a sync and of which
fragment, and where a delayed fragment lands. Every device reads the same
count, so all take the same branch of one ``lax.switch`` and run the same
collectives; the state holds the count and nothing else about the schedule.

Non-finite inner steps: a worker whose inner update is non-finite skips
that step (its parameters and inner state stay), with no collective, so one
worker's bad batch never reaches the outer gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

import qcollect as qc
from qcollect.checks import check_float, check_floating_leaves
from transforms._axes import AxisName, check_axis, to_varying
from transforms._blocks import device_block
from transforms._diloco_schedule import (
    DiLoCoStep,
    FragmentOf,
    DiLoCoSchedule,
    checked_schedule,
    fragment_masks,
)
from transforms._finite import all_finite, keep_if_finite
from transforms._mean import mean_all_reduce
from transforms._placement import per_device

__all__ = ["DiLoCoState", "diloco"]


@per_device("inner")
class DiLoCoState(NamedTuple):
    """State of `diloco`: per device ``inner`` and the residuals in ``reduce``, the rest shared.

    Attributes:
      inner: per device (``P(axis_name)``): the inner optimizer's state.
      anchor: the parameters every worker started the current round from
        (float32, the same on every device).
      outer: per fragment, the outer optimizer's state of its leaves (the
        same on every device).
      reduce: per fragment, the state of the outer gradients' all-reduce
        (`CompressedAllReduceState`: residuals per device), or
        ``optax.EmptyState()`` for the exact mean.
      pending: with ``delay > 0``: the new global values of the fragment
        awaiting application (float32, like the parameters); else
        ``optax.MaskedNode()`` leaves.
      count: int32 inner steps taken (the same on every device); the
        schedule is `diloco_schedule` of it.
    """

    inner: Any
    anchor: Any
    outer: tuple[Any, ...]
    reduce: tuple[Any, ...]
    pending: Any
    count: jax.Array


def _part(tree: Any, keep: list[bool]) -> Any:
    """``tree`` with the leaves not kept replaced by None (paths kept)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([leaf if k else None for leaf, k in zip(leaves, keep, strict=True)])


def _merge(base: Any, part_tree: Any, keep: list[bool]) -> Any:
    """``base`` with the kept leaves taken from ``part_tree`` (a `_part`)."""
    leaves, treedef = jax.tree.flatten(base)
    parts = treedef.flatten_up_to(part_tree)
    return treedef.unflatten([p if k else b for b, p, k in zip(leaves, parts, keep, strict=True)])


def diloco(axis_name: AxisName, *, inner: optax.GradientTransformation, every: int,
           outer: optax.GradientTransformation | None = None,
           reduce: optax.GradientTransformation | None = None, fragments: int = 1,
           fragment_of: FragmentOf | None = None, delay: int = 0,
           mix: float = 0.5, sync_first: int = 0) -> optax.GradientTransformation:
    """DiLoCo: ``every`` inner steps per worker, then a compressed outer step.

    Workers communicate once per round instead of once per step, so a slow
    link carries H times fewer bytes; the outer optimizer on the averaged
    outer gradient keeps the workers on one model. ``update(grads, state,
    params)`` takes this worker's gradients at its parameters and returns
    the update that ``optax.apply_updates`` adds to them: the inner
    optimizer's, or on a synchronising step the move to the new global
    parameters of the fragment that synchronises (`diloco_schedule` says
    which step is which). Use it alone (it contains the inner optimizer).

    Args:
      axis_name: the data axis (``shard_map`` or ``pmap``): one worker per device.
      inner: the inner optimizer (the paper: AdamW), run on each replica.
      every: H, inner steps per round (an integer >= 1).
      outer: the outer optimizer (default ``optax.sgd(0.7, momentum=0.9,
        nesterov=True)``, the paper's), given the averaged outer gradient.
      reduce: the outer gradients' all-reduce, a transformation whose
        update is the mean over ``axis_name``: `compressed_all_reduce`
        with any compressor and error feedback (one state per fragment),
        `powersgd`, ...; default (None) the exact float32 mean
        (`mean_all_reduce`).
      fragments: F, the fragments synchronised in turn (Streaming DiLoCo);
        at most ``every``.
      fragment_of: ``f(path, leaf) -> int`` in ``[0, fragments)`` (default:
        `fragment_masks`' balanced runs).
      delay: tau, inner steps between a fragment's exchange and its
        application, below ``every // fragments``.
      mix: with ``delay``, the weight of the worker's own parameters when
        the delayed fragment is applied, in [0, 1].
      sync_first: K, synchronous data-parallel steps (exact gradient mean,
        a full all-reduce each) before the first round; then the anchor is
        the replicas' exact mean.

    Returns:
      An ``optax.GradientTransformation`` (state `DiLoCoState`).

    Raises:
      ValueError: a setting out of its range (naming it); ``update``
        without ``params``.

    References:
      Douillard et al., DiLoCo, 2023 <https://arxiv.org/abs/2311.08105>,
      Algorithm 1; Douillard et al., Streaming DiLoCo, 2025
      <https://arxiv.org/abs/2501.18512>, sections 2.1-2.3; Sarfi et al.,
      SparseLoCo, 2025 <https://arxiv.org/abs/2508.15706>.

    Example:
      >>> import jax, jax.numpy as jnp, optax, qcollect as qc, transforms
      >>> four_bits = transforms.compressed_all_reduce(
      ...     "data", compressor=qc.qsgd(bits=4), key=jax.random.key(0))
      >>> tx = transforms.diloco("data", inner=optax.adamw(1e-3), every=50, reduce=four_bits)
      >>> state = tx.init({"w": jnp.zeros((4, 4))})
      >>> int(state.count), state.anchor["w"].dtype
      (0, dtype('float32'))
    """
    schedule = checked_schedule(every, fragments, delay, sync_first)
    mix = check_float("mix", mix, low=0.0, high=1.0, low_inclusive=True)
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer
    reduce = mean_all_reduce(axis_name) if reduce is None else reduce
    for name, tx in (("inner", inner), ("outer", outer), ("reduce", reduce)):
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise ValueError(f"{name} must be an optax GradientTransformation, got {tx!r}")
    settings = _Settings(axis_name, inner, outer, reduce, schedule, fragment_of, mix)
    return optax.GradientTransformation(functools.partial(_init, s=settings),
                                        functools.partial(_update, s=settings))


class _Settings(NamedTuple):
    """The validated static settings of one `diloco` transformation."""

    axis_name: AxisName
    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    reduce: optax.GradientTransformation
    schedule: DiLoCoSchedule
    fragment_of: FragmentOf | None
    mix: float

    def masks(self, params: Any) -> list[list[bool]]:
        return fragment_masks(params, self.schedule.fragments, self.fragment_of)


def _init(params: optax.Params, *, s: _Settings) -> DiLoCoState:
    anchor = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    masks = s.masks(params)
    parts = [_part(anchor, m) for m in masks]
    pending = (anchor if s.schedule.delay
               else jax.tree.map(lambda _: optax.MaskedNode(), params))
    return DiLoCoState(inner=s.inner.init(params), anchor=anchor,
                       outer=tuple(s.outer.init(p) for p in parts),
                       reduce=tuple(s.reduce.init(p) for p in parts), pending=pending,
                       count=jnp.zeros([], jnp.int32))


def _update(grads: optax.Updates, state: DiLoCoState, params: optax.Params | None = None, *,
            s: _Settings) -> tuple[optax.Updates, DiLoCoState]:
    """One step: this worker's inner step, then the branch `diloco_schedule`
    picks (nothing more, a fragment's sync, a delayed fragment landing, or
    the start of the rounds)."""
    if params is None:
        raise ValueError("diloco needs params: call update(grads, state, params)")
    check_axis(s.axis_name)
    check_floating_leaves(grads, "grads")
    step = s.schedule.at(state.count)
    like = jax.eval_shape(s.inner.init, params)
    stored_inner = state.inner
    inner_state = jax.tree.map(
        lambda a, b: device_block(a, b, s.axis_name, "the inner optimizer state"),
        stored_inner, like)
    if s.schedule.sync_first:
        grads = lax.cond(step.synchronous,
                         functools.partial(_mean_gradients, axis_name=s.axis_name),
                         functools.partial(to_varying, axis_name=s.axis_name), grads)
    updates, new_inner = s.inner.update(grads, inner_state, params)
    ok = all_finite(updates)  # this worker's own step: no collective
    updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), updates)
    new_inner = keep_if_finite(ok, new_inner, inner_state)
    local = jax.tree.map(lambda p, u: p.astype(jnp.float32) + u.astype(jnp.float32),
                         params, updates)
    branches = _branches(s.masks(params), local=local, params=params, updates=updates, s=s)
    shared = state._replace(inner=None, count=None)
    out, shared = lax.switch(_branch_index(step, s.schedule), branches, shared)
    new_inner = jax.tree.map(lambda n, st: jnp.reshape(n, jnp.shape(st)), new_inner,
                             stored_inner)
    return out, shared._replace(inner=new_inner, count=optax.safe_int32_increment(state.count))


_Branch = Callable[[DiLoCoState], tuple[Any, DiLoCoState]]


def _branches(masks: list[list[bool]], *, local: Any, params: Any, updates: Any,
              s: _Settings) -> list[_Branch]:
    """The step's branches, in the order `_branch_index` numbers them: the
    inner step alone, each fragment's sync, with ``delay`` each fragment's
    landing, with ``sync_first`` the start of the rounds."""
    branches: list[_Branch] = [lambda st: (to_varying(updates, s.axis_name), st)]
    for f, mask in enumerate(masks):
        branches.append(functools.partial(_sync, f=f, mask=mask, local=local, params=params,
                                          updates=updates, s=s))
    if s.schedule.delay:
        for mask in masks:
            branches.append(functools.partial(_apply_pending, mask=mask, local=local,
                                              params=params, updates=updates, s=s))
    if s.schedule.sync_first:
        branches.append(functools.partial(_begin_rounds, local=local, updates=updates, s=s))
    return branches


def _branch_index(step: DiLoCoStep, schedule: DiLoCoSchedule) -> jax.Array:
    """The index into `_branches` of what ``step`` does."""
    index = jnp.where(step.syncs >= 0, 1 + step.syncs, 0)
    after = 1 + schedule.fragments
    if schedule.delay:
        index = jnp.where(step.lands >= 0, after + step.lands, index)
        after += schedule.fragments
    if schedule.sync_first:
        index = jnp.where(step.begins_rounds, after, index)
    return index


def _mean_gradients(grads: optax.Updates, axis_name: AxisName) -> optax.Updates:
    """The exact mean over the workers, per device (a warm-start step)."""
    mean = qc.fused_psum(grads, axis_name, mean=True)
    return to_varying(jax.tree.map(lambda m, g: m.astype(g.dtype), mean, grads), axis_name)


def _begin_rounds(st: DiLoCoState, *, local: Any, updates: Any,
                  s: _Settings) -> tuple[Any, DiLoCoState]:
    """The last warm-start step: the anchor becomes the replicas' exact mean."""
    anchor = qc.fused_psum(local, s.axis_name, mean=True)
    return to_varying(updates, s.axis_name), st._replace(anchor=anchor)


def _moved_to(values: Any, mask: list[bool], local: Any, params: Any, updates: Any,
              axis_name: AxisName) -> Any:
    """The update that takes the fragment's leaves to ``values`` and the
    others to ``local`` (their inner step), both float32."""
    moved = _merge(local, values, mask)
    out = jax.tree.map(lambda m, p, u: (m - p.astype(jnp.float32)).astype(u.dtype),
                       moved, params, updates)
    return to_varying(out, axis_name)


def _sync(st: DiLoCoState, *, f: int, mask: list[bool], local: Any, params: Any, updates: Any,
          s: _Settings) -> tuple[Any, DiLoCoState]:
    """Fragment ``f``'s outer step: average ``anchor - local`` over the
    workers, step the anchor with the outer optimizer, and move the worker
    there (now, or ``delay`` steps later through ``pending``)."""
    anchor_f = _part(st.anchor, mask)
    delta = jax.tree.map(lambda a, x: a - x, anchor_f, _part(local, mask))
    mean, reduce_f = s.reduce.update(to_varying(delta, s.axis_name), st.reduce[f], anchor_f)
    mean = jax.tree.map(lambda v: v.astype(jnp.float32), mean)
    steps, outer_f = s.outer.update(mean, st.outer[f], anchor_f)
    new_f = optax.apply_updates(anchor_f, steps)
    finite = all_finite(new_f)  # the same on every device: the average is
    new_f = keep_if_finite(finite, new_f, anchor_f)
    outer_f = keep_if_finite(finite, outer_f, st.outer[f])
    reduce = st.reduce[:f] + (reduce_f,) + st.reduce[f + 1:]
    outer = st.outer[:f] + (outer_f,) + st.outer[f + 1:]
    if s.schedule.delay:
        st = st._replace(pending=_merge(st.pending, new_f, mask), reduce=reduce, outer=outer)
        return to_varying(updates, s.axis_name), st
    st = st._replace(anchor=_merge(st.anchor, new_f, mask), reduce=reduce, outer=outer)
    return _moved_to(new_f, mask, local, params, updates, s.axis_name), st


def _apply_pending(st: DiLoCoState, *, mask: list[bool], local: Any, params: Any, updates: Any,
                   s: _Settings) -> tuple[Any, DiLoCoState]:
    """A delayed fragment lands: ``mix * local + (1 - mix) * global``, and the
    global values become the fragment's anchor."""
    pending = _part(st.pending, mask)
    merged = jax.tree.map(lambda x, g: s.mix * x + (1 - s.mix) * g,
                          _part(local, mask), pending)
    return (_moved_to(merged, mask, local, params, updates, s.axis_name),
            st._replace(anchor=_merge(st.anchor, pending, mask)))
