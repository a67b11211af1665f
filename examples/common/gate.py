"""Verdicts and reports of the training gate (`examples/training_gate.py`).

Each training run of the gate becomes a `Row`: whether its loss stayed
finite, its final loss and test accuracy against the uncompressed run
(``none``) of the same model, its median step time against ``none``'s (both
measured in the same process, so the ratio cancels the machine's speed) and
against the ratio a stored baseline run measured, its wire bytes, and a
verdict:

* ``fail`` when any step's loss is not finite;
* ``report`` (unless a loss is not finite) for the compressors in
  `REPORTED` (``threshold``, ``entropy``, ``entropy-c``): their loss is
  reported, not gated;
* ``pass`` when the final loss is at most ``(1 + loss)`` times ``none``'s
  (the target);
* above the target, ``gap`` when the baseline run missed the target too and
  this run's loss ratio is at most ``(1 + loss)`` times the baseline's (a
  known shortfall of the compressor on this model, not a regression); else
  ``fail``;
* a row whose step-time ratio exceeds the baseline's ratio by more than the
  factor ``time`` is flagged ``slower``; with ``fail_on_time`` that fails it.

Example:
  >>> from types import SimpleNamespace as Run
  >>> def run(name, losses):
  ...     return Run(name=name, losses=losses, accuracy=[0.1, 0.9], steps=[0, 20],
  ...                step_seconds=0.01, wire_bytes=100, wire_bytes_max=100,
  ...                total_seconds=1.0, compiles=1)
  >>> rows = judge("mlp-64", [run("none", [1.0] * 20), run("onebit", [1.3] * 20)],
  ...              Tolerances())
  >>> [(r.compressor, r.verdict) for r in rows]
  [('none', 'pass'), ('onebit', 'fail')]
  >>> known = {("mlp-64", "onebit"): Reference(time_ratio=1.0, loss_ratio=1.25)}
  >>> [r.verdict for r in judge("mlp-64", [run("none", [1.0] * 20), run("onebit", [1.3] * 20)],
  ...                           Tolerances(), known)]
  ['pass', 'gap']
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import NamedTuple

import numpy as np

BASELINE = "none"
REPORTED = ("threshold", "entropy")


class Reference(NamedTuple):
    """What the baseline run measured for one (model, compressor) row: its
    step-time and final-loss ratios to ``none`` (None where not measured)."""

    time_ratio: float | None
    loss_ratio: float | None


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """What the gate accepts.

    Attributes:
      loss: a gated row fails when its final loss exceeds ``(1 + loss)``
        times the final loss of ``none``.
      time: a row is ``slower`` when its step-time ratio to ``none`` exceeds
        the baseline's ratio times ``time``.
      fail_on_time: a ``slower`` gated row fails.
    """

    loss: float = 0.10
    time: float = 1.25
    fail_on_time: bool = False

    def __post_init__(self):
        if not self.loss >= 0:
            raise ValueError(f"loss tolerance must be >= 0, got {self.loss!r}")
        if not self.time >= 1:
            raise ValueError(f"time tolerance must be >= 1, got {self.time!r}")


@dataclasses.dataclass
class Row:
    """One (model, compressor) run of the gate; ratios and differences are
    against ``none`` of the same model (NaN where not measured)."""

    model: str
    compressor: str
    finite: bool
    final_loss: float
    loss_window: int
    loss_ratio: float
    baseline_loss_ratio: float | None
    accuracy: float
    accuracy_pp: float
    step_ms: float
    time_ratio: float
    baseline_time_ratio: float | None
    time_change: float | None
    slower: bool
    wire_bytes: int
    wire_bytes_max: int
    verdict: str
    reasons: list
    losses: list
    eval_steps: list
    accuracies: list
    total_seconds: float
    compiles: int


def reported_only(name: str) -> bool:
    """True for the compressors the gate reports without a loss verdict."""
    return name in REPORTED or name.startswith("entropy-")


def loss_window(steps: int) -> int:
    """Steps the final loss averages: the last 10%, at least 10 (all when fewer)."""
    return min(steps, max(10, math.ceil(steps / 10)))


def final_loss(losses) -> float:
    """Mean training loss of the last `loss_window` steps (NaN when none ran)."""
    if not len(losses):
        return float("nan")
    return float(np.mean(losses[-loss_window(len(losses)):]))


def _ratio(a: float, b: float | None) -> float:
    return a / b if b and math.isfinite(b) and b > 0 else float("nan")


def verdict(name: str, finite: bool, loss_ratio: float, slower: bool, tol: Tolerances,
            baseline_loss_ratio: float | None = None) -> tuple[str, list]:
    """``(verdict, reasons)``: ``pass``, ``gap``, ``report`` or ``fail``, and why
    (see the module docstring).

    Example:
      >>> verdict("qsgd-4", True, 1.25, False, Tolerances())
      ('fail', ['loss 1.250x none > 1.100x'])
      >>> verdict("adaptive", True, 1.25, False, Tolerances(), baseline_loss_ratio=1.2)
      ('gap', ['loss 1.250x none > 1.100x, baseline 1.200x'])
      >>> verdict("adaptive", True, 1.5, False, Tolerances(), baseline_loss_ratio=1.2)
      ('fail', ['loss 1.500x none > 1.100x and > 1.100x the baseline 1.200x'])
      >>> verdict("threshold", True, 1.25, True, Tolerances(fail_on_time=True))
      ('report', [])
    """
    if not finite:
        return "fail", ["non-finite loss"]
    if reported_only(name):
        return "report", []
    target = 1 + tol.loss
    met = loss_ratio <= target  # a NaN ratio misses it
    reasons = []
    word = "pass"
    if not met:
        known = (baseline_loss_ratio is not None and math.isfinite(baseline_loss_ratio)
                 and baseline_loss_ratio > target)
        if known and loss_ratio <= target * baseline_loss_ratio:
            word = "gap"
            reasons.append(f"loss {loss_ratio:.3f}x none > {target:.3f}x, "
                           f"baseline {baseline_loss_ratio:.3f}x")
        elif known:
            word = "fail"
            reasons.append(f"loss {loss_ratio:.3f}x none > {target:.3f}x and > {target:.3f}x "
                           f"the baseline {baseline_loss_ratio:.3f}x")
        else:
            word = "fail"
            reasons.append(f"loss {loss_ratio:.3f}x none > {target:.3f}x")
    if slower and tol.fail_on_time:
        word = "fail"
        reasons.append(f"step time > {tol.time:.2f}x the baseline's ratio")
    return word, reasons


def judge(model: str, results, tol: Tolerances, baseline: dict | None = None) -> list:
    """The `Row` of every run of one model.

    Args:
      model: the model's label (``mlp-2048``, ``cnn-32``): the baseline key.
      results: `common.train.RunResult` (or alike) of every compressor of the
        model, ``none`` among them.
      tol: the `Tolerances`.
      baseline: ``{(model, compressor): Reference}`` of a stored run
        (`load_baseline`), or None.
    """
    ref = next(r for r in results if r.name == BASELINE)
    ref_loss = final_loss(ref.losses)
    rows = []
    for r in results:
        finite = bool(len(r.losses)) and bool(np.isfinite(r.losses).all())
        loss = final_loss(r.losses)
        time_ratio = _ratio(r.step_seconds, ref.step_seconds)
        known = (baseline or {}).get((model, r.name), Reference(None, None))
        base = known.time_ratio
        change = _ratio(time_ratio, base) if base is not None else None
        slower = change is not None and change > tol.time
        loss_ratio = _ratio(loss, ref_loss)
        word, reasons = verdict(r.name, finite, loss_ratio, slower, tol, known.loss_ratio)
        rows.append(Row(
            model, r.name, finite, loss, loss_window(len(r.losses)), loss_ratio,
            known.loss_ratio,
            r.accuracy[-1], 100 * (r.accuracy[-1] - ref.accuracy[-1]), 1e3 * r.step_seconds,
            time_ratio, base, change, slower, r.wire_bytes, r.wire_bytes_max, word, reasons,
            list(r.losses), list(r.steps), list(r.accuracy), r.total_seconds, r.compiles))
    return rows


def exit_code(rows) -> int:
    """1 when any row failed, else 0."""
    return int(any(r.verdict == "fail" for r in rows))


def load_baseline(path) -> tuple[dict | None, str]:
    """``({(model, compressor): Reference}, description)`` of a stored gate
    JSON; ``(None, why)`` when there is no file at ``path``."""
    if not path:
        return None, "no baseline given"
    path = pathlib.Path(path)
    if not path.is_file():
        return None, f"no baseline file at {path}"
    record = json.loads(path.read_text())
    def measured(value):
        return value if value is not None and math.isfinite(value) else None

    ratios = {(r["model"], r["compressor"]): Reference(measured(r.get("time_ratio")),
                                                       measured(r.get("loss_ratio")))
              for r in record["rows"]}
    cfg = record.get("config", {})
    preset = "quick preset" if cfg.get("quick") else "full gate"
    return ratios, f"{path} ({preset}, {cfg.get('devices', '?')} devices)"


def _times(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}x"


def _verdict_cell(r: Row) -> str:
    text = f"**{r.verdict}**" if r.verdict == "fail" else r.verdict
    notes = list(r.reasons) + (["slower"] if r.slower and "slower" not in r.reasons else [])
    return text + (f": {'; '.join(notes)}" if notes else "")


def _wire(r: Row) -> str:
    text = f"{r.wire_bytes:,}"
    return text + (f" (up to {r.wire_bytes_max:,})" if r.wire_bytes_max != r.wire_bytes else "")


def table(rows, notes=()) -> str:
    """The Markdown table of ``rows``, after the lines of ``notes``."""
    head = ["| model | compressor | finite | final loss | vs none | test accuracy (%) "
            "| vs none (pp) | median step (ms) | vs none | baseline vs none | change "
            "| wire bytes / step / device | verdict |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    body = [f"| {r.model} | {r.compressor} | {'yes' if r.finite else '**no**'} "
            f"| {r.final_loss:.4f} | {_times(r.loss_ratio, 3)} | {100 * r.accuracy:.2f} "
            f"| {r.accuracy_pp:+.2f} | {r.step_ms:.1f} | {_times(r.time_ratio)} "
            f"| {_times(r.baseline_time_ratio)} | {_times(r.time_change)} | {_wire(r)} "
            f"| {_verdict_cell(r)} |" for r in rows]
    return "\n".join([*notes, *([""] if notes else []), *head, *body])


def smooth(losses, window: int) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, moving average of window losses)``; steps count from 1."""
    losses = np.asarray(losses, np.float64)
    window = max(1, min(window, len(losses)))
    values = np.convolve(losses, np.ones(window) / window, mode="valid")
    return np.arange(window, len(losses) + 1), values


