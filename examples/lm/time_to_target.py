"""Time to none's loss where links are slow: the frontier's curves against
step times measured over shaped links.

    # seconds per step: 30 steps per compressor, 4 processes, as root
    python -m qcollect.launch --nproc 4 --bandwidth 100mbit examples/lm/main.py \\
        --steps 30 --eval-every 30 --warmup-steps 5 --powersgd-start 0 \\
        --powersgd-rank 32 --compressors none,local,bf16,qsgd-8,qsgd-4,powersgd \\
        --progress false --output-dir examples/results/lm_frontier/steps_100mbit
    # (the same with --bandwidth 25mbit and .../steps_25mbit)
    python examples/lm/time_to_target.py --rates 100,25

Which was done: the steps each point needs come from the one-process
frontier (`lm.frontier`: the mean curve over its seeds, evaluated every 30
steps, interpolated linearly between evaluations; the losses do not depend
on the process layout, `tests/test_lm_example.py`), and the seconds per
step from the shaped runs (the median step of each compressor). A point's
time is the sum of its steps' times by phase, the phases being the spans of
the schedule the point's transformation runs (`common.compressors.phases_of`):
an ``"exact"`` step (or a synchronous step before DiLoCo) costs ``none``'s
step, every other step the point's compressed step; a DiLoCo inner step
costs ``local``'s (no all-reduce), and each outer step adds one exchange of
the outer compressor, its step minus ``local``'s; 0/1 Adam's local steps
(``"inner"``) cost ``local``'s too. Frozen variance, EF21 and
masks are timed as their compressor's step. The target is ``none``'s mean
validation bits per byte after the frontier's steps (``--within 0.02``: 2%
above it, as three seeds of ``none`` alone spread about 0.5%); a point that
never reaches it is listed with its final gap. Writes
``time_to_target.{md,json,png}`` (``time_to_target_2pct.*`` for
``--within 0.02``) beside ``frontier.json``.
"""

import argparse
import dataclasses
import json
import math
import pathlib
import sys

import numpy as np
from matplotlib.figure import Figure

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import transforms  # noqa: E402
from common.compressors import phases_of  # noqa: E402
from lm.config import Config  # noqa: E402


