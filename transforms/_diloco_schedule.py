"""DiLoCo's schedule and fragments: which step does what, and which leaves sync together.

The schedule of `transforms.diloco` is a function of the step count alone
(`diloco_schedule`): synchronous warm-start steps, then rounds of ``every``
(H) inner steps in which each of the F fragments synchronises once, at
evenly spaced steps (Streaming DiLoCo, Douillard et al. 2025, section 2.2),
its average landing ``delay`` (tau) steps later (section 2.3). The state
holds the step count and nothing else about the schedule. The fragments
are runs of consecutive leaves balanced by size (`fragment_masks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qcollect.checks import check_int
from transforms._phases import EXACT, INNER, OUTER, PhaseSpan, clipped

__all__ = ["DiLoCoSchedule", "DiLoCoStep", "FragmentOf", "checked_schedule", "diloco_schedule",
           "fragment_masks"]

#: ``fragment_of(path, leaf) -> int``: the fragment a leaf belongs to.
FragmentOf = Callable[[Any, Any], int]


class DiLoCoStep(NamedTuple):
    """What `diloco` does at one step: `diloco_schedule` of the step count.

    Scalars (int32 or bool arrays), equal on every device. A step with
    ``syncs == lands == -1`` and not ``begins_rounds`` is an inner step: it
    sends nothing (apart from a warm-start step's gradient mean).

    Attributes:
      synchronous: a warm-start step (``count < sync_first``): the gradients
        are averaged exactly before the inner optimizer steps.
      begins_rounds: the last warm-start step: the anchor becomes the
        replicas' exact mean, and the rounds start after it.
      syncs: the fragment whose outer step runs at this step, or -1.
      lands: the fragment whose delayed average is applied at this step
        (with ``delay > 0``), or -1.
    """

    synchronous: jax.Array
    begins_rounds: jax.Array
    syncs: jax.Array
    lands: jax.Array


def fragment_masks(params: optax.Params, fragments: int,
                   fragment_of: FragmentOf | None = None) -> list[list[bool]]:
    """Which leaves (flatten order) each fragment holds: ``fragments`` lists of bools.

    By default the leaves are cut in flatten order into ``fragments``
    non-empty runs whose largest holds as few values as possible
    (consecutive layers share a fragment, as Streaming DiLoCo's fragments
    are runs of layers; the peak bytes of a sync are those of the largest
    run); ``fragment_of(path, leaf) -> int`` chooses instead.

    Args:
      params: the parameters (or any tree of their shapes).
      fragments: F, an integer >= 1, at most the number of leaves unless
        ``fragment_of`` is given.
      fragment_of: optional ``f(path, leaf) -> int`` in ``[0, fragments)``.

    Returns:
      ``fragments`` lists with one bool per leaf: True where the leaf
      belongs to that fragment.

    Raises:
      ValueError: ``fragments`` is not an integer >= 1 or exceeds the
        leaves, or ``fragment_of`` returns something else than an int in
        range.

    References:
      Douillard et al., Streaming DiLoCo, 2025
      <https://arxiv.org/abs/2501.18512>, section 2.2 (fragments).

    Example:
      >>> import jax.numpy as jnp, transforms
      >>> tree = {"a": jnp.zeros(10), "b": jnp.zeros(10), "c": jnp.zeros(20)}
      >>> transforms.fragment_masks(tree, 2)
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


class DiLoCoSchedule(NamedTuple):
    """The validated settings that make `diloco`'s schedule (a
    `transforms._phases.Schedule`: ``at(count)`` and ``spans(steps)``)."""

    every: int
    fragments: int
    delay: int
    sync_first: int

    def offset(self, f: int) -> int:
        """Fragment ``f`` synchronises when ``count + 1 - sync_first = offset (mod every)``."""
        return ((f + 1) * self.every // self.fragments) % self.every

    def at(self, count: jax.Array | int) -> DiLoCoStep:
        """`diloco_schedule` of ``count`` (a traced or concrete int)."""
        count = jnp.asarray(count, jnp.int32)
        done = count + 1 - self.sync_first  # inner steps of the rounds after this one
        phase = done % self.every
        syncs = lands = jnp.full([], -1, jnp.int32)
        for f in range(self.fragments):
            syncs = jnp.where((phase == self.offset(f)) & (done > 0), f, syncs)
            if self.delay:
                lands = jnp.where((phase == (self.offset(f) + self.delay) % self.every)
                                  & (done > self.delay), f, lands)
        return DiLoCoStep(synchronous=count < self.sync_first, begins_rounds=done == 0,
                          syncs=syncs, lands=lands)

    def spans(self, steps: int) -> tuple[PhaseSpan, ...]:
        """Steps ``0 .. steps - 1`` as ``"exact"`` (the synchronous
        warm start), ``"outer"`` (a fragment's outer step: it synchronises,
        lands or the rounds begin) and ``"inner"`` (the workers' own steps).

        Example:
          >>> checked_schedule(3, 1, 0, 2).spans(8)  # doctest: +NORMALIZE_WHITESPACE
          (PhaseSpan(name='exact', start=0, stop=1), PhaseSpan(name='outer', start=1, stop=2),
           PhaseSpan(name='inner', start=2, stop=4), PhaseSpan(name='outer', start=4, stop=5),
           PhaseSpan(name='inner', start=5, stop=7), PhaseSpan(name='outer', start=7, stop=8))
        """
        steps = check_int("steps", steps, low=0)
        at = jax.tree.map(np.asarray, self.at(np.arange(steps, dtype=np.int32)))
        outer = (at.syncs >= 0) | (at.lands >= 0) | at.begins_rounds
        names = np.where(at.synchronous & ~at.begins_rounds, EXACT,
                         np.where(outer, OUTER, INNER))
        runs, start = [], 0
        for t in range(1, steps + 1):
            if t == steps or names[t] != names[start]:
                runs.append((str(names[start]), start, t))
                start = t
        return clipped(runs, steps)


def checked_schedule(every: int, fragments: int, delay: int,
                     sync_first: int) -> DiLoCoSchedule:
    """The schedule settings of `diloco`, checked; ValueError naming the first bad one."""
    every = check_int("every", every)
    fragments = check_int("fragments", fragments)
    if fragments > every:
        raise ValueError(f"fragments must be at most every ({every}), got {fragments}")
    delay = check_int("delay", delay, low=0)
    if delay and delay >= every // fragments:
        raise ValueError(f"delay must be below every // fragments ({every // fragments}), "
                         f"got {delay}")
    return DiLoCoSchedule(every, fragments, delay, check_int("sync_first", sync_first, low=0))


def diloco_schedule(count: jax.Array | int, *, every: int, fragments: int = 1, delay: int = 0,
                    sync_first: int = 0) -> DiLoCoStep:
    """What `diloco` with these settings does at step ``count``, from the count alone.

    Steps ``0 .. sync_first - 1`` are synchronous data parallelism, and the
    last of them begins the rounds. Then each round has ``every`` (H) inner
    steps; fragment ``f`` of F synchronises at inner step ``(f + 1) H // F``
    of each round (the last fragment with the round's last step), so the
    syncs are spread evenly over the round and each sends about 1/F of the
    model; with ``delay`` (tau) its average lands tau steps after the sync.
    It accepts a Python int and a traced int32 count alike; `diloco`'s
    update computes the same on ``state.count`` inside the step.

    Args:
      count: the step, ``state.count`` before it (0 for the first).
      every: H, inner steps per round, >= 1.
      fragments: F, at most ``every``.
      delay: tau, below ``every // fragments``.
      sync_first: K, synchronous warm-start steps, >= 0.

    Returns:
      A `DiLoCoStep` of scalar arrays.

    Raises:
      ValueError: a setting out of its range, naming it (as `diloco`).

    References:
      Douillard et al., DiLoCo, 2023 <https://arxiv.org/abs/2311.08105>,
      Algorithm 1 (rounds of H inner steps); Douillard et al., Streaming
      DiLoCo, 2025 <https://arxiv.org/abs/2501.18512>, sections 2.2
      (fragments' staggered syncs) and 2.3 (overlap, tau).

    Example:
      >>> import transforms
      >>> steps = [transforms.diloco_schedule(t, every=4, fragments=2) for t in range(8)]
      >>> [int(step.syncs) for step in steps]   # fragment 0 at inner step 2, 1 at 4
      [-1, 0, -1, 1, -1, 0, -1, 1]
    """
    return checked_schedule(every, fragments, delay, sync_first).at(count)
