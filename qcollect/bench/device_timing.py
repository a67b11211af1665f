"""Timing on a device, as the device benchmark and its example programs do it.

`medians` times compiled calls as `qcollect.bench.device` reports them:
medians of interleaved repetitions (`qcollect.bench._timing`), each timed
call dispatching its program back to back and waiting for the last, as many
times as fit in `BATCH_SECONDS` (at most ``calls``), so that the dispatch
latency of one call (tens of microseconds, as long as a 64M-value kernel on
a GPU) is spread over them. `Clock` is a run's time budget, `profile_of`
the device time per operation of a compiled call, and `failure` the one
line a row or part that failed says in its place.

``examples/lm/step_time.py`` (the language model's step of the device
benchmark, run as a program of the checkout) times its steps with these, so
its rows and the benchmark's own are measured alike.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax

from qcollect.bench._timing import Call, interleaved_medians, time_once

__all__ = ["BATCH_SECONDS", "Call", "Clock", "Say", "failure", "medians", "profile_of"]

#: A timed call is repeated back to back up to about this long (`medians`).
BATCH_SECONDS = 0.01
#: Prints a progress line.
Say = Callable[[str], None]


@dataclasses.dataclass
class Clock:
    """The run's time budget: `out` once ``budget`` seconds have passed
    since ``start``.

    Example:
      >>> clock = Clock(budget=60.0)
      >>> clock.out()
      False
      >>> Clock(budget=1.0, start=time.perf_counter() - 2.0).out()   # 2 s already spent
      True
    """

    budget: float
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.start

    def out(self) -> bool:
        """Whether the budget is spent."""
        return self.elapsed() > self.budget

    def why(self) -> str:
        """What a row skipped for time says."""
        return f"not measured: the run's {self.budget:g} s budget (--budget) was spent"


def _repeated(fn: Callable[..., Any], calls: int) -> Callable[..., Any]:
    """``fn`` dispatched ``calls`` times back to back; the last result."""

    def run(*args: Any) -> Any:
        out = fn(*args)
        for _ in range(calls - 1):
            out = fn(*args)
        return out

    return run


def medians(timed: dict[str, Call], repeats: int, calls: int) -> dict[str, float]:
    """Median seconds of one call of each of ``timed``: each runs back to
    back as many times as fit in `BATCH_SECONDS` (1 to ``calls``), once
    compiled, in ``repeats`` interleaved repetitions.

    Example:
      >>> import jax.numpy as jnp
      >>> seconds = medians({"double": (jax.jit(lambda v: 2 * v), (jnp.ones(8),))}, 3, 2)
      >>> list(seconds), seconds["double"] > 0
      (['double'], True)
    """
    counts = {}
    for name, (fn, args) in timed.items():
        jax.block_until_ready(fn(*args))
        once = time_once(fn, *args)
        counts[name] = max(1, min(calls, int(BATCH_SECONDS / max(once, 1e-9))))
    batched = {name: (_repeated(fn, counts[name]), args) for name, (fn, args) in timed.items()}
    return {name: s / counts[name] for name, s in interleaved_medians(batched, repeats).items()}


def failure(err: BaseException) -> str:
    """One line saying what failed (a part's or a row's ``error``).

    Example:
      >>> failure(ValueError("no such codec here\\nmore detail"))
      'ValueError: no such codec here'
    """
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


def profile_of(fn: Callable[..., Any], args: tuple[Any, ...], top: int) -> dict[str, Any]:
    """The ``top`` operations of a jitted call by device time
    (`qcollect.bench._profile.op_times`) and all operations' total, or
    what failed."""
    from qcollect.bench._profile import op_times

    try:
        ops = op_times(fn.lower(*args).compile(), args)  # type: ignore[attr-defined]
    except Exception as err:  # noqa: BLE001 - a profiler missing on the device
        return {"error": failure(err)}
    return {"top": [list(op) for op in ops[:top]], "total_ms": sum(ms for _, ms in ops)}