def mean_curve(runs: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """The steps and the validation bits per byte averaged over the seeds' runs."""
    steps = np.array([s for s, _ in runs[0]["curve"]], dtype=float)
    values = np.mean([[v for _, v in r["curve"]] for r in runs], axis=0)
    return steps, values


def steps_to(target: float, steps: np.ndarray, values: np.ndarray) -> float | None:
    """The first step at which the curve reaches ``target``, interpolated
    linearly between evaluations; None if it never does.

    Example:
      >>> steps_to(2.0, np.array([0., 30., 60.]), np.array([4.0, 2.5, 1.5]))
      45.0
    """
    for i in np.flatnonzero(values <= target + 1e-12):
        if i == 0:
            return float(steps[0])
        x0, x1, y0, y1 = steps[i - 1], steps[i], values[i - 1], values[i]
        return float(x0 + (x1 - x0) * (y0 - target) / (y0 - y1))
    return None


def step_key(settings: dict) -> str:
    """The shaped runs' name for the compressed step of a point."""
    (name,) = settings["compressors"]
    return f"powersgd-r{settings['powersgd_rank']}" if name == "powersgd" else name


def seconds(settings: dict, steps: float, t: dict[str, float]) -> float:
    """Seconds for the first ``steps`` steps of a point, from step times ``t``.

    Example:
      >>> t = {"none": 1.0, "local": 0.25, "qsgd-4": 0.5}
      >>> seconds({"compressors": ["qsgd-4"], "compress_after": 10}, 30, t)
      20.0
      >>> seconds({"compressors": [], "diloco_every": 10, "outer_compressor": ["qsgd-4"],
      ...          "diloco_sync_first": 10}, 30, t)
      15.5
      >>> seconds({"compressors": ["qsgd-4"], "optimizer": "zero-one-adam",   # 3 refreshes,
      ...          "zero_one_freeze": 4, "zero_one_refreshes": 2, "zero_one_local_steps": 4,
      ...          "zero_one_syncs": 1}, 8, t)   # 3 syncs, 2 local steps
      5.0
    """
    cfg = point_config(settings)
    if cfg.diloco_every:
        return diloco_seconds(cfg, steps, t)
    done = {phase: sum(max(0.0, min(stop, steps) - start)
                       for name, start, stop in spans(cfg, math.ceil(steps)) if name == phase)
            for phase in ("exact", "inner")}
    rest = steps - done["exact"] - done["inner"]
    if done["inner"] and "local" not in t:
        raise ValueError("a point with local steps needs the shaped runs' 'local' step time "
                         "(--compressors ...,local)")
    return (done["exact"] * t["none"] + done["inner"] * (t["local"] if done["inner"] else 0.0)
            + rest * t[step_key(settings)])


def point_config(settings: dict) -> Config:
    """The example's `Config` with a point's settings (its defaults for the rest)."""
    fields = {f.name for f in dataclasses.fields(Config)}
    return dataclasses.replace(Config(), **{k: tuple(v) if isinstance(v, list) else v
                                            for k, v in settings.items() if k in fields})


def spans(cfg: Config, steps: int) -> tuple:
    """The phases of a point's first ``steps`` steps: the spans of the
    schedule its transformation runs (`common.compressors.phases_of`)."""
    (name,) = cfg.compressors
    phases = phases_of(name, cfg)
    return phases(steps) if phases is not None else ()


def diloco_seconds(cfg: Config, steps: float, t: dict[str, float]) -> float:
    """A DiLoCo point's seconds from `transforms.diloco_schedule` of each step:
    a synchronous step costs ``none``'s, every other ``local``'s, and each
    fragment's outer step adds its share of one outer exchange."""
    n = math.ceil(steps)
    at = transforms.diloco_schedule(np.arange(n), every=cfg.diloco_every,
                                    fragments=cfg.fragments, delay=cfg.diloco_delay,
                                    sync_first=cfg.diloco_sync_first)
    whole = np.minimum(np.maximum(steps - np.arange(n), 0.0), 1.0)  # the last step's share
    sync = float(np.sum(whole * np.asarray(at.synchronous)))
    exchanges = float(np.sum(whole * (np.asarray(at.syncs) >= 0))) / cfg.fragments
    (outer,) = cfg.outer_compressor
    return (sync * t["none"] + (steps - sync) * t["local"]
            + exchanges * (t[outer] - t["local"]))


def step_times(folder: pathlib.Path, rate: int) -> dict[str, float]:
    """Median seconds per step of every run in ``folder/steps_{rate}mbit*/lm.json``
    (one folder per PowerSGD rank: ``steps_100mbit``, ``steps_100mbit_r16``, ...)."""
    t: dict[str, float] = {}
    for path in sorted(folder.glob(f"steps_{rate}mbit*/lm.json")):
        record = json.loads(path.read_text())
        rank = record["config"]["powersgd_rank"]
        for run in record["runs"]:
            key = f"powersgd-r{rank}" if run["name"] == "powersgd" else run["name"]
            t[key] = run["step_seconds"]
    return t


def rows(frontier: dict, times: dict[int, dict[str, float]], within: float = 0.0) -> list[dict]:
    """Per point: steps to none's final loss (times ``1 + within``) and the
    seconds at each rate."""
    by_name: dict[str, list[dict]] = {}
    for run in frontier["runs"]:
        by_name.setdefault(run["name"], []).append(run)
    target = float(np.mean([r["val_bits_per_byte"] for r in by_name["none"]])) * (1 + within)
    out = []
    for point in frontier["points"]:
        steps, values = mean_curve(by_name[point["name"]])
        reach = steps_to(target, steps, values)
        row = {"name": point["name"], "bytes_per_step": point["bytes_per_step"],
               "vs_none": point["vs_none"], "seeds": point["seeds"], "steps": reach,
               "target": target, "within": within, "seconds": {}, "curve_seconds": {}}
        for rate, t in times.items():
            try:
                row["seconds"][rate] = None if reach is None else seconds(
                    point["settings"], reach, t)
                row["curve_seconds"][rate] = [seconds(point["settings"], s, t) for s in steps]
            except KeyError as missing:
                row["seconds"][rate] = f"no step time for {missing}"
        row["curve"] = [steps.tolist(), values.tolist()]
        out.append(row)
    return out


def table(out: list[dict], rates: list[int], times: dict[int, dict[str, float]]) -> str:
    """The Markdown table of `rows`, fastest at the slowest link first, under
    the floor that no compressor beats: none's steps at ``local``'s step time
    (no all-reduce)."""
    none = next(r for r in out if r["name"] == "none")
    head = "".join(f" time at {r} Mbit/s (s) | vs none |" for r in rates)
    floor = "; ".join(
        f"{r} Mbit/s {none['steps'] * times[r]['local']:,.0f} s "
        f"({times[r]['local'] / times[r]['none']:.2f}x)" for r in rates if "local" in times[r])
    lines = [f"Time to {out[0]['target']:.3f} validation bits per byte ({within_words(out)}) "
             "on 4 processes; steps from the frontier's curves, "
             "seconds per step measured over the shaped links. The floor, none's steps "
             f"without any all-reduce (`local`): {floor or 'not measured'}.", "",
             f"| point | bytes / step | loss vs none | seeds | steps to target |{head}",
             "|---|---:|---:|---:|---:|" + "---:|---:|" * len(rates)]
    slow = rates[-1]
    order = sorted(out, key=lambda r: r["seconds"].get(slow) if isinstance(
        r["seconds"].get(slow), float) else math.inf)
    for r in order:
        cells = ""
        for rate in rates:
            s, base = r["seconds"].get(rate), none["seconds"].get(rate)
            if isinstance(s, float) and isinstance(base, float):
                cells += f" {s:,.0f} | {s / base:.2f}x |"
            else:
                cells += f" {'not reached' if r['steps'] is None else s} | - |"
        reach = "not reached" if r["steps"] is None else f"{r['steps']:.0f}"
        lines.append(f"| {r['name']} | {r['bytes_per_step']:,.0f} | "
                     f"{100 * r['vs_none']:+.1f}% | {r['seeds']} | {reach} |{cells}")
    return "\n".join(lines) + "\n"


def within_words(out: list[dict]) -> str:
    """What the target is, in words: none's mean final loss, or a share above it."""
    share = out[0]["within"]
    return ("none's mean after the frontier's steps" if not share else
            f"{100 * share:g}% above none's mean after the frontier's steps")


def plot(out: list[dict], rates: list[int], path: pathlib.Path, best: int = 4) -> None:
    """Bits per byte against seconds per link rate: none and the ``best``
    points that reach its loss soonest at the slowest rate."""
    slow = rates[-1]
    reached = sorted((r for r in out if isinstance(r["seconds"].get(slow), float)),
                     key=lambda r: r["seconds"][slow])
    shown = [r for r in out if r["name"] == "none"] + [
        r for r in reached if r["name"] != "none"][:best]
    fig = Figure(figsize=(5 * len(rates), 4.5))
    for ax, rate in zip(np.atleast_1d(fig.subplots(1, len(rates))), rates, strict=True):
        for r in shown:
            ax.plot(r["curve_seconds"][rate], r["curve"][1], label=r["name"])
        ax.axhline(out[0]["target"], color="grey", lw=0.8, ls=":")
        ax.set_ylim(out[0]["target"] - 0.3, out[0]["target"] + 1.5)
        ax.set_xlabel(f"seconds at {rate} Mbit/s (4 processes)")
        ax.set_ylabel("validation bits per byte")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frontier", default="examples/results/lm_frontier")
    parser.add_argument("--rates", default="100,25", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--within", type=float, default=0.0,
                        help="the target is none's mean final loss times 1 + WITHIN (a "
                             "fraction, e.g. 0.02); files then end in _WITHIN%%")
    args = parser.parse_args(argv)
    if not 0 <= args.within < 1:
        parser.error("--within must be a fraction in [0, 1)")
    folder = pathlib.Path(args.frontier)
    rates = [int(r) for r in args.rates.split(",")]
    times = {r: step_times(folder, r) for r in rates}
    empty = [r for r, t in times.items() if not t]
    if empty:
        parser.error(f"no step times for {empty} Mbit/s: run the shaped launches of this "
                     "script's docstring first")
    out = rows(json.loads((folder / "frontier.json").read_text()), times, args.within)
    stem = "time_to_target" + (f"_{100 * args.within:g}pct" if args.within else "")
    (folder / f"{stem}.json").write_text(json.dumps(out, indent=1))
    (folder / f"{stem}.md").write_text(table(out, rates, times))
    plot(out, rates, folder / f"{stem}.png")
    print((folder / f"{stem}.md").read_text(), end="")
    return out


if __name__ == "__main__":
    main()
