"""The language model's training step, timed per all-reduce on one device.

The third part of ``python -m qcollect.bench device`` (`qcollect.bench.device`),
which runs this program of the checkout as a subprocess; it runs alone too:

    python examples/lm/step_time.py --out steps.json                 # every name below
    python examples/lm/step_time.py --out steps.json --lm none,local,qsgd-4 \\
        --width 32 --depth 1 --heads 2 --context 16 --batch 2        # the benchmark's --quick
    python examples/lm/step_time.py --list                           # the names it can time

It compiles the GPT of ``lm.model`` (default: width 512, depth 8, 8 heads,
context 256, 16 windows a step) on a one-device mesh of the first device JAX
uses, with the examples' own step (`common.train.DataParallel.step`:
gradients, all-reduce, clip by global norm, AdamW) once per all-reduce:
``none``, ``local`` (no all-reduce at all: the step's compute alone) and
each example name that runs `transforms.compressed_all_reduce` with one
compressor (`lm_names`). With one device the exchange is empty, so a step's
time over ``none``'s is what its codec (encode, decode, error feedback)
costs inside a real step. Steps are timed as the benchmark times its codecs
(`qcollect.bench.device_timing.medians`); with ``--profile-over R`` (the
benchmark passes its target, 1.10) each step more than R times ``none``'s
has, with ``none``'s, its profile (device time per operation), at most the
two slowest.

``--out`` gets one JSON object: ``rows`` (``all_reduce``, ``parameters``,
``step_ms``, ``overhead_vs_none``), ``not_measured`` (name -> why: a
failure, the time budget) and ``profiles``; or ``error`` when the step with
``none`` did not compile (status 1). Progress lines go to stdout.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common.config import COMPRESSOR_NAMES, COMPUTE_ONLY  # noqa: E402

#: Example names that run other transforms, plans or phases (not one
#: compressor through `transforms.compressed_all_reduce`).
OTHER_TRANSFORMS = ("entropy", "powersgd", "gradiveq")


def lm_names() -> list[str]:
    """``none``, ``local`` (no all-reduce: the step's compute alone) and
    every example name that runs one compressor through
    `transforms.compressed_all_reduce` (``common.config.COMPRESSOR_NAMES``
    but `OTHER_TRANSFORMS`), the targets' ``qsgd-4`` and ``onebit`` next.

    Example:
      >>> lm_names()[:4]
      ['none', 'local', 'qsgd-4', 'onebit']
    """
    names = [n for n in COMPRESSOR_NAMES if n not in OTHER_TRANSFORMS]
    first = ["none", COMPUTE_ONLY, *(n for n in ("qsgd-4", "onebit") if n in names)]
    return first + [n for n in names if n not in first]


def compile_steps(args: argparse.Namespace, clock, say) -> tuple[dict, dict, int]:
    """The compiled step on a one-device mesh per all-reduce of ``args.lm``
    (``none`` first), what was not compiled and why (a failure, the time
    budget), and the model's parameter count."""
    import jax
    import numpy as np
    import optax
    from common.train import DataParallel, make_optimizer
    from lm.config import Config
    from lm.model import build

    from qcollect.bench.device_timing import failure

    cfg = Config(width=args.width, depth=args.depth, heads=args.heads, context=args.context,
                 batch_size=args.batch, compressors=("none",))
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    dp = DataParallel(build(cfg), mesh)
    optimizer = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                            make_optimizer(cfg, weight_decay=cfg.weight_decay))
    windows = np.random.default_rng(0).integers(0, 256, (args.batch, args.context + 1), np.int32)
    x, y = dp.batch(windows[:, :-1], windows[:, 1:])
    params = dp.place(dp.params)
    steps, missing = {}, {}
    for name in ["none", *(n for n in args.lm if n != "none")]:
        if clock.out() and name != "none":
            missing[name] = clock.why()
            continue
        try:
            comm = dp.communication(name, cfg, jax.random.key(cfg.seed))
            tx = dp.transformation(comm, optimizer)
            state = dp.init(tx, params)
            step = dp.step(tx, state, replicated=comm.replicated)
            jax.block_until_ready(step(params, state, x, y))
        except Exception as err:  # noqa: BLE001 - the other rows still measure
            missing[name] = f"failed: {failure(err)}"
            continue
        steps[name] = (step, (params, state, x, y))
        say(f"compiled the step with {name}")
    return steps, missing, sum(leaf.size for leaf in jax.tree.leaves(dp.params))


def step_rows(args: argparse.Namespace, clock, say) -> dict:
    """Median step ms per all-reduce of ``args.lm``, its ratio to
    ``none``'s, what was not measured and why, and the profiles of ``none``
    and of the two slowest steps over ``args.profile_over`` times ``none``'s."""
    from qcollect.bench.device_timing import medians, profile_of

    steps, missing, count = compile_steps(args, clock, say)
    if "none" not in steps:
        raise RuntimeError(f"the step with none did not compile: {missing.get('none')}")
    seconds = medians(steps, args.repeats, args.calls)
    say("timed the steps: " + ", ".join(f"{n} {1e3 * t:.1f} ms" for n, t in seconds.items()))
    rows = [{"all_reduce": name, "parameters": count, "step_ms": 1e3 * t,
             "overhead_vs_none": t / seconds["none"]} for name, t in seconds.items()]
    over = [] if args.profile_over is None else sorted(
        (name for name, t in seconds.items() if t / seconds["none"] > args.profile_over),
        key=lambda name: -seconds[name])[:2]
    profiles = {}
    if args.profile_top and over:
        for name in ["none", *over]:
            profiles[f"the step with {name}"] = profile_of(*steps[name], args.profile_top)
    return {"rows": rows, "not_measured": missing, "profiles": profiles}


def _names(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    known = lm_names()
    if not names or not set(names) <= set(known):
        raise argparse.ArgumentTypeError(f"must name some of {', '.join(known)}, got {text!r}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``--help`` lists it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true",
                   help="print the names --lm accepts (a JSON list) and exit")
    p.add_argument("--out", type=pathlib.Path, default=None, help="the JSON file to write")
    p.add_argument("--lm", type=_names, default=None,
                   help="comma-separated all-reduces (default: every one of --list)")
    for name, default in (("width", 512), ("depth", 8), ("heads", 8), ("context", 256),
                          ("batch", 16), ("repeats", 9), ("calls", 10), ("profile-top", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--profile-over", type=float, default=None, metavar="R",
                   help="profile none's step and the two slowest over R times none's "
                        "(--profile-top operations each; default: no profiles)")
    p.add_argument("--budget", type=float, default=float("inf"),
                   help="seconds after which the steps not yet compiled are skipped")
    p.add_argument("--spent", type=float, default=0.0,
                   help="seconds of --budget already spent (by the benchmark's earlier parts)")
    args = p.parse_args(argv)
    if not args.list and args.out is None:
        p.error("--out is required (or --list)")
    args.lm = args.lm or lm_names()
    return args


def main(argv=None) -> int:
    """Times the steps and writes ``--out``; 0, or 1 when ``none``'s step failed."""
    args = parse_args(argv)
    if args.list:
        print(json.dumps(lm_names()), flush=True)
        return 0
    import time

    from qcollect.bench.device_timing import Clock, failure

    clock = Clock(args.budget, start=time.perf_counter() - args.spent)
    try:
        result, status = step_rows(args, clock, lambda line: print(line, flush=True)), 0
    except Exception as err:  # noqa: BLE001 - said in the benchmark's report
        result, status = {"error": failure(err)}, 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
