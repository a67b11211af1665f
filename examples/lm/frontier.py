"""The byte-level GPT's frontier: validation bits per byte against bytes per step.

    python examples/lm/frontier.py                 # every point, 600 steps (hours on 2 cores)
    python examples/lm/frontier.py --list          # the points and their settings
    python examples/lm/frontier.py --only none,qsgd-4,onebit-w120-frozen
    python examples/lm/frontier.py --seeds 1       # one seed per point

Trains the language model of ``examples/lm`` (its defaults: a 4 x 128 GPT,
AdamW with warm-up and cosine decay, 4 simulated devices) once per point
and seed: each point is a compressor with a recipe (an exact warm-up,
Adam's variance frozen, EF21 error feedback, zero-gradient masks,
PowerSGD's rank, DiLoCo's H and outer compressor). Every point runs with
seed 0; the points within ``--within`` (5%) of ``none`` run with every seed
of ``--seeds`` (3), as does ``none``. Results are kept per run in
``{output_dir}/frontier.json``, so an interrupted run resumes where it
stopped and ``--only`` adds points to an existing frontier; ``frontier.md``
and ``frontier.png`` (a Pareto plot, log x) are written from all of them.

Bytes per step are measured from the compiled step (`qcollect.wire_bytes`
per phase, weighted by the steps of each phase: a warm-up's exact steps
count), per device; DiLoCo's are its mean per step over the run.
"""

import argparse
import dataclasses
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(default=4)

from common.config import check_folder, parse_config  # noqa: E402
from common.text import load_stdlib  # noqa: E402
from common.wire_split import phase_bytes  # noqa: E402

from lm import frontier_report, report  # noqa: E402
from lm import main as lm_main  # noqa: E402
from lm.config import Config  # noqa: E402

#: Point name -> the example's flags (as `Config` fields) that make it.
#: ``K`` and ``W`` are filled from the run length: 10% and 20% of the steps.
POINTS: dict[str, dict] = {
    "none": {"compressors": ("none",)},
    "bf16": {"compressors": ("bf16",)},
    "qsgd-8": {"compressors": ("qsgd-8",)},
    "qsgd-4": {"compressors": ("qsgd-4",)},
    "qsgd-2": {"compressors": ("qsgd-2",)},
    "qsgd-4-w60": {"compressors": ("qsgd-4",), "compress_after": "K"},
    "qsgd-4-w60-frozen": {"compressors": ("qsgd-4",), "compress_after": "K",
                          "freeze_variance": True},
    "onebit": {"compressors": ("onebit",)},
    "onebit-w60": {"compressors": ("onebit",), "compress_after": "K"},
    "onebit-w120": {"compressors": ("onebit",), "compress_after": "W"},
    "onebit-w60-frozen": {"compressors": ("onebit",), "compress_after": "K",
                          "freeze_variance": True},
    "onebit-w120-frozen": {"compressors": ("onebit",), "compress_after": "W",
                           "freeze_variance": True},
    "onebit-ef21": {"compressors": ("onebit",), "error_feedback": "ef21"},
    "onebit-w120-frozen-ef21": {"compressors": ("onebit",), "compress_after": "W",
                                "freeze_variance": True, "error_feedback": "ef21"},
    "onebit-w120-frozen-mask": {"compressors": ("onebit",), "compress_after": "W",
                                "freeze_variance": True, "mask_zero_rows": True},
    **{f"powersgd-r{r}": {"compressors": ("powersgd",), "powersgd_rank": r,
                          "powersgd_start": 30} for r in (4, 8, 16, 32)},
    "gradiveq": {"compressors": ("gradiveq",)},
    "adaptive": {"compressors": ("adaptive",)},
    **{f"diloco-h{h}-{outer}": {"compressors": (), "diloco_every": h,
                                 "outer_compressor": (outer,), "diloco_sync_first": "W"}
       for h in (10, 50) for outer in ("none", "qsgd-4", "qsgd-2")},
}


def settings_of(name: str, steps: int) -> dict:
    """The `Config` fields of point ``name`` for a run of ``steps`` steps.

    Example:
      >>> settings_of("onebit-w120-frozen", 600)["compress_after"]
      120
    """
    fill = {"K": steps // 10, "W": steps // 5}
    return {k: fill.get(v, v) if isinstance(v, str) else v for k, v in POINTS[name].items()}


def measure(name: str, seed: int, base: Config, corpus) -> dict:
    """One run of point ``name``: its final validation bits per byte, its
    curve, and the bytes each device sends per step on average."""
    settings = settings_of(name, base.steps)
    with tempfile.TemporaryDirectory() as scratch:
        cfg = dataclasses.replace(base, **settings, seed=seed, output_dir=scratch)
        result = lm_main.run(cfg, corpus)[-1]
    return {"name": name, "seed": seed, "val_bits_per_byte": result.accuracy[-1],
            "curve": [list(p) for p in zip(result.steps, result.accuracy, strict=True)],
            "bytes_per_step": mean_bytes(result),
            "median_step_seconds": result.step_seconds,
            "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}}


def mean_bytes(result) -> float:
    """Bytes per step and device over the run: each phase's measured bytes
    on the run's schedule (`lm.report.bytes_per_step`)."""
    return float(report.bytes_per_step(result.phases, phase_bytes(result),
                                       max(result.steps)).mean())


def plan(names: list[str], seeds: int, done: dict, within: float) -> list[tuple[str, int]]:
    """The runs still to do: seed 0 of each point, then the other seeds of
    ``none`` and of the points within ``within`` of none's seed-0 result."""
    todo = [(n, 0) for n in names if (n, 0) not in done]
    base = done.get(("none", 0))
    for n in names:
        close = base is not None and (
            n == "none" or (n, 0) in done
            and done[(n, 0)]["val_bits_per_byte"] <= base["val_bits_per_byte"] * (1 + within))
        if close:
            todo += [(n, s) for s in range(1, seeds) if (n, s) not in done]
    return todo


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated point names (default: all)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds for the close points")
    parser.add_argument("--within", type=float, default=0.05,
                        help="a point this close to none (a fraction) runs every seed")
    parser.add_argument("--output-dir", default="examples/results/lm_frontier",
                        help="folder for frontier.{json,md,png}; a rerun resumes from its "
                             "frontier.json")
    parser.add_argument("--list", action="store_true", help="print the points and exit")
    args, rest = parser.parse_known_args(argv)
    names = [n for n in args.only.split(",") if n] or list(POINTS)
    names = names if "none" in names else ["none", *names]   # the reference, always
    unknown = [n for n in names if n not in POINTS]
    if unknown or args.seeds < 1 or not 0 < args.within < 1:
        parser.error(f"unknown points {unknown} (see --list), or --seeds < 1, or --within "
                     f"outside (0, 1)")
    try:
        check_folder("output_dir", args.output_dir)
    except ValueError as err:
        parser.error(str(err))
    if args.list:
        for n in POINTS:
            print(f"{n}: {settings_of(n, 600)}")
        return {}
    base = parse_config(Config, [*rest, "--progress", "false"])
    out = pathlib.Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "frontier.json"
    done = frontier_report.load(store, base.steps)
    corpus = load_stdlib(base.corpus_dir or None)
    while todo := plan(names, args.seeds, done, args.within):
        name, seed = todo[0]
        print(f"[frontier] {name} seed {seed} ({len(todo)} runs to go)", flush=True)
        done[(name, seed)] = measure(name, seed, base, corpus)
        frontier_report.store(store, base.steps, done)
    files = frontier_report.write(done, out, base.steps)
    print(files["table"].read_text(), end="")
    return done


if __name__ == "__main__":
    main()
