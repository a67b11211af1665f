"""Collectives benchmark on simulated CPU devices.

Two tables:

* accuracy and wire bytes: for N = 2, 4, 8 devices each holding a
  gradient-like float32 vector, every compressor through each algorithm it
  supports; wire bytes per device (``qcollect.wire_bytes`` of the compiled
  program) relative to ``lax.psum`` of the same buffer, and the relative error
  ``||estimate - sum|| / ||sum||``;
* timing: `ring_all_reduce` versus `lax.psum` on the same devices, medians of
  interleaved runs. In-process CPU devices share memory and have no network,
  so this measures the ring's overhead, not what compression saves on a wire.

Measured: docs/benchmarks.md, "Collectives".
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
from qcollect.bench._timing import interleaved_medians


def _pca_for(size: int, n: int) -> qc.Compressor:
    """A rank-8 PCA of 64-value slices, fitted on data like the benchmark's."""
    samples = _structured(64 * 256, 16, seed=99)  # 16 other draws of the same process
    fit = qc.pca_fit(samples, slice_size=64, rank=8, slices="all")
    return qc.pca(fit.basis, fit.mean, num_workers=n)


def _structured(size: int, n: int, seed: int = 0) -> jax.Array:
    """``n`` gradient-like vectors whose 64-value slices share a rank-8 subspace.

    Heavy-tailed scales per slice plus 5% isotropic noise: enough correlation
    between adjacent values for PCA to matter (GradiVeQ section 2), none
    assumed by the scalar quantizers.
    """
    basis = jax.random.normal(jax.random.key(1234), (8, 64))  # one subspace for all draws
    k2, k3, k4 = jax.random.split(jax.random.key(seed), 3)
    slices = size // 64
    coeffs = jax.random.laplace(k2, (n, slices, 8)) * jnp.exp(jax.random.normal(k3, (1, slices, 1)))
    signal = (coeffs @ basis).reshape(n, -1)
    noise = 0.05 * jax.random.normal(k4, signal.shape) * jnp.std(signal)
    return (signal + noise) * 1e-3


#: (compressor name, algorithm, compressor for ``(values, devices)``) of each row.
CASES: list[tuple[str, qc.Algorithm, Callable[[int, int], qc.Compressor]]] = [
    ("identity", "ring", lambda size, n: qc.identity()),
    ("cast-bf16", "ring", lambda size, n: qc.cast("bfloat16")),
    ("qsgd-8", "pairwise", lambda size, n: qc.qsgd(bits=8)),
    ("qsgd-8", "ring_requantize", lambda size, n: qc.qsgd(bits=8)),
    ("qsgd-4", "pairwise", lambda size, n: qc.qsgd(bits=4)),
    ("qsgd-4", "ring_requantize", lambda size, n: qc.qsgd(bits=4)),
    ("qsgd-2", "pairwise", lambda size, n: qc.qsgd(bits=2)),
    ("onebit", "pairwise", lambda size, n: qc.onebit()),
    ("onebit", "ring_requantize", lambda size, n: qc.onebit()),
    ("pca K=64 d=8", "ring", _pca_for),
]


def _mesh(n: int) -> jax.sharding.Mesh:
    return jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])


def accuracy_table(size: int, sizes: list[int]) -> list[dict[str, Any]]:
    """One row per device count in ``sizes`` and `CASES` entry: wire bytes
    against ``lax.psum``'s and the relative error of the sum (printed too)."""
    rows: list[dict[str, Any]] = []
    for n in sizes:
        mesh = _mesh(n)
        sharding = NamedSharding(mesh, P("d"))
        x = jax.device_put(_structured(size, n), sharding)
        keys = jax.device_put(jnp.stack([jax.random.key(0)] * n), sharding)
        exact = np.asarray(x, np.float64).sum(0)

        def mapped(fn: Callable[[jax.Array, jax.Array], jax.Array],
                   mesh: jax.sharding.Mesh = mesh) -> Callable[..., jax.Array]:
            return jax.shard_map(lambda v, k: fn(v[0], k[0])[None], mesh=mesh,
                                 in_specs=P("d"), out_specs=P("d"))

        psum = mapped(lambda v, k: lax.psum(v, "d"))
        psum_bytes = qc.wire_bytes(psum, x, keys)
        for name, algorithm, make in CASES:
            c = make(size, n)

            def reduce(v: jax.Array, k: jax.Array, c: qc.Compressor = c,
                       a: qc.Algorithm = algorithm) -> jax.Array:
                return qc.compressed_all_reduce(v, "d", c, k, algorithm=a).value

            fn = mapped(reduce)
            estimate = np.asarray(jax.jit(fn)(x, keys), np.float64)[0]
            rows.append({
                "devices": n, "compressor": name, "algorithm": algorithm,
                "wire_bytes": qc.wire_bytes(fn, x, keys),
                "psum_bytes": psum_bytes,
                "relative_error": float(np.linalg.norm(estimate - exact) / np.linalg.norm(exact)),
            })
            r = rows[-1]
            print(f"| {n} | {name} | {algorithm} | {r['wire_bytes']:,} | "
                  f"{r['wire_bytes'] / psum_bytes:.4f} | {r['relative_error']:.4f} |", flush=True)
    return rows


def timing_table(size: int, n: int, repeats: int) -> dict[str, float]:
    """Median seconds of ``lax.psum`` and `qcollect.ring_all_reduce` of ``size``
    values on ``n`` devices (the row printed too)."""
    mesh = _mesh(n)
    x = jax.device_put(_structured(size, n), NamedSharding(mesh, P("d")))

    def mapped(fn: Callable[[jax.Array], jax.Array]) -> Callable[..., jax.Array]:
        return jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh,
                                     in_specs=P("d"), out_specs=P("d")))

    t = interleaved_medians({
        "psum": (mapped(lambda v: lax.psum(v, "d")), (x,)),
        "ring": (mapped(lambda v: qc.ring_all_reduce(v, "d")), (x,)),
    }, repeats)
    print(f"| {n} | {size:,} | {1e3 * t['psum']:.2f} | {1e3 * t['ring']:.2f} | "
          f"{t['ring'] / t['psum']:.2f} |", flush=True)
    return t


def main(argv: list[str] | None = None) -> int:
    """Prints both tables; 0, or 2 for a bad argument."""
    parser = argparse.ArgumentParser(prog="python -m qcollect.bench collectives",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1 << 20,
                        help="float32 values per device (default 1M, a multiple of 64)")
    parser.add_argument("--devices", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    if args.size < 64 or args.size % 64:
        parser.error("--size must be a positive multiple of 64")
    jax.config.update("jax_num_cpu_devices", max(args.devices))
    if jax.device_count() < max(args.devices):
        parser.error(f"only {jax.device_count()} devices; JAX was initialised before "
                     "the device count could be set")
    print(f"# {args.size:,} float32 values per device, {jax.devices()[0].platform}")
    print("| N | compressor | algorithm | wire bytes/device | vs psum | rel. error of sum |")
    print("|---:|---|---|---:|---:|---:|")
    accuracy_table(args.size, args.devices)
    print(f"\n# ring_all_reduce vs lax.psum, median of {args.repeats} interleaved runs")
    print("| N | values/device | psum ms | ring ms | ring / psum |")
    print("|---:|---:|---:|---:|---:|")
    for size in (args.size // 16, args.size, args.size * 4):
        timing_table(size, max(args.devices), args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
