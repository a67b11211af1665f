"""Results of the language-model runs: the table, the two-panel plot, the JSON record.

Bytes sent are measured (`RunResult.wire_bytes`, `common.wire_split`), never
computed from the config. The cumulative bytes of a run add each step's
measured cost: the bytes of the phase the step falls in
(`common.wire_split.phase_bytes`, measured on the compiled step by phase
name) on the run's schedule (`RunResult.phases`, from the transformation's
own: ``transforms.CompressAfter(K).spans``, `transforms.gradiveq_phases`; the example
sets no stop-early vote, so GradiVeQ's schedule is exact).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
from common import report
from common.config import COMPUTE_ONLY
from matplotlib.figure import Figure


def bytes_per_step(schedule, phases: dict, steps: int) -> np.ndarray:
    """What each device sends at each step ``0 .. steps - 1`` of a run, from
    its schedule (``RunResult.phases``: ``[name, start, stop]`` runs) and
    each phase's measured bytes (`common.wire_split.phase_bytes`).

    Example:
      >>> schedule = [["exact", 0, 2], ["compressed", 2, 4]]
      >>> bytes_per_step(schedule, {"exact": 40, "compressed": 10}, 4).tolist()
      [40, 40, 10, 10]
      >>> bytes_per_step([], {"steady": 7}, 3).tolist()
      [7, 7, 7]
    """
    if "steady" in phases:
        return np.full(steps, phases["steady"], np.int64)
    out = np.zeros(steps, np.int64)
    for name, start, stop in schedule:
        out[start:stop] = phases[name]
    return out


def bytes_sent(result, phases: dict) -> list[int]:
    """Cumulative bytes sent per device at each evaluation step of ``result``."""
    per_step = bytes_per_step(result.phases, phases, max(result.steps))
    total = np.concatenate([[0], np.cumsum(per_step)])
    return [int(total[s]) for s in result.steps]


def record(result, split: tuple[int, int], phases: dict) -> dict:
    """One run as JSON: the `RunResult` fields, ``val_bits_per_byte`` for its
    ``accuracy``, the compressed / uncompressed split, the phases' bytes
    (``phase_bytes``), its schedule (``phases``) and the cumulative bytes
    sent at each evaluation."""
    run = dataclasses.asdict(result)
    run.pop("wire_bytes_by_phase")  # as phase_bytes
    out = {"name": run.pop("name"), "steps": run.pop("steps"),
           "val_bits_per_byte": run.pop("accuracy"),
           "bytes_sent": bytes_sent(result, phases), "losses": run.pop("losses"),
           "wire_bytes": run.pop("wire_bytes"), "wire_bytes_compressed": split[0],
           "wire_bytes_uncompressed": split[1], "phase_bytes": phases}
    return out | run


def beyond_compute(results) -> dict[str, float] | None:
    """Each run's median step time minus the ``local`` run's (the same step
    with no all-reduce, `common.config.COMPUTE_ONLY`), in seconds: what the
    all-reduce adds to a step. None when no ``local`` run was made.

    Example:
      >>> from common.train import RunResult
      >>> runs = [RunResult("none", [], [], [], 0, 0, 0.5, 0.0),
      ...         RunResult("local", [], [], [], 0, 0, 0.3, 0.0)]
      >>> {k: round(v, 3) for k, v in beyond_compute(runs).items()}
      {'none': 0.2, 'local': 0.0}
    """
    compute = next((r.step_seconds for r in results if r.name == COMPUTE_ONLY), None)
    if compute is None:
        return None
    return {r.name: r.step_seconds - compute for r in results}


def _smaller(base: float, other: float) -> str:
    if base <= 0 or other <= 0:
        return "(within noise)"
    return f"{base / other:.1f}x smaller"


def table(results, splits: dict, baseline_bytes: int | None, link_mbit: float = 0.0,
          baseline: str = "pmean", tokens_per_step: int = 0) -> str:
    """`common.report.table` with validation bits per byte and the split columns;
    with ``link_mbit``, each step's wire floor on that link; with a ``local``
    run, each step's time beyond compute and its ratio to ``none``'s; with
    ``tokens_per_step``, bytes sent per token (of the mean step) and tokens
    per second (of the mean step time: DiLoCo's steps differ).

    Example:
      >>> from common.train import RunResult
      >>> runs = [RunResult("none", [0], [8.0], [], 1_250_000, 1_250_000, 0.5, 9.0),
      ...         RunResult("local", [0], [8.0], [], 0, 0, 0.3, 5.0)]
      >>> print(table(runs, {"none": (0, 1_250_000), "local": (0, 0)}, 1_250_000, 100))
      | compressor | val bits / byte | ... | wire floor (ms) | beyond compute (ms) | vs none | ...
      |---|---|...
      | none | 8.000 | 1,250,000 | 0 | 1,250,000 | 100.0 | 200.0 | 1.0x smaller | 1.0x | ...
      | local | (no all-reduce) | 0 | 0 | 0 | 0.0 | 0.0 | - | - | - | 300.0 | 5 |
    """
    extra = [("compressed leaves", lambda r: f"{splits[r.name][0]:,}"),
             ("uncompressed leaves", lambda r: f"{splits[r.name][1]:,}")]
    if link_mbit:
        extra.append(("wire floor (ms)",
                      lambda r: f"{8e3 * r.wire_bytes / (link_mbit * 1e6):.1f}"))
    if tokens_per_step:
        extra.append(("bytes / token", lambda r: f"{r.wire_bytes / tokens_per_step:.3f}"))
        extra.append(("tokens / s", lambda r: f"{tokens_per_step / r.mean_step_seconds:,.0f}"))
    beyond = beyond_compute(results)
    if beyond is not None:
        base = beyond.get(report.BASELINE)
        extra.append(("beyond compute (ms)", lambda r: f"{1e3 * beyond[r.name]:.1f}"))
        if base is not None:
            extra.append(("vs none", lambda r: _smaller(base, beyond[r.name])
                          if r.name != COMPUTE_ONLY else "-"))
    return report.table(results, baseline_bytes,
                        metric=("val bits / byte", lambda r: "(no all-reduce)"
                                if r.name == COMPUTE_ONLY else f"{r.accuracy[-1]:.3f}"),
                        extra=tuple(extra), baseline=baseline)


def fsdp_split(result) -> tuple[int, int]:
    """FSDP's ``(compressed, uncompressed)`` bytes per step: the weights'
    all-gather and the gradients' reduce-scatter (compressed by the run's
    compressors), and the all-reduces (the replicated leaves' gradients and
    a 4-byte finiteness flag)."""
    ops = result.wire_bytes_by_op
    uncompressed = ops.get("all-reduce", 0)
    return sum(ops.values()) - uncompressed, uncompressed


#: The collectives of FSDP's gradient reduce-scatter: the shifts or the
#: all-to-all of the compressed blocks, and over ``node,local`` the
#: uncompressed reduce-scatter inside a node.
SCATTER_OPS = ("collective-permute", "all-to-all", "reduce-scatter")


def fsdp_table(results, baseline_bytes: int) -> str:
    """Bytes per step and direction, and memory per device, of FSDP runs
    (``RunResult.wire_bytes_by_op`` and ``RunResult.memory``, from
    `common.fsdp.ShardedDataParallel.memory`).

    Example:
      >>> from common.train import RunResult
      >>> r = RunResult("none", [0], [8.0], [], 100, 100, 0.5, 9.0)
      >>> r.wire_bytes_by_op = {"all-gather": 60, "collective-permute": 36, "all-reduce": 4}
      >>> r.memory = {"params": 30, "optimizer": 60, "error_feedback": 100, "ideal": 75}
      >>> print(fsdp_table([r], 100))
      | gradients | weights gather | gradients scatter | all-reduce | ... x (total / N) |
      |---|...
      | none | 60 | 36 | 4 | 1.0x | 30 | 60 | 100 | 1.20x |
    """
    head = ("| gradients | weights gather | gradients scatter | all-reduce | vs uncompressed "
            "| params / device | optimizer / device | residuals / device "
            "| params + optimizer x (total / N) |")
    rows = [head, "|---" * 9 + "|"]
    for r in results:
        ops, mem = r.wire_bytes_by_op, r.memory
        scatter = sum(ops.get(op, 0) for op in SCATTER_OPS)
        rows.append(f"| {r.name} | {ops.get('all-gather', 0):,} | {scatter:,} | "
                    f"{ops.get('all-reduce', 0):,} | {baseline_bytes / max(r.wire_bytes, 1):.1f}x "
                    f"| {mem['params']:,} | {mem['optimizer']:,} | {mem['error_feedback']:,} | "
                    f"{(mem['params'] + mem['optimizer']) / mem['ideal']:.2f}x |")
    return "\n".join(rows)


def plot(results, phases: dict, path, title: str):
    """Validation bits per byte against steps and against cumulative bytes sent."""
    fig = Figure(figsize=(11, 4.5), dpi=100)  # no pyplot: leaves the caller's backend alone
    by_step, by_bytes = fig.subplots(1, 2, sharey=True)
    results = [r for r in results if r.name != COMPUTE_ONLY]  # replicas drifted apart
    for r in results:
        by_step.plot(r.steps, r.accuracy, marker=".", label=r.name)
        sent = np.asarray(bytes_sent(r, phases[r.name]), float)
        seen = sent > 0  # the log axis: from the first step on
        by_bytes.plot(sent[seen] / 2**20, np.asarray(r.accuracy)[seen], marker=".", label=r.name)
    best = min(min(r.accuracy) for r in results)
    by_step.set_ylim(best - 0.1, min(8.5, best + 3))
    by_step.set_xlabel("step")
    by_step.set_ylabel("validation bits / byte")
    by_bytes.set_xscale("log")
    by_bytes.set_xlabel("MiB sent per device (cumulative)")
    for ax in (by_step, by_bytes):
        ax.grid(alpha=0.3)
    by_bytes.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)


def save(results, splits: dict, phases: dict, baseline_bytes, cfg, corpus: dict, out_dir,
         stem: str, title: str, tokens_per_step: int = 0) -> dict:
    """Writes ``stem.md`` (table), ``stem.json`` (everything) and ``stem.png``.

    ``splits`` and ``phases`` map each run's name to its
    `common.wire_split.wire_split` and `common.wire_split.phase_bytes`.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fsdp = cfg.parallel == "fsdp"
    text = table(results, splits, baseline_bytes, cfg.link_mbit,
                 "uncompressed FSDP" if fsdp else "pmean", tokens_per_step)
    if fsdp:
        text += "\n\n" + fsdp_table(results, baseline_bytes)
    if cfg.model_parallel > 1:
        text += "\n\nBytes per step and device by mesh axis:\n\n" + report.axis_table(results)
    (out / f"{stem}.md").write_text(text + "\n")
    doc = {"config": dataclasses.asdict(cfg), "corpus": corpus,
           "baseline_wire_bytes": baseline_bytes,
           "runs": [record(r, splits[r.name], phases[r.name]) for r in results]}
    beyond = beyond_compute(results)
    for run in doc["runs"] if beyond is not None else ():
        run["step_seconds_beyond_compute"] = beyond[run["name"]]
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    plot(results, phases, out / f"{stem}.png", title)
    return {"table": out / f"{stem}.md", "json": out / f"{stem}.json", "plot": out / f"{stem}.png"}
