"""0/1 Adam's two schedules: when the variance is refreshed and when the workers synchronise.

Lu et al., "Maximizing Communication Efficiency for Large-scale Training via
0/1 Adam" (ICLR 2023, arXiv:2202.06009), section 4 and Algorithm 1, replace
1-bit Adam's long exact warm-up by two step sets, both pure functions of
the step count here (`ZeroOneSchedule.at`):

* ``T_v``, the variance refreshes (``refresh``): before ``freeze_after`` the
  variance is updated on an exact gradient mean at steps whose spacing
  doubles after every ``refreshes`` of them (1, 1, ... then 2, 2, ... then
  4, ...): DeepSpeed's ``var_update_scaler``. From ``freeze_after`` on it
  stays frozen.
* ``T_u``, the synchronisations (``sync``): every step before
  ``freeze_after``; after it the workers take local steps between syncs,
  the spacing doubling after every ``syncs_per_spacing`` of them up to
  ``local_steps`` (H): DeepSpeed's ``local_step_clipper``.

Where this deviates from DeepSpeed's ``ZeroOneAdam`` (all for a schedule
that is a function of the count alone, so `spans` can say what a run sends):
its spacings double on counters kept in the optimizer state and its local
spacing after a fixed number of steps (``local_step_scaler``); here each
spacing holds a fixed number of refreshes or syncs, refreshes fall on the
first step of their spacing (step 0 refreshes, so the variance starts from
an exact gradient) and syncs on the last.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qcollect as qc
from qcollect.checks import check_int
from transforms._phases import COMPRESSED, EXACT, INNER, LEAD_IN, PhaseSpan, clipped

__all__ = ["ZeroOneSchedule", "ZeroOneStep"]


class ZeroOneStep(NamedTuple):
    """What `transforms.zero_one_adam` does at one step (bool scalars or arrays).

    Attributes:
      refresh: the step averages the gradients exactly and updates the
        variance (``t`` in ``T_v``; phase ``"exact"``).
      sync: the workers synchronise their accumulated momenta through the
        compressed all-reduce (``t`` in ``T_u``; phase ``"compressed"``,
        unless it refreshes). A step that does neither is local (``"inner"``).
    """

    refresh: jax.Array
    sync: jax.Array


def _on_spacing(n: jax.Array, per: int, cap: int | None, last: bool) -> jax.Array:
    """Whether step ``n >= 0`` of a run of doubling spacings is marked:
    ``per`` spacings of 1 step, then ``per`` of 2, of 4, ... (at most
    ``cap``, then spacings of ``cap`` for ever); the first or the ``last``
    step of each spacing is marked."""
    levels = 31 if cap is None else (cap - 1).bit_length()
    n = jnp.asarray(n, jnp.int32)
    q = jnp.minimum(31 - lax.clz(jnp.minimum(n // per, 2**30) + 1), levels)
    start = per * ((jnp.left_shift(1, q)) - 1)
    length = jnp.left_shift(1, q) if cap is None else jnp.minimum(jnp.left_shift(1, q), cap)
    return (n - start + (1 if last else 0)) % length == 0


@dataclasses.dataclass(frozen=True)
class ZeroOneSchedule:
    """0/1 Adam's variance refreshes and synchronisations (module docstring).

    Attributes:
      freeze_after: F, the step from which the variance is frozen and local
        steps begin (>= 1).
      refreshes: kappa, variance refreshes per spacing before it doubles (>= 1).
      local_steps: H, the largest spacing of syncs after F (>= 1; 1: a sync
        every step, 1-bit Adam with refreshes).
      syncs_per_spacing: syncs at each spacing after F before it doubles (>= 1).
      refresh_compressor: what a refresh's gradient mean goes through, or
        None (default: exact float32). ``qc.cast("bfloat16")`` halves the
        refreshes' bytes, most of what 0/1 Adam sends; the refreshes are
        then the phase ``"lead-in"``. As for `transforms.CompressAfter`'s
        warm-up, prefer bfloat16 to a quantizer, which rounds small values
        to zero and so freezes the variance at 0 there.

    Example:
      >>> import transforms
      >>> s = transforms.ZeroOneSchedule(freeze_after=8, refreshes=2, local_steps=4,
      ...                                syncs_per_spacing=1)
      >>> s.spans(16)   # doctest: +NORMALIZE_WHITESPACE
      (PhaseSpan(name='exact', start=0, stop=3), PhaseSpan(name='compressed', start=3, stop=4),
       PhaseSpan(name='exact', start=4, stop=5), PhaseSpan(name='compressed', start=5, stop=6),
       PhaseSpan(name='exact', start=6, stop=7), PhaseSpan(name='compressed', start=7, stop=9),
       PhaseSpan(name='inner', start=9, stop=10), PhaseSpan(name='compressed', start=10, stop=11),
       PhaseSpan(name='inner', start=11, stop=14), PhaseSpan(name='compressed', start=14, stop=15),
       PhaseSpan(name='inner', start=15, stop=16))
    """

    freeze_after: int
    refreshes: int = 16
    local_steps: int = 16
    syncs_per_spacing: int = 16
    refresh_compressor: Any = None

    def __post_init__(self) -> None:
        check_int("freeze_after", self.freeze_after, low=1)
        check_int("refreshes", self.refreshes, low=1)
        check_int("local_steps", self.local_steps, low=1)
        check_int("syncs_per_spacing", self.syncs_per_spacing, low=1)
        if self.refresh_compressor is not None and not isinstance(self.refresh_compressor,
                                                                  qc.Compressor):
            raise ValueError(f"refresh_compressor must be a qcollect Compressor or None "
                             f"(exact), got {self.refresh_compressor!r}")

    @property
    def refresh_phase(self) -> str:
        """The refreshes' phase: ``"exact"``, or ``"lead-in"`` through a compressor."""
        return EXACT if self.refresh_compressor is None else LEAD_IN

    def at(self, count: jax.Array | int) -> ZeroOneStep:
        """The flags of step ``count`` (a scalar or an array of counts)."""
        count = jnp.asarray(count, jnp.int32)
        before = count < self.freeze_after
        refresh = before & _on_spacing(count, self.refreshes, None, last=False)
        after = jnp.maximum(count - self.freeze_after, 0)
        sync = before | _on_spacing(after, self.syncs_per_spacing, self.local_steps, last=True)
        return ZeroOneStep(refresh, sync)

    def spans(self, steps: int) -> tuple[PhaseSpan, ...]:
        """The phases of steps ``0 .. steps - 1``: ``"exact"`` (a refresh;
        `refresh_phase`), ``"compressed"`` (a sync) and ``"inner"`` (a local step)."""
        steps = check_int("steps", steps, low=0)
        flags = self.at(np.arange(steps, dtype=np.int32))
        refresh, sync = np.asarray(flags.refresh), np.asarray(flags.sync)
        names = np.where(refresh, self.refresh_phase, np.where(sync, COMPRESSED, INNER))
        cuts = [0, *(np.flatnonzero(names[1:] != names[:-1]) + 1).tolist(), steps]
        return clipped([(str(names[a]), a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True)
                        if a < b], steps)
