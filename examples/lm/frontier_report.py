"""The frontier's record, table and Pareto plot (`lm.frontier`).

``frontier.json`` holds ``{"steps": N, "points": [...], "runs": [...]}``:
per point (`points`) its ``name``, ``bytes_per_step``, ``val_bits_per_byte`` (the
validation bits per byte of each seed) and ``settings``; per run its
``name``, ``seed``, ``bytes_per_step``, ``val_bits_per_byte``, its curve
and ``settings``. The table and the plot
show each point's mean over its seeds and the spread (min to max).
"""

from __future__ import annotations

import json
import pathlib

import matplotlib
import numpy as np
from matplotlib.figure import Figure

Runs = dict[tuple[str, int], dict]


def load(path: pathlib.Path, steps: int) -> Runs:
    """The runs kept in ``path`` (none if it does not exist yet).

    Raises:
      ValueError: the file holds runs of another length than ``steps``.
    """
    if not path.exists():
        return {}
    saved = json.loads(path.read_text())
    if saved["steps"] != steps:
        raise ValueError(f"{path} holds runs of {saved['steps']} steps, not {steps}: pass "
                         "another --output-dir or the same --steps")
    return {(r["name"], r["seed"]): r for r in saved["runs"]}


def store(path: pathlib.Path, steps: int, runs: Runs) -> None:
    """Writes every run to ``path`` (a complete file each time)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"steps": steps, "points": points(runs),
                               "runs": list(runs.values())}, indent=1))
    tmp.replace(path)


def points(runs: Runs) -> list[dict]:
    """One entry per point, by bytes per step: its seeds' results, their
    mean and spread, and the change against ``none``'s mean.

    Example:
      >>> runs = {("none", 0): {"name": "none", "seed": 0, "bytes_per_step": 100.0,
      ...                       "val_bits_per_byte": 2.0, "settings": {}},
      ...         ("q", 0): {"name": "q", "seed": 0, "bytes_per_step": 10.0,
      ...                    "val_bits_per_byte": 2.1, "settings": {}}}
      >>> [(p["name"], p["fewer_bytes"], round(p["vs_none"], 3)) for p in points(runs)]
      [('q', 10.0, 0.05), ('none', 1.0, 0.0)]
    """
    by_name: dict[str, list[dict]] = {}
    for run in runs.values():
        by_name.setdefault(run["name"], []).append(run)
    base = by_name.get("none")
    ref = np.mean([r["val_bits_per_byte"] for r in base]) if base else None
    ref_bytes = np.mean([r["bytes_per_step"] for r in base]) if base else None
    out = []
    for name, seeds in by_name.items():
        vals = [r["val_bits_per_byte"] for r in sorted(seeds, key=lambda r: r["seed"])]
        sent = float(np.mean([r["bytes_per_step"] for r in seeds]))
        out.append({"name": name, "seeds": len(vals), "val_bits_per_byte": vals,
                    "mean": float(np.mean(vals)), "low": min(vals), "high": max(vals),
                    "bytes_per_step": sent, "settings": seeds[0]["settings"],
                    "fewer_bytes": None if ref_bytes is None else float(ref_bytes / sent),
                    "vs_none": None if ref is None else float(np.mean(vals) / ref - 1)})
    return sorted(out, key=lambda p: p["bytes_per_step"])


def table(pts: list[dict], steps: int) -> str:
    """The Markdown table of `points`."""
    lines = [f"Validation bits per byte after {steps} steps, mean over seeds (min to max), "
             "against none's mean; bytes per step and device, measured.", "",
             "| point | bytes / step | fewer than none | bits / byte | vs none | seeds |",
             "|---|---:|---:|---:|---:|---:|"]
    for p in pts:
        spread = f" ({p['low']:.3f} to {p['high']:.3f})" if p["seeds"] > 1 else ""
        fewer = "-" if p["fewer_bytes"] is None else f"{p['fewer_bytes']:.1f}x"
        vs = "-" if p["vs_none"] is None else f"{100 * p['vs_none']:+.1f}%"
        lines.append(f"| {p['name']} | {p['bytes_per_step']:,.0f} | {fewer} | "
                     f"{p['mean']:.3f}{spread} | {vs} | {p['seeds']} |")
    return "\n".join(lines) + "\n"


def gaps(runs: Runs) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per point, the evaluation steps and its mean curve over seeds against
    ``none``'s mean curve, as a fraction (``+0.05``: 5% more bits per byte):
    whether a gap closes with training.

    Example:
      >>> runs = {("none", 0): {"name": "none", "seed": 0, "curve": [[0, 4.0], [10, 2.0]]},
      ...         ("q", 0): {"name": "q", "seed": 0, "curve": [[0, 4.0], [10, 2.2]]}}
      >>> steps, gap = gaps(runs)["q"]
      >>> steps.tolist(), gap.round(3).tolist()
      ([0.0, 10.0], [0.0, 0.1])
    """
    curves: dict[str, list[list[float]]] = {}
    steps: dict[str, np.ndarray] = {}
    for run in runs.values():
        curves.setdefault(run["name"], []).append([v for _, v in run["curve"]])
        steps[run["name"]] = np.array([s for s, _ in run["curve"]], dtype=float)
    if "none" not in curves:
        return {}
    ref = np.mean(curves["none"], axis=0)
    return {name: (steps[name], np.mean(c, axis=0) / ref - 1) for name, c in curves.items()
            if len(steps[name]) == len(ref)}


