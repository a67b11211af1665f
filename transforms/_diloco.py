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
import numpy as np
import optax
from jax import lax

import qcollect as qc
from qcollect.checks import check_float, check_int
from transforms._mean import mean_all_reduce
from transforms._sharding import (
    all_finite,
    check_axis,
    device_block,
    keep_if_finite,
    per_device,
    to_varying,
)

__all__ = ["DiLoCoState", "diloco", "fragment_masks"]


@per_device("inner")
class DiLoCoState(NamedTuple):
    """State of `diloco` (the module docstring says which part is per device).

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
      count: int32 inner steps taken (the same on every device).
    """

    inner: Any
    anchor: Any
    outer: tuple
    reduce: tuple
    pending: Any
    count: jax.Array


def fragment_masks(params, fragments: int, fragment_of: Callable | None = None) -> list:
    """Which leaves (flatten order) each fragment holds: ``fragments`` lists of bools.

    By default the leaves are cut in flatten order into ``fragments``
    non-empty runs whose largest holds as few values as possible
    (consecutive layers share a fragment; the peak bytes of a sync are
    those of the largest run); ``fragment_of(path, leaf) -> int`` chooses
    instead.

    Example:
      >>> import jax.numpy as jnp
      >>> fragment_masks({"a": jnp.zeros(10), "b": jnp.zeros(10), "c": jnp.zeros(20)}, 2)
      [[True, True, False], [False, False, True]]
    """
    fragments = check_int("fragments", fragments)
    leaves = jax.tree.leaves_with_path(params)
    if fragment_of is not None:
        chosen = [fragment_of(path, leaf) for path, leaf in leaves]
        bad = [f for f in chosen if not isinstance(f, (int, np.integer)) or
               not 0 <= f < fragments]
        if bad:
            raise ValueError(f"fragment_of must return ints in [0, {fragments}), got {bad[0]!r}")
    else:
        if len(leaves) < fragments:
            raise ValueError(f"fragments: {fragments} fragments of {len(leaves)} leaves; pass "
                             "fragment_of or fewer fragments")
        runs = _balanced_runs([int(np.size(leaf)) for _, leaf in leaves], fragments)
        chosen = [f for f, run in enumerate(runs) for _ in run]
    return [[c == f for c in chosen] for f in range(fragments)]


def _balanced_runs(sizes: list[int], parts: int) -> list[list[int]]:
    """``sizes`` cut into ``parts`` non-empty contiguous runs, the largest run
    as small as it can be (binary search on the cap, greedy runs)."""
    def greedy(cap: int) -> list[list[int]]:
        runs: list[list[int]] = [[]]
        total = 0
        for i, size in enumerate(sizes):
            if runs[-1] and total + size > cap:
                runs.append([])
                total = 0
            runs[-1].append(i)
            total += size
        return runs

    low, high = max(sizes), sum(sizes)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if len(greedy(middle)) <= parts else (middle + 1, high)
    runs = greedy(low)
    while len(runs) < parts:  # splitting a run never makes the largest larger
        at = next(i for i, run in enumerate(runs) if len(run) > 1)
        runs[at:at + 1] = [runs[at][:-1], runs[at][-1:]]
    return runs


