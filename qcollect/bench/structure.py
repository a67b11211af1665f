"""Per-layer semantics through the collective: a small-scale layer alone and
beside a large-scale one.

A pytree of two layers whose gradients differ in scale, as the layers of any
network do (a 512 x 128 kernel at 1e-3 and a 128 x 128 kernel at 1.0, on every
device a fresh Gaussian draw), is summed over N simulated CPU devices by
`qcollect.compressed_all_reduce` (default fusion, pairwise exchange). For every
compressor the table gives the relative error of the small layer's sum
``||estimate - sum|| / ||sum||`` when it is reduced alone and when it is
reduced in the tree, and the same for the large layer. Equal columns mean the
layer is coded as the paper codes one layer, whatever else is in the tree.

    python -m qcollect.bench structure [--devices 4]

Measured: docs/benchmarks.md, "Collectives".
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc

COMPRESSORS: dict[str, Callable[[], qc.Compressor]] = {
    "onebit (column)": lambda: qc.onebit(grouping="column"),
    "onebit (bucket 64)": lambda: qc.onebit(),
    "adaptive (pi 64, column)": lambda: qc.adaptive(64),
    "qsgd-4 (bucket 512)": lambda: qc.qsgd(bits=4),
    "entropy (c 6, huffman)": lambda: qc.entropy(),
    "threshold (tau 1e-3)": lambda: qc.threshold(1e-3),
}

SMALL, LARGE = ((512, 128), 1e-3), ((128, 128), 1.0)


def _errors(compressor: qc.Compressor, n: int, seed: int = 0) -> dict[str, float]:
    """The four relative errors of the table's row for ``compressor`` on ``n`` devices."""
    mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])
    keys = jax.random.split(jax.random.key(seed), 2)
    tree = [scale * jax.random.normal(k, (n,) + shape)
            for k, (shape, scale) in zip(keys, (SMALL, LARGE), strict=True)]

    def body(small: jax.Array, large: jax.Array) -> list[jax.Array]:
        def reduce(t: Any) -> Any:
            return qc.compressed_all_reduce(t, "d", compressor, jax.random.key(1)).value
        small, large = small[0], large[0]
        together = reduce([small, large])
        return [v[None] for v in (reduce(small), reduce(large), *together)]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    outs = [np.asarray(o)[0] for o in fn(*jax.device_put(tree, NamedSharding(mesh, P("d"))))]
    sums = [np.asarray(t, np.float64).sum(0) for t in tree]

    def rel(estimate: np.ndarray, total: np.ndarray) -> float:
        return float(np.linalg.norm(estimate - total) / np.linalg.norm(total))

    return {"small alone": rel(outs[0], sums[0]), "small in tree": rel(outs[2], sums[0]),
            "large alone": rel(outs[1], sums[1]), "large in tree": rel(outs[3], sums[1])}


def main(argv: list[str] | None = None) -> int:
    """Prints the table; 0, or 2 for a bad argument."""
    parser = argparse.ArgumentParser(prog="python -m qcollect.bench structure",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    args = parser.parse_args(argv)
    if args.devices < 1:
        parser.error("--devices must be >= 1")
    jax.config.update("jax_num_cpu_devices", args.devices)
    if jax.device_count() < args.devices:
        parser.error(f"only {jax.device_count()} devices; JAX was initialised before "
                     "--devices could take effect")
    print(f"# {args.devices} simulated CPU devices, pairwise; relative error of each "
          f"layer's sum: {SMALL[0]} at {SMALL[1]:g}, {LARGE[0]} at {LARGE[1]:g}")
    print("| compressor | small alone | small in tree | large alone | large in tree |")
    print("|---|---:|---:|---:|---:|")
    for name, make in COMPRESSORS.items():
        e = _errors(make(), args.devices)
        print(f"| {name} | {e['small alone']:.3f} | {e['small in tree']:.3f} "
              f"| {e['large alone']:.3f} | {e['large in tree']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