def gap_table(runs: Runs) -> str:
    """The Markdown table of `gaps` at a third, two thirds and the end of the run."""
    gap = gaps(runs)
    if "none" not in gap:
        return ""
    steps = gap["none"][0]
    at = sorted({int(np.argmin(abs(steps - steps[-1] * f))) for f in (1 / 3, 2 / 3, 1)})
    lines = ["Against none along the run (mean curves over seeds):", "",
             "| point |" + "".join(f" step {steps[i]:.0f} |" for i in at),
             "|---|" + "---:|" * len(at)]
    for name, (_, g) in sorted(gap.items(), key=lambda kv: kv[1][1][-1]):
        lines.append(f"| {name} |" + "".join(f" {100 * g[i]:+.1f}% |" for i in at))
    return "\n".join(lines) + "\n"


def plot_gaps(runs: Runs, path: pathlib.Path, within: float = 0.2) -> None:
    """The change against ``none`` over the run of the points that end within
    ``within`` of it (the others would crowd the plot; the table has them)."""
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    shown = [(name, steps, g) for name, (steps, g) in sorted(
        gaps(runs).items(), key=lambda kv: kv[1][1][-1]) if name != "none" and g[-1] <= within]
    colors = matplotlib.colormaps["tab20"]
    for i, (name, steps, g) in enumerate(shown):
        ax.plot(steps[1:], 100 * g[1:], label=name, color=colors(i % 20),
                ls=("-", "--")[i // 20 % 2])
    ax.axhline(0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("validation bits per byte against none (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(pts: list[dict], path: pathlib.Path, steps: int) -> None:
    """Bits per byte against bytes per step (log x), with the seeds' spread
    and the Pareto front (no point both cheaper and better) joined."""
    fig = Figure(figsize=(8, 5.5))
    ax = fig.subplots()
    x = np.array([p["bytes_per_step"] for p in pts])
    y = np.array([p["mean"] for p in pts])
    err = np.array([[p["mean"] - p["low"] for p in pts], [p["high"] - p["mean"] for p in pts]])
    ax.errorbar(x, y, yerr=err, fmt="o", ms=4, capsize=3)
    for p in pts:
        ax.annotate(p["name"], (p["bytes_per_step"], p["mean"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    front = [i for i in range(len(pts)) if not any(
        x[j] <= x[i] and y[j] < y[i] for j in range(len(pts)) if j != i)]
    ax.plot(x[front], y[front], "--", lw=1, color="grey", label="Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel("bytes per step and device (log)")
    ax.set_ylabel(f"validation bits per byte after {steps} steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(runs: Runs, out: pathlib.Path, steps: int) -> dict[str, pathlib.Path]:
    """``frontier.md``, ``frontier.png`` and ``frontier_gap.png`` (`plot_gaps`)
    in ``out`` from every run."""
    pts = points(runs)
    files = {"table": out / "frontier.md", "plot": out / "frontier.png",
             "gaps": out / "frontier_gap.png"}
    files["table"].write_text(table(pts, steps) + "\n" + gap_table(runs))
    plot(pts, files["plot"], steps)
    plot_gaps(runs, files["gaps"])
    return files
