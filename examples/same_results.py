"""Same results, same speed? This tree against another revision, side by side.

For a restructuring that claims to change nothing: trains the MNIST MLP at
width 2048 and the language model (`lm`, its default configuration) for a
few steps with each compressor, from the same initialisation and the same
random batches, once with this tree's code and once with the code of
``--against`` (checked out into a temporary git worktree, removed at the
end), and compares

* the SHA-256 of the parameters and the optimizer state after ``--steps``
  steps (``same`` when every bit agrees),
* the SHA-256 of the compiled training step's optimised HLO, source
  locations left out (``same``: both trees run one program, so any
  difference in their step times is the machine's noise), and
* the median step time (``--timing-steps`` steps, the first 6 left out),
  in ``--timing-rounds`` rounds that alternate the two trees, so that both
  see the same machine load; the table gives each tree's median over the
  rounds and their ratio (this tree / the other).

Each (tree, model) runs in a process of its own on 4 simulated CPU devices
(``QCOLLECT_DEVICES``). Phased transforms are shortened so that every
phase runs: PowerSGD compresses from step 2, GradiVeQ warms up for 2 steps
and samples for 2. The batches are random (bytes for the language model,
Gaussian images for the MLP): the point is identical arithmetic, not
learning.

    python examples/same_results.py --against HEAD~1
    python examples/same_results.py --against 558fe96 --models lm \\
        --compressors none,onebit --timing-rounds 0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
DEFAULT_COMPRESSORS = "none,onebit,qsgd-4,powersgd,gradiveq"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", default="HEAD",
                   help="the git revision to compare with (default HEAD: the last commit)")
    p.add_argument("--models", default="mlp,lm", help="comma-separated: mlp, lm")
    p.add_argument("--compressors", default=DEFAULT_COMPRESSORS,
                   help=f"comma-separated compressor names (default {DEFAULT_COMPRESSORS})")
    p.add_argument("--steps", type=int, default=8, help="steps before hashing (default 8)")
    p.add_argument("--timing-rounds", type=int, default=2,
                   help="alternating timing rounds per tree; 0: no timing (default 2)")
    p.add_argument("--timing-steps", type=int, default=16,
                   help="steps per timing run, the first 6 left out (default 16)")
    p.add_argument("--out", default="", help="also write the table to this Markdown file")
    p.add_argument("--worker", nargs=4, metavar=("REPO", "MODEL", "MODE", "STEPS"),
                   help=argparse.SUPPRESS)
    p.add_argument("--worker-compressors", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    for name in ("steps", "timing_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.timing_rounds < 0:
        p.error("--timing-rounds must be >= 0")
    if args.timing_steps <= 6 and args.timing_rounds:
        p.error("--timing-steps must be > 6 (the first 6 steps are left out)")
    unknown = set(args.models.split(",")) - {"mlp", "lm"}
    if unknown:
        p.error(f"--models takes mlp and lm, got {sorted(unknown)}")
    return args


# ---------------------------------------------------------------- worker side

def _setup(repo: pathlib.Path, model: str, steps: int):
    """The model, its optimizer and random batches, imported from ``repo``."""
    sys.path[:0] = [str(repo / "examples"), str(repo)]
    from common.devices import simulate_cpu_devices
    simulate_cpu_devices(default=4)
    import dataclasses

    import numpy as np
    from common.devices import data_mesh
    from common.train import DataParallel, make_optimizer

    rng = np.random.default_rng(0)
    if model == "lm":
        from lm.config import Config
        from lm.main import make_lm_optimizer
        from lm.model import build
        cfg = Config()
        optimizer = make_lm_optimizer(cfg, cfg.steps)
    else:
        from mnist_mlp.config import Config
        from mnist_mlp.model import build
        cfg = Config(width=2048)
        optimizer = make_optimizer(cfg)
    cfg = dataclasses.replace(cfg, powersgd_start=2, gradiveq_warmup=2, gradiveq_sample_steps=2,
                              gradiveq_compressed_steps=max(steps, 4))
    dp = DataParallel(build(cfg), data_mesh(cfg.mesh, cfg.nodes))
    rows = cfg.batch_size * dp.num_devices
    batches = []
    for _ in range(steps):
        if model == "lm":
            x = rng.integers(0, 256, (rows, cfg.context + 1)).astype(np.int32)
            batches.append(dp.batch(x[:, :-1], x[:, 1:]))
        else:
            batches.append(dp.batch(rng.normal(size=(rows, 784)).astype(np.float32),
                                    rng.integers(0, 10, rows).astype(np.int32)))
    return cfg, dp, optimizer, batches


def _digest(tree) -> str:
    import hashlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        for shard in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
            h.update(np.asarray(shard.data).tobytes())
    return h.hexdigest()[:16]


def program_digest(compiled_text: str) -> str:
    """SHA-256 of an optimised HLO text with its source locations left out
    (each instruction's ``metadata={...}`` and the module's tables of files,
    functions and stack frames before its first computation) and its
    ``%names`` numbered in order of appearance: equal for one program traced
    from code that moved between lines or files, or whose functions were
    renamed."""
    import hashlib
    import re

    header, *rest = compiled_text.splitlines()
    first = next((i for i, line in enumerate(rest) if line.startswith(("%", "ENTRY"))),
                 len(rest))
    text = re.sub(r", metadata=\{[^}]*\}", "", "\n".join(rest[first:]))
    names: dict[str, str] = {}
    text = re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m.group(), f"%{len(names)}"), text)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def worker(repo: str, model: str, mode: str, steps: int, names: list[str]) -> dict:
    """Per compressor: ``{"state": digest after steps, "program": digest of
    the compiled step}`` (``mode="hash"``) or the median step time in seconds
    (``mode="time"``)."""
    import time

    import jax
    import optax
    cfg, dp, optimizer, batches = _setup(pathlib.Path(repo), model, steps)
    from common.compressors import communication
    out = {}
    for name in names:
        comm = communication(name, cfg, dp.axis, jax.random.key(0))
        tx = optax.chain(comm.tx, optimizer)
        params = dp.replicate(dp.params)
        state = dp.init(tx, params)
        step = dp.step(tx, state, replicated=comm.replicated)
        program = (program_digest(step.lower(params, state, *batches[0]).compile().as_text())
                   if mode == "hash" else None)
        seconds = []
        for batch in batches:
            start = time.perf_counter()
            params, state, *_ = jax.block_until_ready(step(params, state, *batch))
            seconds.append(time.perf_counter() - start)
        out[name] = ({"state": _digest((params, state)), "program": program} if mode == "hash"
                     else statistics.median(seconds[6:]))
    return out


# ---------------------------------------------------------------- driver side

def _run_worker(repo: pathlib.Path, model: str, mode: str, steps: int, names: str) -> dict:
    cmd = [sys.executable, str(HERE), "--worker", str(repo), model, mode, str(steps),
           "--worker-compressors", names]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if done.returncode:
        raise RuntimeError(f"the {mode} run of {model} on {repo} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def worktree(revision: str):
    """``revision`` checked out into a temporary directory (removed after)."""
    with tempfile.TemporaryDirectory(prefix="same_results_") as tmp:
        path = pathlib.Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet",
                        str(path), revision], check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                           check=False)


def compare(args, other: pathlib.Path) -> list[str]:
    lines = [f"| model | compressor | state after {args.steps} steps | compiled step "
             f"| ms/step (this) | ms/step ({args.against}) | ratio |",
             "|---|---|---|---|---:|---:|---:|"]
    for model in args.models.split(","):
        old = _run_worker(other, model, "hash", args.steps, args.compressors)
        new = _run_worker(ROOT, model, "hash", args.steps, args.compressors)
        times = {"new": [], "old": []}
        for _ in range(args.timing_rounds):
            for tag, repo in (("old", other), ("new", ROOT)):
                times[tag].append(_run_worker(repo, model, "time", args.timing_steps,
                                              args.compressors))
        for name in args.compressors.split(","):
            same = _same(new[name]["state"], old[name]["state"])
            program = ("same" if new[name]["program"] == old[name]["program"]
                       else "different")   # reported; only the state decides the status
            if args.timing_rounds:
                t_new = statistics.median(r[name] for r in times["new"]) * 1e3
                t_old = statistics.median(r[name] for r in times["old"]) * 1e3
                timing = f"{t_new:.1f} | {t_old:.1f} | {t_new / t_old:.3f}"
            else:
                timing = "- | - | -"
            lines.append(f"| {model} | {name} | {same} | {program} | {timing} |")
            print(lines[-1], flush=True)
    return lines


def _same(new: str, old: str) -> str:
    return "same" if new == old else f"DIFFERENT ({new} vs {old})"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        repo, model, mode, steps = args.worker
        print(json.dumps(worker(repo, model, mode, int(steps),
                                args.worker_compressors.split(","))))
        return 0
    with worktree(args.against) as other:
        lines = compare(args, other)
    table = "\n".join(lines)
    print(table)
    if args.out:
        pathlib.Path(args.out).write_text(table + "\n")
    return 0 if all("DIFFERENT" not in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
