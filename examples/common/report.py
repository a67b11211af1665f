"""Results of the example runs: the table, the plot, and a JSON record."""

from __future__ import annotations

import dataclasses
import json
import pathlib

from matplotlib.figure import Figure

import qcollect as qc

BASELINE = "none"


def ratio(result, baseline_bytes: int | None) -> float:
    """Compression on the wire: baseline bytes / this run's bytes per step."""
    if not baseline_bytes or not result.wire_bytes:
        return float("nan")
    return baseline_bytes / result.wire_bytes


def across_nodes(result) -> int | None:
    """Bytes per step and device that cross between nodes (collectives over
    ``node`` or over ``node,local``); None on a one-axis mesh."""
    split = result.wire_bytes_by_axis
    if not any("node" in axes.split(",") for axes in split):
        return None
    return qc.bytes_along(split, "node")


def axis_table(results) -> str | None:
    """Bytes per step and device on each mesh axis (``RunResult.wire_bytes_by_axis``)
    and the data axis's ratio to the ``none`` run's; None on a one-axis mesh.

    On a ``(data, model)`` mesh the model axis carries the model's own
    collectives (the compiler's, for the sharded matmuls) and the data axis
    the gradients' all-reduce.

    Example:
      >>> from common.train import RunResult
      >>> runs = [RunResult("none", [], [], [], 0, 0, 0.0, 0.0), RunResult(
      ...     "qsgd-4", [], [], [], 0, 0, 0.0, 0.0)]
      >>> runs[0].wire_bytes_by_axis = {"data": 800, "model": 50}
      >>> runs[1].wire_bytes_by_axis = {"data": 100, "model": 50}
      >>> print(axis_table(runs))
      | compressor | data | model | data vs none |
      |---|---|---|---|
      | none | 800 | 50 | 1.0x |
      | qsgd-4 | 100 | 50 | 8.0x |
    """
    axes = sorted({a for r in results for a in r.wire_bytes_by_axis},
                  key=lambda a: (a != "data", a))
    if len(axes) < 2:
        return None
    base = next((r.wire_bytes_by_axis.get("data") for r in results if r.name == BASELINE),
                None)
    rows = ["| compressor | " + " | ".join(axes) + " | data vs none |",
            "|---" * (len(axes) + 2) + "|"]
    for r in results:
        data = r.wire_bytes_by_axis.get("data", 0)
        vs = f"{base / data:.1f}x" if base and data else "-"
        rows.append(f"| {r.name} | " + " | ".join(f"{r.wire_bytes_by_axis.get(a, 0):,}"
                                                 for a in axes) + f" | {vs} |")
    return "\n".join(rows)


def phase_text(result) -> str | None:
    """Which phase a phased run spent how many steps in, and each phase's
    measured bytes per step and device (``RunResult.phases`` and
    ``RunResult.wire_bytes_by_phase``); None for a run of one phase.
    Phases the step holds but the run never reached count 0 steps.

    Example:
      >>> from common.train import RunResult
      >>> r = RunResult("powersgd", [], [], [], 1_000, 20_000, 0.0, 0.0)
      >>> r.wire_bytes_by_phase = {"compressed": 1_000, "exact": 20_000}
      >>> r.phases = [["exact", 0, 10], ["compressed", 10, 600]]
      >>> phase_text(r)
      '10 exact steps at 20,000; 590 compressed at 1,000'
      >>> r.phases = [["exact", 0, 300]]
      >>> phase_text(r)
      '300 exact steps at 20,000; 0 compressed at 1,000'
    """
    sent = result.wire_bytes_by_phase
    if len(sent) < 2 or not result.phases:
        return None
    steps: dict[str, int] = {}
    for name, start, stop in result.phases:
        steps[name] = steps.get(name, 0) + stop - start
    if not set(steps) <= set(sent):
        return None  # a schedule the step's marks do not name
    for name in sent:
        steps.setdefault(name, 0)
    parts = [f"{count} {name}" + ("" if i else " step" if count == 1 else " steps")
             + f" at {sent[name]:,}" for i, (name, count) in enumerate(steps.items())]
    return "; ".join(parts)


