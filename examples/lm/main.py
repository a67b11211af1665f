"""Train a byte-level GPT on Python's standard library data-parallel with compressed gradients.

    python examples/lm/main.py                        # defaults: about 20 minutes on 2 cores
    python examples/lm/main.py --compressors all --steps 1000
    python examples/lm/main.py --width 256 --depth 6 --heads 8 --context 256
    python examples/lm/main.py --checkpoint-dir ckpt --checkpoint-every 100
    python examples/lm/main.py --checkpoint-dir ckpt --resume true   # continue
    python examples/lm/main.py --parallel fsdp --weight-compressor int8 --compressors none,qsgd-4
    python examples/lm/main.py --model-parallel 2 --compressors none,qsgd-4   # (data, model) mesh
    python examples/lm/main.py --compressors none --diloco-every 50 --outer-compressor none,qsgd-4
    python examples/lm/main.py --help

On a CPU machine the devices are simulated (4 by default; set
``QCOLLECT_DEVICES`` to change). The optimizer chain is ``all-reduce ->
clip by global norm -> AdamW`` (linear warm-up, cosine decay), so clipping
sees the averaged gradient. Prints a table per compressor (validation bits
per byte, wire bytes per step split into compressed and uncompressed leaves,
ratio to ``lax.pmean``, median step time) and writes ``lm.{md,json,png}`` to
``--output-dir``.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(default=4)

import jax  # noqa: E402
import optax  # noqa: E402
from common.config import parse_config  # noqa: E402
from common.experiment import (  # noqa: E402
    baseline_bytes,
    data_parallel,
    devices_line,
    mesh_of,
    progress_bar,
    train_each,
)
from common.replicas import ReplicaParallel  # noqa: E402
from common.text import NextBytes, load_stdlib  # noqa: E402
from common.train import (  # noqa: E402
    DataParallel,
    InOptimizer,
    make_optimizer,
    run_length,
    train,
)
from common.wire_split import phase_bytes, wire_split  # noqa: E402

import transforms  # noqa: E402
from lm import report  # noqa: E402
from lm.config import Config  # noqa: E402
from lm.model import build  # noqa: E402


def make_lm_optimizer(cfg, total_steps: int, axis=None) -> optax.GradientTransformation:
    """Clip the averaged gradient, then ``cfg.optimizer`` (AdamW) on a schedule:
    linear warm-up from 0 over ``cfg.warmup_steps``, cosine decay to a tenth
    of ``cfg.learning_rate`` at ``total_steps``. With ``axis`` (FSDP: the
    gradients are shards over it) the clip is by the norm of all shards
    (`transforms.clip_by_global_norm`).

    Example:
      >>> tx = make_lm_optimizer(Config(), total_steps=300)
    """
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, warmup, max(total_steps, warmup + 1), cfg.learning_rate / 10)
    clip = (optax.clip_by_global_norm(cfg.clip_norm) if axis is None
            else transforms.clip_by_global_norm(cfg.clip_norm, axis))
    optimizer = make_optimizer(cfg, schedule, weight_decay=cfg.weight_decay)
    if isinstance(optimizer, InOptimizer):    # 1-bit Adam: each device clips its own
        return optimizer.after(clip)
    return optax.chain(clip, optimizer)


def describe(dp: DataParallel, corpus: dict, cfg, title: str) -> str:
    """One line: parameters, devices, mesh, platform, training bytes, global batch."""
    params = sum(x.size for x in jax.tree.leaves(dp.params))
    return (f"{title}: {params:,} parameters, {devices_line(dp)}, "
            f"{corpus['train_bytes']:,} training bytes ("
            f"in {corpus['train_files']} .py files: {corpus['source']}), global batch "
            f"{cfg.batch_size * dp.num_devices} x {cfg.context} bytes")


def run(cfg: Config, corpus=None):
    """Trains the GPT of ``cfg`` with each of ``cfg.compressor_names``.

    Args:
      cfg: the `Config`.
      corpus: a `common.text.Corpus` (default: `load_stdlib` of ``cfg.corpus_dir``).

    Returns the list of `common.train.RunResult`. Process 0 prints the table
    and writes ``{output_dir}/lm.{md,json,png}``.
    """
    corpus = load_stdlib(cfg.corpus_dir or None) if corpus is None else corpus
    task = NextBytes(corpus, cfg.context, cfg.val_windows)
    mesh = mesh_of(cfg)
    fsdp = cfg.parallel == "fsdp"
    dp = data_parallel(cfg, build(cfg), mesh)
    optimizer = make_lm_optimizer(cfg, run_length(cfg, task.train_size, dp.num_devices),
                                  dp.axis if fsdp else None)
    title = f"Byte-level GPT {cfg.depth}x{cfg.width}" + (
        f", FSDP (weights {cfg.weight_compressor})" if fsdp else "") + (
        f", model axis of {cfg.model_parallel}" if cfg.model_parallel > 1 else "")
    lead = jax.process_index() == 0
    if lead:
        print(describe(dp, corpus.describe(), cfg, title), flush=True)
    results = train_each(dp, cfg, task, lead, optimizer)
    if fsdp:  # every leaf's collectives are compressed but the replicated leaves' all-reduce
        splits = {r.name: report.fsdp_split(r) for r in results}
        phases = {r.name: {"steady": r.wire_bytes} for r in results}
    else:
        whole = dp.replicated if isinstance(dp, ReplicaParallel) else dp
        splits = {r.name: wire_split(whole, r.name, cfg, r.wire_bytes) for r in results}
        phases = {r.name: phase_bytes(r) for r in results}
    for r, ddp in diloco_runs(cfg, mesh, task, lead, optimizer):
        results.append(r)  # the split of one whole-model exchange, over H
        whole = wire_split(ddp.replicated, r.name.removeprefix("diloco-"), cfg, 0)
        splits[r.name] = tuple(round(b / cfg.diloco_every) for b in whole)
        phases[r.name] = {"steady": r.wire_bytes}
    base = baseline_bytes(results, dp, cfg, task, optimizer)
    if lead:
        stem = ("lm_fsdp" if fsdp else "lm_model" if cfg.model_parallel > 1
                else "lm_diloco" if cfg.diloco_every else "lm")
        tokens = cfg.batch_size * dp.num_devices * cfg.context if cfg.diloco_every else 0
        files = report.save(results, splits, phases, base, cfg, corpus.describe(),
                            cfg.output_dir, stem, title, tokens)
        print(files["table"].read_text(), end="")
        print(f"wrote {files['table']}, {files['json']} and {files['plot']}")
    return results


def diloco_runs(cfg: Config, mesh, task, lead: bool, optimizer) -> list:
    """``(result, its DiLoCoParallel)`` of one DiLoCo run per name of
    ``cfg.extra_runs`` (`common.diloco`), named ``diloco-<name>``; its
    ``wire_bytes`` are the mean per step (`DiLoCoParallel.mean_bytes`),
    ``wire_bytes_max`` a synchronising step's."""
    if not cfg.extra_runs:
        return []
    from common.diloco import DiLoCoParallel

    ddp = DiLoCoParallel(build(cfg), mesh, cfg)
    bar = progress_bar if cfg.progress and lead else None
    out = []
    for name in cfg.extra_runs:
        r = train(ddp, name, cfg, task, progress=bar, optimizer=optimizer)
        r.name = f"diloco-{name}"
        r.wire_bytes = ddp.mean_bytes(name, jax.random.key(cfg.seed), r.steps[-1])
        out.append((r, ddp))
    return out


def main(argv=None):
    cfg = parse_config(Config, argv, description=__doc__.splitlines()[0])
    return run(cfg)


if __name__ == "__main__":
    main()
