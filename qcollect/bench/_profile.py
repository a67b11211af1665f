"""Where a compiled step spends its time: device time per XLA operation.

`op_times` runs a compiled program a few times under `jax.profiler.trace`
and sums, per operation of the optimised HLO (a fusion, a copy, a
collective), the time the CPU backend's threads spent in it. With several
simulated devices in one process every device runs every operation, so the
figures are summed over the devices: a step's wall time is at most that sum
over the cores, and a collective's time includes its wait for the slowest
device. The profile is what ``python -m qcollect.bench compile --profile K``
prints (`docs/benchmarks.md`, "Batch or trace").
"""

from __future__ import annotations

import gzip
import json
import pathlib
import re
import tempfile
from collections.abc import Sequence
from typing import Any

import jax

_OPERATION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ", re.M)


def hlo_operations(hlo_text: str) -> set[str]:
    """The names of the operations (``%name = ...``) of an optimised HLO text."""
    return set(_OPERATION.findall(hlo_text))


def op_times(compiled: jax.stages.Compiled, args: Sequence[Any], steps: int = 3
             ) -> list[tuple[str, float]]:
    """``[(operation, ms per step)]``, most first, of ``compiled(*args)``.

    Args:
      compiled: a compiled program (``jax.jit(f).lower(...).compile()``).
      args: its arguments (allocated arrays).
      steps: profiled calls, after one unprofiled warm-up call.

    Returns:
      Every operation of the program that the trace saw, with its total
      device time per call in milliseconds (summed over the devices).
    """
    names = hlo_operations(compiled.as_text())
    jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(compiled(*args))
        trace = next(pathlib.Path(folder).glob("plugins/profile/*/perfetto_trace.json.gz"))
        with gzip.open(trace) as f:
            events = json.load(f)
    if isinstance(events, dict):
        events = events.get("traceEvents", [])
    total: dict[str, float] = {}
    for event in events:
        if event.get("ph") == "X" and event.get("name") in names:
            total[event["name"]] = total.get(event["name"], 0) + float(event.get("dur", 0.0))
    most = sorted(total.items(), key=lambda item: item[1], reverse=True)
    return [(name, us / 1e3 / steps) for name, us in most]


def profile_table(profile: Sequence[tuple[str, float]], top: int) -> str:
    """The ``top`` operations of `op_times` as a markdown table, with the share
    of all operations' time.

    Example:
      >>> print(profile_table([("concatenate_fusion", 30.0), ("ppermute.3", 10.0)], 1))
      | operation | device ms / step | share |
      |---|---:|---:|
      | concatenate_fusion | 30.0 | 75% |
    """
    whole = sum(ms for _, ms in profile) or 1.0
    rows = ["| operation | device ms / step | share |", "|---|---:|---:|"]
    rows += [f"| {name} | {ms:.1f} | {100 * ms / whole:.0f}% |" for name, ms in profile[:top]]
    return "\n".join(rows)