def accuracy_column(result) -> str:
    """The MNIST tables' metric: the final test accuracy in percent."""
    return f"{100 * result.final_accuracy:.2f}%"


def table(results, baseline_bytes: int | None, *, metric=("test accuracy", accuracy_column),
          extra=(), baseline: str = "pmean") -> str:
    """A markdown table: the metric, wire bytes (and those across nodes on a
    ``node,local`` mesh), ratio to ``lax.pmean``, step time. A phased
    all-reduce shows its cheapest phase, then in brackets the steps it spent
    in each phase and their bytes (`phase_text`).

    Args:
      results: `common.train.RunResult` of each run.
      baseline_bytes: ``lax.pmean``'s wire bytes per step (for the ratio).
      metric: ``(header, f(result) -> text)`` of the second column.
      extra: more ``(header, f(result) -> text)`` columns after the wire bytes.
      baseline: the baseline's name in the ratio's header.
    """
    nodes = any(across_nodes(r) is not None for r in results)
    rows = [f"| compressor | {metric[0]} | wire bytes / step / device |"
            + "".join(f" {head} |" for head, _ in extra) + f" vs {baseline} "
            "| bits / value |" + (" across nodes / step / device |" if nodes else "")
            + " median step (ms) | run (s) |",
            "|---|---|---|" + "---|" * len(extra) + "---|---|" + ("---|" if nodes else "")
            + "---|---|"]
    for r in results:
        x = ratio(r, baseline_bytes)
        wire = f"{r.wire_bytes:,}"
        phases = phase_text(r)
        if phases is not None:
            wire += f" ({phases})"
        elif r.wire_bytes_max != r.wire_bytes:
            wire += f" (up to {r.wire_bytes_max:,} in other phases)"
        cross = f" {across_nodes(r) or 0:,} |" if nodes else ""
        more = "".join(f" {column(r)} |" for _, column in extra)
        compression = f"{x:.1f}x | {32 / x:.2f}" if x == x else "- | -"  # nan: sends nothing
        rows.append(f"| {r.name} | {metric[1](r)} | {wire} |{more} {compression} |{cross} "
                    f"{1e3 * r.step_seconds:.1f} | {r.total_seconds:.0f} |")
    return "\n".join(rows)


def plot(results, path, title: str):
    """Test accuracy against step for every run, saved as PNG."""
    fig = Figure(figsize=(7, 4.5), dpi=100)  # no pyplot: leaves the caller's backend alone
    ax = fig.subplots()
    for r in results:
        ax.plot(r.steps, [100 * a for a in r.accuracy], marker=".", label=r.name)
    best = max(max(r.accuracy) for r in results)
    ax.set_ylim(max(0.0, 100 * best - 15), 100 * best + 1)
    ax.set_xlabel("step")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)


def save(results, baseline_bytes, cfg, out_dir, stem: str, title: str) -> dict:
    """Writes ``stem.md`` (table), ``stem.json`` (everything) and ``stem.png``."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = table(results, baseline_bytes,
                 baseline="uncompressed FSDP" if cfg.parallel == "fsdp" else "pmean")
    if cfg.model_parallel > 1:
        text += "\n\nBytes per step and device by mesh axis:\n\n" + axis_table(results)
    (out / f"{stem}.md").write_text(text + "\n")
    record = {"config": dataclasses.asdict(cfg), "baseline_wire_bytes": baseline_bytes,
              "runs": [dataclasses.asdict(r) for r in results]}
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    plot(results, out / f"{stem}.png", title)
    return {"table": out / f"{stem}.md", "json": out / f"{stem}.json", "plot": out / f"{stem}.png"}
