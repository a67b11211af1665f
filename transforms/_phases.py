"""The phases of a run: which steps a phased transformation spends in which phase.

Each phased transformation owns one `Schedule`: `CompressAfter` for the
exact steps first of `transforms.compressed_all_reduce` and
`transforms.powersgd` (and the variance freeze of `transforms.frozen_adamw`),
GradiVeQ's cycle (`transforms._gradiveq_cycle`), DiLoCo's rounds. The
transformation reads ``at(count)`` inside the step, picks its branch in a
``lax.cond`` and marks each branch with the phases it serves
(`qcollect.phase`), so `qcollect.wire_bytes_by_phase` measures each phase of
a compiled step by name; ``spans(steps)`` says which steps of a run fall in
which phase, as `PhaseSpan` runs under the same names: together, what a run
sends. The names: ``"exact"`` (uncompressed steps first), ``"lead-in"``
(GradiVeQ's steps before its first cycle), ``"sampling"``, ``"compressed"``,
and DiLoCo's ``"inner"`` and ``"outer"``; none is the learning rate's warm-up.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

import qcollect as qc
from qcollect.checks import check_int

__all__ = ["COMPRESSED", "EXACT", "INNER", "LEAD_IN", "OUTER", "POWERSGD_COMPRESS_AFTER",
           "SAMPLING",
           "CompressAfter", "PhaseSpan", "Schedule", "as_schedule", "clipped",
           "powersgd_phases", "steps_per_phase", "warm_up_phases"]

#: The phase names the transformations mark and schedule.
EXACT = "exact"            # exact (uncompressed) steps first: ``compress_after``
LEAD_IN = "lead-in"        # GradiVeQ's steps before its first cycle (sample compressor)
SAMPLING = "sampling"      # GradiVeQ's steps that sample the sums for the next fit
COMPRESSED = "compressed"  # the compressor the transformation is named for
INNER = "inner"            # DiLoCo's steps of each worker alone
OUTER = "outer"            # DiLoCo's steps with an outer (fragment) step

#: `transforms.powersgd`'s default ``compress_after`` (docs/transforms.md says why).
POWERSGD_COMPRESS_AFTER = 10


class PhaseSpan(NamedTuple):
    """Steps ``start .. stop - 1`` of a run, all in phase ``name``."""

    name: str
    start: int
    stop: int


def clipped(runs: Iterable[tuple[str, int, int]], steps: int) -> tuple[PhaseSpan, ...]:
    """``(name, start, stop)`` runs cut to steps ``0 .. steps - 1``, empty ones dropped.

    Example:
      >>> clipped([("exact", 0, 10), ("compressed", 10, 300)], 5)
      (PhaseSpan(name='exact', start=0, stop=5),)
    """
    out = (PhaseSpan(name, max(start, 0), min(stop, steps)) for name, start, stop in runs)
    return tuple(span for span in out if span.start < span.stop)


class Schedule(Protocol):
    """What every phased transformation's schedule gives: ``at(count)``, the
    step's traced per-step flags (equal on every device), and
    ``spans(steps)``, the phases of a run's steps ``0 .. steps - 1`` on the
    host under the names the transformation marks its branches with
    (`qcollect.wire_bytes_by_phase`): together, what a run sends."""

    def at(self, count: jax.Array | int) -> Any:
        """The flags of step ``count`` (traced or concrete)."""

    def spans(self, steps: int) -> tuple[PhaseSpan, ...]:
        """The `PhaseSpan` runs of a run of ``steps`` steps."""


@dataclasses.dataclass(frozen=True)
class CompressAfter:
    """Exact steps first: steps ``0 .. steps - 1`` send the exact mean
    (phase ``"exact"``), the rest go through the compressor
    (``"compressed"``). The one schedule of ``compress_after`` in
    `transforms.compressed_all_reduce`, `transforms.onebit_adam` and
    `transforms.powersgd`, and of ``freeze_after`` in
    `transforms.frozen_adamw`: pass one value to both and 1-bit Adam's pair
    cannot disagree (Tang et al. 2021, section 3).

    A warm-up compressor (``warm_up=qc.cast("bfloat16")`` or
    ``qc.qsgd(bits=8)``, which hold the loss where 2-bit and 1-bit do not)
    sends the first steps' mean through it instead of float32, without error
    feedback; those steps are then the phase ``"lead-in"``. The all-reduces
    take it (not `transforms.powersgd`); the variance freeze reads the steps.
    Before a variance freeze prefer ``cast("bfloat16")``: it keeps every
    value's relative precision, while a quantizer rounds small values to
    zero, and a value zero in every warm-up step freezes Adam's ``v`` at 0,
    so its later steps are ``m / eps`` (the language model of ``examples/lm``
    diverged two steps after a ``qsgd(bits=8)`` warm-up, and trained after a
    bfloat16 one).

    Attributes:
      steps: exact steps first, >= 0.
      warm_up: the compressor of those steps, or None (default: exact, the
        gradients' own dtypes).

    Example:
      >>> import transforms
      >>> warm = transforms.CompressAfter(120)
      >>> warm.spans(600)   # doctest: +NORMALIZE_WHITESPACE
      (PhaseSpan(name='exact', start=0, stop=120),
       PhaseSpan(name='compressed', start=120, stop=600))
      >>> bool(warm.at(119)), bool(warm.at(120))   # True: an exact step
      (True, False)
    """

    steps: int
    warm_up: Any = None

    def __post_init__(self) -> None:
        check_int("compress_after", self.steps, low=0)
        if self.warm_up is not None and not isinstance(self.warm_up, qc.Compressor):
            raise ValueError(f"warm_up must be a qcollect Compressor or None (exact), got "
                             f"{self.warm_up!r}")

    @property
    def first(self) -> str:
        """The name of the first steps' phase: ``"exact"``, or ``"lead-in"``
        with a warm-up compressor."""
        return EXACT if self.warm_up is None else LEAD_IN

    def at(self, count: jax.Array | int) -> jax.Array:
        """Whether step ``count`` is one of the first steps (a bool scalar)."""
        return jnp.asarray(count) < self.steps

    def spans(self, steps: int) -> tuple[PhaseSpan, ...]:
        """`first` then ``"compressed"`` over steps ``0 .. steps - 1``."""
        steps = check_int("steps", steps, low=0)
        return clipped([(self.first, 0, self.steps), (COMPRESSED, self.steps, steps)], steps)


def as_schedule(compress_after: object, name: str = "compress_after") -> CompressAfter:
    """``compress_after`` as a `CompressAfter`: an int ``K >= 0`` or one already.

    Raises:
      ValueError: neither, naming ``name``.
    """
    if isinstance(compress_after, CompressAfter):
        return compress_after
    return CompressAfter(check_int(name, compress_after, low=0))


def steps_per_phase(schedule: Iterable[PhaseSpan]) -> dict[str, int]:
    """Steps in each phase of a schedule of `PhaseSpan`, in order of first appearance.

    Args:
      schedule: `PhaseSpan` runs, e.g. ``CompressAfter(K).spans(steps)`` or
        `gradiveq_phases`.

    Returns:
      Phase name -> number of steps.

    Example:
      >>> import transforms
      >>> transforms.steps_per_phase(transforms.CompressAfter(10).spans(300))
      {'exact': 10, 'compressed': 290}
    """
    out: dict[str, int] = {}
    for span in schedule:
        out[span.name] = out.get(span.name, 0) + span.stop - span.start
    return out


def warm_up_phases(steps: int, *, compress_after: int | None = None,
                   start_iter: int | None = None) -> tuple[PhaseSpan, ...]:
    """Deprecated (also as ``powersgd_phases``):
    ``transforms.CompressAfter(compress_after).spans(steps)``; ``start_iter``
    is the older name of ``compress_after`` (default 10, PowerSGD's)."""
    warnings.warn("warm_up_phases and powersgd_phases are deprecated: use "
                  "transforms.CompressAfter(K).spans(steps)", DeprecationWarning, stacklevel=2)
    first = compress_after if compress_after is not None else start_iter
    return as_schedule(POWERSGD_COMPRESS_AFTER if first is None else first).spans(steps)


powersgd_phases = warm_up_phases
