"""The phases of a run: which steps a phased transformation spends in which phase.

`transforms.powersgd` and `transforms.gradiveq` pick their phase from the
step count in a ``lax.cond`` and mark each branch with the phases it serves
(`qcollect.phase`), so `qcollect.wire_bytes_by_phase` measures each phase of
a compiled step by name. Their schedules (`transforms.powersgd_phases`,
`transforms.gradiveq_phases`) say which steps of a run fall in which phase,
as `PhaseSpan` runs under the same names: together, what a run sends.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from qcollect.checks import check_int

__all__ = ["COMPRESSED", "POWERSGD_START_ITER", "SAMPLING", "WARM_UP", "PhaseSpan",
           "gradiveq_phases", "powersgd_phases", "steps_per_phase", "warm_up_phases"]

#: The phase names the transformations mark and schedule.
WARM_UP = "warm-up"        # uncompressed (PowerSGD) or sample-compressed (GradiVeQ) start
SAMPLING = "sampling"      # GradiVeQ's steps that sample the sums for the next fit
COMPRESSED = "compressed"  # the compressor the transformation is named for

#: `transforms.powersgd`'s default ``start_iter`` (docs/transforms.md says why).
POWERSGD_START_ITER = 10


class PhaseSpan(NamedTuple):
    """Steps ``start .. stop - 1`` of a run, all in phase ``name``."""

    name: str
    start: int
    stop: int


def clipped(runs: Iterable[tuple[str, int, int]], steps: int) -> tuple[PhaseSpan, ...]:
    """``(name, start, stop)`` runs cut to steps ``0 .. steps - 1``, empty ones dropped.

    Example:
      >>> clipped([("warm-up", 0, 10), ("compressed", 10, 300)], 5)
      (PhaseSpan(name='warm-up', start=0, stop=5),)
    """
    out = (PhaseSpan(name, max(start, 0), min(stop, steps)) for name, start, stop in runs)
    return tuple(span for span in out if span.start < span.stop)


def steps_per_phase(schedule: Iterable[PhaseSpan]) -> dict[str, int]:
    """Steps in each phase of a schedule of `PhaseSpan`, in order of first appearance.

    Args:
      schedule: `PhaseSpan` runs, e.g. `powersgd_phases` or `gradiveq_phases`.

    Returns:
      Phase name -> number of steps.

    Example:
      >>> import transforms
      >>> transforms.steps_per_phase(transforms.powersgd_phases(300, start_iter=10))
      {'warm-up': 10, 'compressed': 290}
    """
    out: dict[str, int] = {}
    for span in schedule:
        out[span.name] = out.get(span.name, 0) + span.stop - span.start
    return out


def warm_up_phases(steps: int, *, compress_after: int) -> tuple[PhaseSpan, ...]:
    """Which of a run's steps ``0 .. steps - 1`` a transformation that sends
    the exact mean for ``compress_after`` steps spends in which phase:
    ``"warm-up"``, then ``"compressed"``. The schedule of
    `transforms.compressed_all_reduce` with ``compress_after`` (and of
    `transforms.powersgd`, whose ``start_iter`` means the same), under the
    names its branches are marked with (`qcollect.wire_bytes_by_phase`).

    Raises:
      ValueError: ``steps`` or ``compress_after`` is not an integer >= 0.

    Example:
      >>> import transforms
      >>> transforms.warm_up_phases(600, compress_after=120)
      ... # doctest: +NORMALIZE_WHITESPACE
      (PhaseSpan(name='warm-up', start=0, stop=120),
       PhaseSpan(name='compressed', start=120, stop=600))
      >>> transforms.warm_up_phases(600, compress_after=0)
      (PhaseSpan(name='compressed', start=0, stop=600),)
    """
    steps = check_int("steps", steps, low=0)
    first = check_int("compress_after", compress_after, low=0)
    return clipped([(WARM_UP, 0, first), (COMPRESSED, first, steps)], steps)


def powersgd_phases(steps: int, *, start_iter: int = POWERSGD_START_ITER
                    ) -> tuple[PhaseSpan, ...]:
    """Which of a run's steps ``0 .. steps - 1`` a `transforms.powersgd` with
    ``start_iter`` spends in which phase: ``"warm-up"`` (every leaf averaged
    uncompressed) before ``start_iter``, ``"compressed"`` from it on. The
    names are those its branches are marked with, so with
    `qcollect.wire_bytes_by_phase` of the step they give what the run sends.

    Args:
      steps: the run's length, >= 0.
      start_iter: `powersgd`'s ``start_iter``.

    Returns:
      The `PhaseSpan` runs in step order, empty ones left out.

    Raises:
      ValueError: ``steps`` or ``start_iter`` is not an integer >= 0.

    References:
      PyTorch ``powerSGD_hook``'s ``start_powerSGD_iter`` (uncompressed
      steps before PowerSGD starts); Vogels et al., PowerSGD, NeurIPS 2019
      <https://arxiv.org/abs/1905.13727>, Algorithm 1.

    Example:
      >>> import transforms
      >>> transforms.powersgd_phases(300)   # the default start_iter, 10
      ... # doctest: +NORMALIZE_WHITESPACE
      (PhaseSpan(name='warm-up', start=0, stop=10),
       PhaseSpan(name='compressed', start=10, stop=300))
      >>> transforms.powersgd_phases(300, start_iter=1000)   # never compresses
      (PhaseSpan(name='warm-up', start=0, stop=300),)
    """
    start_iter = check_int("start_iter", start_iter, low=0)
    return warm_up_phases(steps, compress_after=start_iter)


def gradiveq_phases(steps: int, *, warmup_steps: int = 0, sample_steps: int = 100,
                    compressed_steps: int = 400) -> tuple[PhaseSpan, ...]:
    """Which of a run's steps ``0 .. steps - 1`` a `transforms.gradiveq` with
    these settings (and its defaults) spends in which phase:
    ``"warm-up"``, then cycles of ``"sampling"`` and ``"compressed"`` steps
    (GradiVeQ section 3). The names are those its branches are marked with
    (`qcollect.wire_bytes_by_phase`). Exact without ``stop_loss``; with it
    a vote can end a compressed phase early, and a run spends at most these
    steps compressed.

    Args:
      steps: the run's length, >= 0.
      warmup_steps: `gradiveq`'s ``warmup_steps``.
      sample_steps: its ``sample_steps`` (L_t).
      compressed_steps: its ``compressed_steps`` (L_c).

    Returns:
      The `PhaseSpan` runs in step order, empty ones left out.

    Raises:
      ValueError: ``steps`` or ``warmup_steps`` below 0, or ``sample_steps``
        or ``compressed_steps`` below 1.

    References:
      Yu et al., GradiVeQ, NeurIPS 2018 <https://arxiv.org/abs/1811.03617>,
      section 3 ("System Overview": L_t sampling and L_c compressed steps).

    Example:
      >>> import transforms
      >>> transforms.gradiveq_phases(10, warmup_steps=2, sample_steps=1, compressed_steps=3)
      ... # doctest: +NORMALIZE_WHITESPACE
      (PhaseSpan(name='warm-up', start=0, stop=2), PhaseSpan(name='sampling', start=2, stop=3),
       PhaseSpan(name='compressed', start=3, stop=6), PhaseSpan(name='sampling', start=6, stop=7),
       PhaseSpan(name='compressed', start=7, stop=10))
    """
    steps = check_int("steps", steps, low=0)
    warmup = check_int("warmup_steps", warmup_steps, low=0)
    sample = check_int("sample_steps", sample_steps)
    cycle = sample + check_int("compressed_steps", compressed_steps)
    runs = [(WARM_UP, 0, warmup)]
    for start in range(warmup, steps, cycle):
        runs += [(SAMPLING, start, start + sample), (COMPRESSED, start + sample, start + cycle)]
    return clipped(runs, steps)
