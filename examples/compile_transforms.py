"""Compile time and program size of the optax transforms' update step.

The companion of ``python -m qcollect.bench compile`` (which compiles the
all-reduce alone) for what a training step compiles: ``tx.update`` of
`transforms.powersgd`, `transforms.compressed_all_reduce` (with error
feedback) and `transforms.gradiveq` on the same transformer-shaped float32
pytree (blocks of four 512 x 512 attention matrices, a 512 x 2048 and a
2048 x 512 MLP matrix and four 512-vectors), inside ``jax.shard_map`` on
``QCOLLECT_DEVICES`` (default 8) simulated CPU devices. Gradients and state
are abstract shapes: nothing is allocated unless ``--runs`` asks for step
times. Methods:

* ``powersgd``: rank 4, compressed from step 0 (``compress_after=0``), warm start;
* ``allreduce-qsgd-4``, ``allreduce-onebit``: the compressed all-reduce
  transform with error feedback;
* ``gradiveq``: 64-value slices at rank 8 (PCA compression and QSGD sampling
  steps, both branches of its phase switch; its step times are of
  compressed steps, the PCA ring).

Each size is compiled once, smallest first, after a warm-up compile of one
block::

    python examples/compile_transforms.py --params 19,38,76,151 --out results

Writes ``{out}/compile_transforms.{json,md}`` (the tables of the compile
benchmark: lower and compile seconds, StableHLO and optimised HLO MB, XLA's
scratch MB per device, step ms with ``--runs``).
"""

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common.config import check_folder  # noqa: E402
from common.devices import simulate_cpu_devices  # noqa: E402

METHODS = ("powersgd", "allreduce-qsgd-4", "allreduce-onebit", "gradiveq")
_SAMPLE_STEPS = 100  # GradiVeQ's sampling steps per cycle


def transformation(method: str, axis: str):
    import jax

    import qcollect as qc
    import transforms

    key = jax.random.key(0)
    if method == "powersgd":
        return transforms.powersgd(axis, rank=4, key=key, compress_after=0)
    if method == "allreduce-qsgd-4":
        return transforms.compressed_all_reduce(axis, compressor=qc.qsgd(bits=4), key=key)
    if method == "allreduce-onebit":
        return transforms.compressed_all_reduce(axis, compressor=qc.onebit(), key=key)
    if method == "gradiveq":
        return transforms.gradiveq(axis, key=key, slice_size=64, rank=8,
                                   sample_steps=_SAMPLE_STEPS)
    raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")


def measure(method: str, blocks: int, runs: int = 0, width: int = 512) -> dict:
    """Lowers and compiles one update step of ``method`` for ``blocks`` blocks."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import transforms
    from qcollect.bench.workload import block_shapes

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    n = mesh.shape["d"]
    shapes = {f"block_{b:04d}": {k: jax.ShapeDtypeStruct(s, np.float32)
                                 for k, s in block_shapes(width).items()}
              for b in range(blocks)}
    tx = transformation(method, "d")
    specs = transforms.state_specs(jax.eval_shape(tx.init, shapes), "d")

    def abstract(leaf, spec):
        per_device = spec != P()
        shape = (n, *leaf.shape) if per_device else leaf.shape
        return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    state = jax.tree.map(abstract, jax.eval_shape(tx.init, shapes), specs)
    grads = jax.tree.map(lambda s: abstract(s, P("d")), shapes)

    def body(g, s):
        return tx.update(jax.tree.map(lambda x: x[0], g), s)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), specs),
                               out_specs=(P(), specs)))
    start = time.perf_counter()
    lowered = fn.lower(grads, state)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    record = {"lower_s": lowered_at - start, "compile_s": time.perf_counter() - lowered_at,
              "stablehlo_bytes": len(lowered.as_text()), "hlo_bytes": len(compiled.as_text())}
    memory = compiled.memory_analysis()
    if memory is not None:
        record["temp_bytes"] = int(memory.temp_size_in_bytes)
    if runs:
        params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        real_state = transforms.init_sharded(tx, params, mesh, "d")
        if method == "gradiveq":  # into the cycle's compressed steps
            real_state = real_state._replace(count=real_state.count + _SAMPLE_STEPS)
        real_grads = jax.tree.map(
            lambda s: jax.device_put(jax.random.normal(jax.random.key(0), s.shape),
                                     s.sharding), grads)
        jax.block_until_ready(compiled(real_grads, real_state))  # warm
        times = []
        for _ in range(runs):
            begin = time.perf_counter()
            jax.block_until_ready(compiled(real_grads, real_state))
            times.append(time.perf_counter() - begin)
        record["step_ms"] = 1e3 * float(np.median(times))
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", default="19,38,76,151",
                   help="model sizes in millions of parameters, comma-separated")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, of: {', '.join(METHODS)}")
    p.add_argument("--runs", type=int, default=0, help="also time this many steps (allocates)")
    p.add_argument("--out", default="results", help="output directory")
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method {unknown[0]!r}; known: {', '.join(METHODS)}")
    try:
        targets = [float(t) for t in args.params.split(",")]
    except ValueError:
        p.error(f"--params must be numbers, got {args.params!r}")
    if args.runs < 0 or any(t <= 0 for t in targets):
        p.error("--params must be > 0 and --runs >= 0")
    try:
        check_folder("out", args.out)
    except ValueError as err:
        p.error(str(err))
    simulate_cpu_devices()

    import jax
    from tqdm import tqdm

    from qcollect.bench.workload import block_params, block_shapes, blocks_for, tables

    width = 512
    sizes = sorted({blocks_for(t, width) for t in targets})
    rows = []
    with tqdm(total=len(methods) * len(sizes), desc="compile", unit="program") as bar:
        for method in methods:
            bar.set_postfix_str(method)
            measure(method, 1)  # warm-up: JAX's one-time tracing and compiling costs
            for blocks in sizes:
                rows.append({"method": method, "blocks": blocks,
                             "parameters": blocks * block_params(width),
                             "leaves": blocks * len(block_shapes(width)),
                             **measure(method, blocks, args.runs)})
                bar.update()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_transforms.json").write_text(json.dumps(rows, indent=1))
    text = tables(rows, methods, jax.device_count()).replace(
        "# Compile time and program size", "# Compile time of the transforms' update step", 1)
    (out / "compile_transforms.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
