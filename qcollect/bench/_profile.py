"""Where a compiled step spends its time: device time per XLA operation.

`op_times` runs a compiled program a few times under `jax.profiler.trace`
and sums, per operation of the optimised HLO (a fusion, a copy, a
collective), the time the CPU backend's threads spent in it. With several
simulated devices in one process every device runs every operation, so the
figures are summed over the devices: a step's wall time is at most that sum
over the cores, and a collective's time includes its wait for the slowest
device. On a GPU the kernels' own events, on the device's timeline, count.
The profile is what ``python -m qcollect.bench compile --profile K``
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


def _trace_events(folder: str) -> list[dict[str, Any]]:
    """The events of the Perfetto trace `jax.profiler.trace` wrote into ``folder``."""
    trace = next(pathlib.Path(folder).glob("plugins/profile/*/perfetto_trace.json.gz"))
    with gzip.open(trace) as f:
        events = json.load(f)
    return events.get("traceEvents", []) if isinstance(events, dict) else events


def _key(name: str) -> str:
    """An operation's name as a kernel may carry it (GPU kernels write ``_``
    for the ``.`` and ``-`` of HLO names)."""
    return re.sub(r"[.\-]", "_", name)


def event_times(events: Sequence[dict[str, Any]], names: set[str]) -> dict[str, float]:
    """Microseconds per operation of ``names`` over the complete events.

    An event counts for the operation its ``hlo_op`` argument names, else
    for its own name (as written or with `_key`'s underscores). Events of
    device processes (``/device:...``, a GPU's kernels) count alone when
    any of them matched, so that a kernel's launch on the host does not
    count twice; on a CPU every operation runs in ``/host:CPU``.
    """
    keyed = {_key(n): n for n in names}
    device = {e.get("pid") for e in events if e.get("ph") == "M"
              and e.get("name") == "process_name"
              and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    found: dict[bool, dict[str, float]] = {True: {}, False: {}}
    for e in events:
        if e.get("ph") != "X":
            continue
        raw = (e.get("args") or {}).get("hlo_op") or e.get("name", "")
        op = raw if raw in names else keyed.get(_key(raw))
        if op is not None:
            into = found[e.get("pid") in device]
            into[op] = into.get(op, 0.0) + float(e.get("dur", 0.0))
    return found[True] or found[False]


def op_times(compiled: jax.stages.Compiled, args: Sequence[Any], steps: int = 3
             ) -> list[tuple[str, float]]:
    """``[(operation, ms per step)]``, most first, of ``compiled(*args)``.

    Args:
      compiled: a compiled program (``jax.jit(f).lower(...).compile()``).
      args: its arguments (allocated arrays).
      steps: profiled calls, after one unprofiled warm-up call.

    Returns:
      Every operation of the program that the trace saw (`event_times`),
      with its total device time per call in milliseconds (summed over the
      devices).
    """
    names = hlo_operations(compiled.as_text())
    jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(compiled(*args))
        events = _trace_events(folder)
    most = sorted(event_times(events, names).items(), key=lambda item: item[1], reverse=True)
    return [(name, us / 1e3 / steps) for name, us in most]


def profile_table(profile: Sequence[tuple[str, float]], top: int, total: float | None = None,
                  digits: int = 1) -> str:
    """The ``top`` operations of `op_times` as a markdown table, with the share
    of all operations' time (``total`` ms, when ``profile`` holds only some
    of them), ms to ``digits`` decimals.

    Example:
      >>> print(profile_table([("concatenate_fusion", 30.0), ("ppermute.3", 10.0)], 1))
      | operation | device ms / step | share |
      |---|---:|---:|
      | concatenate_fusion | 30.0 | 75% |
    """
    whole = (sum(ms for _, ms in profile) if total is None else total) or 1.0
    rows = ["| operation | device ms / step | share |", "|---|---:|---:|"]
    rows += [f"| {name} | {ms:.{digits}f} | {100 * ms / whole:.0f}% |"
             for name, ms in profile[:top]]
    return "\n".join(rows)
