"""GradiVeQ's cycle: the schedule of phases and the compressors fitted on samples.

Yu et al., GradiVeQ (section 3, "System Overview"): after ``warmup_steps``,
cycles of ``L_t`` sampling steps, whose aggregated gradients are sampled
slice by slice (`record_samples`), and ``L_c`` compressed steps; after the
last sampling step the PCA compressors are fitted on the samples (`fit`,
eq. 6). `GradiVeQCycle.phase` says where a step falls, from the step count alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

import qcollect as qc
from qcollect.checks import check_int
from transforms._phases import COMPRESSED, LEAD_IN, SAMPLING, PhaseSpan, clipped

__all__ = ["GradiVeQCycle", "LeafPlan", "Phase", "fill_invalid", "fit", "gradiveq_phases",
           "record_samples", "refreshed", "sample_rows"]


class Phase(NamedTuple):
    """Where one step falls in the `Schedule`: traced scalars, equal on all devices.

    Warm-up steps neither sample nor compress.
    """

    sampling: jax.Array     # bool: one of the cycle's L_t sampling steps
    compressing: jax.Array  # bool: one of the cycle's L_c compressed steps
    slot: jax.Array         # int32: the sample slot a sampling step writes
    fits: jax.Array         # bool: the last sampling step, after which the compressors are fitted
    ends: jax.Array         # bool: the last compressed step of the cycle


@dataclasses.dataclass(frozen=True)
class GradiVeQCycle:
    """GradiVeQ's static schedule (a `transforms._phases.Schedule`):
    ``warmup_steps`` lead-in steps, then cycles of ``sample_steps``
    (``L_t``) sampling steps and ``compressed_steps`` (``L_c``) compressed
    steps (section 3, "System Overview")."""

    warmup_steps: int
    sample_steps: int
    compressed_steps: int

    @classmethod
    def checked(cls, warmup_steps: int, sample_steps: int,
                compressed_steps: int) -> GradiVeQCycle:
        """The schedule, its settings checked (ValueError naming the first bad one)."""
        return cls(check_int("warmup_steps", warmup_steps, low=0),
                   check_int("sample_steps", sample_steps),
                   check_int("compressed_steps", compressed_steps))

    @property
    def cycle(self) -> int:
        return self.sample_steps + self.compressed_steps

    def at(self, count: jax.Array | int) -> Phase:
        """The phase of step ``count`` when no cycle ended early (no ``stop_loss``)."""
        return self.phase(jnp.asarray(count, jnp.int32),
                          jnp.asarray(self.warmup_steps, jnp.int32))

    def spans(self, steps: int) -> tuple[PhaseSpan, ...]:
        """``"lead-in"``, then cycles of ``"sampling"`` and ``"compressed"``
        over steps ``0 .. steps - 1`` (exact without ``stop_loss``)."""
        steps = check_int("steps", steps, low=0)
        runs = [(LEAD_IN, 0, self.warmup_steps)]
        for start in range(self.warmup_steps, steps, self.cycle):
            runs += [(SAMPLING, start, start + self.sample_steps),
                     (COMPRESSED, start + self.sample_steps, start + self.cycle)]
        return clipped(runs, steps)

    def phase(self, count: jax.Array, cycle_start: jax.Array) -> Phase:
        """The phase of step ``count`` in the cycle that began at ``cycle_start``."""
        since = count - cycle_start
        position = jnp.mod(jnp.maximum(since, 0), self.cycle)
        started = since >= 0
        sampling = started & (position < self.sample_steps)
        compressing = started & (position >= self.sample_steps)
        return Phase(sampling=sampling, compressing=compressing,
                     slot=jnp.clip(position, 0, self.sample_steps - 1),
                     fits=sampling & (position == self.sample_steps - 1),
                     ends=compressing & (position == self.cycle - 1))


class LeafPlan(NamedTuple):
    """How one compressed leaf is sliced and sampled (section 3)."""

    slice_size: int    # K
    columns: int       # r, static basis width
    sampled: int       # s, slices sampled per step
    num_slices: int    # full slices in the leaf


def refreshed(mine: dict[str, list[Any]], sums: list[jax.Array], plans: list[LeafPlan],
              valid: jax.Array, phase: Phase, finite: jax.Array, *, rank: int | None,
              loss_threshold: float | None) -> dict[str, list[Any]]:
    """The compressed leaves' next samples (written on a finite sampling
    step) and compressors (refitted after the cycle's last sampling step),
    name -> list, from their current entries ``mine``."""
    samples = record_samples(mine["samples"], sums, plans, phase, finite)
    old = (mine["basis"], mine["mean"], mine["rank"])
    fitted = lax.cond(phase.fits & jnp.any(valid),
                      lambda: fit(samples, valid, plans, rank=rank, loss_threshold=loss_threshold),
                      lambda: old)
    return {"samples": samples, **dict(zip(("basis", "mean", "rank"), fitted, strict=True))}


def record_samples(samples: list[jax.Array], sums: list[jax.Array], plans: list[LeafPlan],
                   phase: Phase, finite: jax.Array) -> list[jax.Array]:
    """Each leaf's sample buffer with its sampled slices written in this step's
    slot, on a sampling step with finite gradients."""
    write = phase.sampling & finite
    out = []
    for buffer, total, plan in zip(samples, sums, plans, strict=True):
        rows = sample_rows(total.reshape(-1), plan)
        written = lax.dynamic_update_index_in_dim(buffer, rows, phase.slot, 0)
        out.append(jnp.where(write, written, buffer))
    return out


def sample_rows(flat: jax.Array, leaf: LeafPlan) -> jax.Array:
    """The ``s`` evenly spaced full slices of a flat leaf, concatenated: ``(s * K,)``."""
    k = leaf.slice_size
    starts = [(j * leaf.num_slices) // leaf.sampled * k for j in range(leaf.sampled)]
    return jnp.concatenate([flat[a:a + k] for a in starts])


def fit(samples: list[jax.Array], valid: jax.Array, plans: list[LeafPlan], *,
        rank: int | None, loss_threshold: float | None
        ) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
    """``(bases, means, ranks)``: eq. (6) fitted to each leaf's sample buffer."""
    bases, means, ranks = [], [], []
    for buffer, plan in zip(samples, plans, strict=True):
        result = qc.pca_fit(fill_invalid(buffer, valid), slice_size=plan.slice_size,
                            rank=rank, loss_threshold=loss_threshold,
                            max_rank=None if rank is not None else plan.columns,
                            slices="all")
        bases.append(result.basis.astype(jnp.float32))
        means.append(result.mean.astype(jnp.float32))
        ranks.append(jnp.asarray(result.rank, jnp.int32))
    return bases, means, ranks


def fill_invalid(samples: jax.Array, valid: jax.Array) -> jax.Array:
    """Rows of slots without a sample replaced by copies of valid rows (cyclically)."""
    slots = valid.shape[0]
    order = jnp.argsort(jnp.logical_not(valid), stable=True)   # valid slots first
    nvalid = jnp.maximum(jnp.sum(valid.astype(jnp.int32)), 1)
    rank_of = jnp.cumsum(jnp.logical_not(valid).astype(jnp.int32)) - 1
    source = jnp.where(valid, jnp.arange(slots), order[jnp.mod(rank_of, nvalid)])
    return samples[source]


def gradiveq_phases(steps: int, *, warmup_steps: int = 0, sample_steps: int = 100,
                    compressed_steps: int = 400) -> tuple[PhaseSpan, ...]:
    """Which of a run's steps ``0 .. steps - 1`` a `transforms.gradiveq` with
    these settings (and its defaults) spends in which phase:
    ``"lead-in"``, then cycles of ``"sampling"`` and ``"compressed"`` steps
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
      (PhaseSpan(name='lead-in', start=0, stop=2), PhaseSpan(name='sampling', start=2, stop=3),
       PhaseSpan(name='compressed', start=3, stop=6), PhaseSpan(name='sampling', start=6, stop=7),
       PhaseSpan(name='compressed', start=7, stop=10))
    """
    return GradiVeQCycle.checked(warmup_steps, sample_steps, compressed_steps).spans(steps)
