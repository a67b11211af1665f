"""The byte-level GPT's frontier: validation bits per byte against bytes per step.

    python examples/lm/frontier.py                 # every point, 600 steps (hours on 2 cores)
    python examples/lm/frontier.py --list          # the points and their settings
    python examples/lm/frontier.py --steps 1800 --output-dir examples/results/lm_frontier_1800
    python examples/lm/frontier.py --only none,qsgd-4,onebit-exact20%-frozen
    python examples/lm/frontier.py --seeds 1       # one seed per point

Trains the language model of ``examples/lm`` (its defaults: a 4 x 128 GPT,
AdamW with warm-up and cosine decay, 4 simulated devices) once per point
and seed: each point is a compressor with a recipe (exact steps first,
Adam's variance frozen, EF21 error feedback, zero-gradient masks,
PowerSGD's rank, DiLoCo's H and outer compressor). A point's name says its
exact steps as a share of the run (``onebit-exact20%-frozen``: 120 of 600
steps, 360 of 1,800), so runs of any length name a recipe alike. Every point runs with
seed 0; the points within ``--within`` (5%) of ``none`` run with every seed
of ``--seeds`` (3), as does ``none``. Results are kept per run in
``{output_dir}/frontier.json``, so an interrupted run resumes where it
stopped and ``--only`` adds points to an existing frontier; ``frontier.md``
and ``frontier.png`` (a Pareto plot, log x) are written from all of them.

Bytes per step are measured from the compiled step (`qcollect.wire_bytes`
per phase, weighted by the steps of each phase: the exact steps first
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

#: The points: the example's flags (as `Config` fields) that make each. A
#: share such as ``"10%"`` is that share of the run's steps (rounded down).
#: A point's name comes from its settings and the run's steps (`name_of`).
POINTS: tuple[dict, ...] = (
    {"compressors": ("none",)},
    # the controls: none's learning rate tuned, and none with the variance frozen
    *({"compressors": ("none",), "learning_rate": lr} for lr in (1.5e-3, 6e-3)),
    *({"compressors": ("none",), "compress_after": k, "freeze_variance": True}
      for k in ("10%", "20%")),
    # 1-bit Adam: the momentum compressed inside the optimizer
    *({"compressors": (c,), "optimizer": "onebit-adam", "compress_after": k,
       **({"warm_up_compressor": w} if w != "none" else {})}
      for c in ("onebit", "onebit-column", "qsgd-2") for k in ("5%", "10%", "20%")
      for w in ("none", "bf16")),
    # 0/1 Adam: variance refreshes until F, then local steps between 1-bit syncs
    *({"compressors": (c,), "optimizer": "zero-one-adam", "zero_one_freeze": f}
      for c in ("onebit", "onebit-column") for f in ("10%", "20%")),
    *({"compressors": ("onebit",), "optimizer": "zero-one-adam", "zero_one_freeze": f,
       "zero_one_refresh": "bf16"} for f in ("10%", "20%")),
    # DeMo: decoupled momenta, 1 or 2 of each 64 DCT coefficients all-gathered
    *({"compressors": ("none",), "optimizer": "demo", "demo_top_k": k} for k in (1, 2)),
    {"compressors": ("bf16",)},
    {"compressors": ("qsgd-8",)},
    {"compressors": ("qsgd-4",)},
    {"compressors": ("qsgd-2",)},
    {"compressors": ("qsgd-4",), "compress_after": "10%"},
    {"compressors": ("qsgd-4",), "compress_after": "10%", "freeze_variance": True},
    {"compressors": ("onebit",)},
    {"compressors": ("onebit",), "compress_after": "10%"},
    {"compressors": ("onebit",), "compress_after": "20%"},
    {"compressors": ("onebit",), "compress_after": "10%", "freeze_variance": True},
    {"compressors": ("onebit",), "compress_after": "20%", "freeze_variance": True},
    {"compressors": ("onebit",), "error_feedback": "ef21"},
    {"compressors": ("onebit",), "compress_after": "20%", "freeze_variance": True,
     "error_feedback": "ef21"},
    {"compressors": ("onebit",), "compress_after": "20%", "freeze_variance": True,
     "mask_zero_rows": True},
    *({"compressors": ("powersgd",), "powersgd_rank": r, "powersgd_start": 30}
      for r in (4, 8, 16, 32)),
    {"compressors": ("gradiveq",)},
    {"compressors": ("adaptive",)},
    *({"compressors": (), "diloco_every": h, "outer_compressor": (outer,),
       "diloco_sync_first": "20%"} for h in (10, 50) for outer in ("none", "qsgd-4", "qsgd-2")),
)


def points(steps: int) -> dict[str, dict]:
    """Every point of `POINTS` by name, its settings for a run of ``steps`` steps.

    Example:
      >>> points(600)["onebit-exact20%-frozen"]["compress_after"]
      120
      >>> points(1800)["onebit-exact20%-frozen"]["compress_after"]
      360
    """
    out = {name_of(point, steps): {k: _steps(v, steps) for k, v in point.items()}
           for point in POINTS}
    if len(out) != len(POINTS):
        raise ValueError("two points of POINTS have one name: name_of must tell them apart")
    return out


def _steps(value, steps: int):
    """A share of the run (``"10%"``) as steps, any other setting as it is."""
    if isinstance(value, str) and value.endswith("%"):
        return steps * int(value[:-1]) // 100
    return value


def name_of(settings: dict, steps: int) -> str:
    """A point's name from its settings (shares, as in `POINTS`, or steps, as
    a run records them) in a run of ``steps`` steps: the compressor
    (``powersgd-r8``; DiLoCo's every ``h`` steps and outer compressor,
    ``diloco-h10-qsgd-4``), then its exact steps first as their share of the
    run (``exact10%``: the same name at 600 steps and at 1,800;
    ``first10%-bf16`` through a warm-up compressor), ``frozen``
    (Adam's variance), ``ef21``, ``mask`` (zero rows), and a learning rate
    other than the default (``lr0.006``); 1-bit Adam's points start
    ``onebit-adam-`` and 0/1 Adam's ``zero-one-adam-`` and name the momentum's
    compressor (0/1 Adam's then its variance freeze, ``freeze20%``).

    Example:
      >>> settings = {"compressors": ["onebit"], "compress_after": 60, "freeze_variance": True}
      >>> name_of(settings, 600), name_of({**settings, "compress_after": 180}, 1800)
      ('onebit-exact10%-frozen', 'onebit-exact10%-frozen')
    """
    if settings.get("diloco_every"):
        (outer,) = settings["outer_compressor"]
        parts = [f"diloco-h{settings['diloco_every']}-{outer}"]
    else:
        (compressor,) = settings["compressors"]
        parts = [compressor + (f"-r{settings['powersgd_rank']}"
                               if compressor == "powersgd" else "")]
        if settings.get("optimizer") in ("onebit-adam", "zero-one-adam"):
            parts.insert(0, settings["optimizer"])
        if settings.get("optimizer") == "demo":
            parts = [f"demo-k{settings['demo_top_k']}"]
    if settings.get("zero_one_freeze"):
        freeze = settings["zero_one_freeze"]
        parts.append(f"freeze{freeze if isinstance(freeze, str) else _share(freeze, steps)}")
        if settings.get("zero_one_refresh", "none") != "none":
            parts.append(f"refresh-{settings['zero_one_refresh']}")
    exact = settings.get("compress_after")
    if exact:
        share = exact if isinstance(exact, str) else _share(exact, steps)
        warm = settings.get("warm_up_compressor", "none")
        parts.append(f"exact{share}" if warm == "none" else f"first{share}-{warm}")
    parts += [part for part, on in (("frozen", settings.get("freeze_variance")),
                                    ("ef21", settings.get("error_feedback") == "ef21"),
                                    ("mask", settings.get("mask_zero_rows"))) if on]
    if "learning_rate" in settings:
        parts.append(f"lr{settings['learning_rate']:g}")
    return "-".join(parts)


def _share(count: int, steps: int) -> str:
    """``count`` steps as a share of a run of ``steps``: ``"10%"``."""
    return f"{100 * count / steps:.0f}%"


def renamed(runs: frontier_report.Runs, steps: int) -> frontier_report.Runs:
    """Recorded runs under the names of today's points: a run whose name is
    not one (recorded when names said the exact steps as a count of a
    600-step run, ``onebit-w120-frozen``) gets the name `name_of` gives its
    settings (``onebit-exact20%-frozen``).

    Example:
      >>> old = {"name": "qsgd-4-w60", "seed": 0,
      ...        "settings": {"compressors": ["qsgd-4"], "compress_after": 60}}
      >>> list(renamed({("qsgd-4-w60", 0): old}, 600))
      [('qsgd-4-exact10%', 0)]
    """
    known = points(steps)
    out = {}
    for (name, seed), run in runs.items():
        name = name if name in known else name_of(run["settings"], steps)
        out[(name, seed)] = {**run, "name": name}
    return out


def measure(name: str, seed: int, base: Config, corpus) -> dict:
    """One run of point ``name``: its final validation bits per byte, its
    curve, and the bytes each device sends per step on average."""
    settings = points(base.steps)[name]
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
    base = parse_config(Config, [*rest, "--progress", "false"])
    known = points(base.steps)
    names = [n for n in args.only.split(",") if n] or list(known)
    names = names if "none" in names else ["none", *names]   # the reference, always
    unknown = [n for n in names if n not in known]
    if unknown or args.seeds < 1 or not 0 < args.within < 1:
        parser.error(f"unknown points {unknown} (see --list), or --seeds < 1, or --within "
                     f"outside (0, 1)")
    try:
        check_folder("output_dir", args.output_dir)
    except ValueError as err:
        parser.error(str(err))
    if args.list:
        for n, settings in known.items():
            print(f"{n}: {settings}")
        return {}
    out = pathlib.Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "frontier.json"
    recorded = frontier_report.load(store, base.steps)
    done = renamed(recorded, base.steps)
    if list(done) != list(recorded):   # a record of older names: kept under today's
        frontier_report.store(store, base.steps, done)
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