def _part(tree, keep: list[bool]):
    """``tree`` with the leaves not kept replaced by None (paths kept)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([leaf if k else None for leaf, k in zip(leaves, keep, strict=True)])


def _merge(base, part_tree, keep: list[bool]):
    """``base`` with the kept leaves taken from ``part_tree`` (a `_part`)."""
    leaves, treedef = jax.tree.flatten(base)
    parts = treedef.flatten_up_to(part_tree)
    return treedef.unflatten([p if k else b for b, p, k in zip(leaves, parts, keep, strict=True)])


def diloco(axis_name, *, inner: optax.GradientTransformation, every: int,
           outer: optax.GradientTransformation | None = None,
           reduce: optax.GradientTransformation | None = None, fragments: int = 1,
           fragment_of: Callable | None = None, delay: int = 0,
           mix: float = 0.5, sync_first: int = 0) -> optax.GradientTransformation:
    """DiLoCo: ``every`` inner steps per worker, then a compressed outer step.

    ``update(grads, state, params)`` takes this worker's gradients at its
    parameters and returns the update that ``optax.apply_updates`` adds to
    them: the inner optimizer's, or on a synchronising step the move to the
    new global parameters of the fragment that synchronises (module
    docstring). Use it alone (it contains the inner optimizer).

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
        (`qcollect.fused_psum`).
      fragments: F, the fragments synchronised in turn (Streaming DiLoCo);
        at most ``every``.
      fragment_of: ``f(path, leaf) -> int`` in ``[0, fragments)`` (default:
        `fragment_masks`' balanced runs).
      delay: tau, inner steps between a fragment's exchange and its
        application, below ``every // fragments``.
      mix: with ``delay``, the weight of the worker's own parameters when
        the delayed fragment is applied, in [0, 1].
      sync_first: K, synchronous data-parallel steps (exact gradient mean,
        a full all-reduce each) before the first round (module docstring).

    Returns:
      An ``optax.GradientTransformation``.

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
    every = check_int("every", every)
    fragments = check_int("fragments", fragments)
    if fragments > every:
        raise ValueError(f"fragments must be at most every ({every}), got {fragments}")
    delay = check_int("delay", delay, low=0)
    if delay and delay >= every // fragments:
        raise ValueError(f"delay must be below every // fragments ({every // fragments}), "
                         f"got {delay}")
    mix = check_float("mix", mix, low=0.0, high=1.0, low_inclusive=True)
    sync_first = check_int("sync_first", sync_first, low=0)
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer
    reduce = mean_all_reduce(axis_name) if reduce is None else reduce
    for name, tx in (("inner", inner), ("outer", outer), ("reduce", reduce)):
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise ValueError(f"{name} must be an optax GradientTransformation, got {tx!r}")
    settings = _Settings(axis_name, inner, outer, reduce, every, fragments, fragment_of, delay,
                         mix, sync_first)
    return optax.GradientTransformation(functools.partial(_init, s=settings),
                                        functools.partial(_update, s=settings))


class _Settings(NamedTuple):
    axis_name: Any
    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    reduce: Any
    every: int
    fragments: int
    fragment_of: Callable | None
    delay: int
    mix: float
    sync_first: int

    def masks(self, params) -> list:
        return fragment_masks(params, self.fragments, self.fragment_of)

    def offset(self, f: int) -> int:
        """Fragment ``f`` synchronises when ``count + 1 = offset (mod every)``."""
        return ((f + 1) * self.every // self.fragments) % self.every


def _init(params, *, s: _Settings) -> DiLoCoState:
    anchor = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    masks = s.masks(params)
    parts = [_part(anchor, m) for m in masks]
    pending = (anchor if s.delay else jax.tree.map(lambda _: optax.MaskedNode(), params))
    return DiLoCoState(inner=s.inner.init(params), anchor=anchor,
                       outer=tuple(s.outer.init(p) for p in parts),
                       reduce=tuple(s.reduce.init(p) for p in parts), pending=pending,
                       count=jnp.zeros([], jnp.int32))


def _update(grads, state: DiLoCoState, params=None, *, s: _Settings):
    if params is None:
        raise ValueError("diloco needs params: call update(grads, state, params)")
    check_axis(s.axis_name)
    like = jax.eval_shape(s.inner.init, params)
    stored_inner = state.inner
    inner_state = jax.tree.map(
        lambda a, b: device_block(a, b, s.axis_name, "the inner optimizer state"),
        stored_inner, like)
    if s.sync_first:
        grads = lax.cond(state.count < s.sync_first,
                         functools.partial(_mean_gradients, axis_name=s.axis_name),
                         functools.partial(to_varying, axis_name=s.axis_name), grads)
    updates, new_inner = s.inner.update(grads, inner_state, params)
    ok = all_finite(updates)  # this worker's own step: no collective
    updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), updates)
    new_inner = keep_if_finite(ok, new_inner, inner_state)
    local = jax.tree.map(lambda p, u: p.astype(jnp.float32) + u.astype(jnp.float32),
                         params, updates)

    masks = s.masks(params)
    done = state.count + 1 - s.sync_first  # inner steps of the rounds after this one
    phase = done % s.every
    branches = [lambda st: (to_varying(updates, s.axis_name), st)]
    index = jnp.zeros([], jnp.int32)
    for f, mask in enumerate(masks):
        branches.append(functools.partial(_sync, f=f, mask=mask, local=local, params=params,
                                          updates=updates, s=s))
        index = jnp.where((phase == s.offset(f)) & (done > 0), len(branches) - 1, index)
    if s.delay:
        for f, mask in enumerate(masks):
            branches.append(functools.partial(_apply_pending, mask=mask, local=local,
                                              params=params, updates=updates, s=s))
            lands = (phase == (s.offset(f) + s.delay) % s.every) & (done > s.delay)
            index = jnp.where(lands, len(branches) - 1, index)
    if s.sync_first:
        branches.append(functools.partial(_begin_rounds, local=local, updates=updates, s=s))
        index = jnp.where(done == 0, len(branches) - 1, index)
    shared = state._replace(inner=None, count=None)
    out, shared = lax.switch(index, branches, shared)
    new_inner = jax.tree.map(lambda n, st: jnp.reshape(n, jnp.shape(st)), new_inner,
                             stored_inner)
    return out, shared._replace(inner=new_inner, count=optax.safe_int32_increment(state.count))


def _mean_gradients(grads, axis_name):
    """The exact mean over the workers, per device (a warm-start step)."""
    mean = qc.fused_psum(grads, axis_name, mean=True)
    return to_varying(jax.tree.map(lambda m, g: m.astype(g.dtype), mean, grads), axis_name)


def _begin_rounds(st: DiLoCoState, *, local, updates, s: _Settings):
    """The last warm-start step: the anchor becomes the replicas' exact mean."""
    anchor = qc.fused_psum(local, s.axis_name, mean=True)
    return to_varying(updates, s.axis_name), st._replace(anchor=anchor)


def _moved_to(values, mask, local, params, updates, axis_name):
    """The update that takes the fragment's leaves to ``values`` and the
    others to ``local`` (their inner step), both float32."""
    moved = _merge(local, values, mask)
    out = jax.tree.map(lambda m, p, u: (m - p.astype(jnp.float32)).astype(u.dtype),
                       moved, params, updates)
    return to_varying(out, axis_name)


def _sync(st: DiLoCoState, *, f: int, mask, local, params, updates, s: _Settings):
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
    if s.delay:
        st = st._replace(pending=_merge(st.pending, new_f, mask), reduce=reduce, outer=outer)
        return to_varying(updates, s.axis_name), st
    st = st._replace(anchor=_merge(st.anchor, new_f, mask), reduce=reduce, outer=outer)
    return _moved_to(new_f, mask, local, params, updates, s.axis_name), st


def _apply_pending(st: DiLoCoState, *, mask, local, params, updates, s: _Settings):
    """A delayed fragment lands: ``mix * local + (1 - mix) * global``, and the
    global values become the fragment's anchor."""
    pending = _part(st.pending, mask)
    merged = jax.tree.map(lambda x, g: s.mix * x + (1 - s.mix) * g,
                          _part(local, mask), pending)
    return (_moved_to(merged, mask, local, params, updates, s.axis_name),
            st._replace(anchor=_merge(st.anchor, pending, mask)))