def plot(rows, path, title: str):
    """Smoothed training loss against step, one line per compressor, one panel
    per model, saved as PNG."""
    from matplotlib.figure import Figure

    models = list(dict.fromkeys(r.model for r in rows))
    fig = Figure(figsize=(6.5 * len(models), 4.5), dpi=100)  # no pyplot, as common.report
    axes = np.atleast_1d(fig.subplots(1, len(models)))
    for ax, model in zip(axes, models, strict=True):
        mine = [r for r in rows if r.model == model]
        window = max(1, len(mine[0].losses) // 20)
        for i, r in enumerate(mine):  # 10 colours, then dashed: 12 compressors stay apart
            label = r.compressor + ("" if r.finite else " (non-finite)")
            ax.plot(*smooth(r.losses, window), label=label, lw=1.2, color=f"C{i % 10}",
                    linestyle="-" if i < 10 else "--")
        ref = next(r for r in mine if r.compressor == BASELINE)
        start = ref.losses[0] if ref.losses and math.isfinite(ref.losses[0]) else None
        if start:
            ax.set_ylim(0, 1.3 * start)  # a diverging row leaves the panel, not the scale
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (mean of {window} steps)")
        ax.set_title(f"{title}: {model}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)


def save(rows, config: dict, notes, out_dir, stem: str = "training_gate") -> dict:
    """Writes ``stem.json`` (config and every row with its losses), ``stem.md``
    (the table) and ``stem.png`` (the loss curves); returns their paths."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {kind: out / f"{stem}.{kind}" for kind in ("json", "md", "png")}
    record = {"config": config, "rows": [dataclasses.asdict(r) for r in rows]}
    files["json"].write_text(json.dumps(record, indent=1))
    files["md"].write_text(table(rows, notes) + "\n")
    plot(rows, files["png"], "training gate")
    return files
