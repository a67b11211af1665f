"""Passes benchmark: the memory traffic of every compressed all-reduce, against
this machine's memory bandwidth.

``python -m qcollect.bench passes`` runs in one process on ``--devices``
simulated CPU devices (default 4; collectives are memory copies there, so
memory and the codec bound the step, not a link) and reports, for a
gradient-like float32 buffer of ``--values`` per device:

* the memory bandwidth, measured here, STREAM-style (McCalpin): a read
  (a sum over rows of 1024), a copy ``b = a + 1`` and a triad
  ``c = a + 1.5 b`` over buffers of the same size, run on every device at
  once (so the devices share the memory as the all-reduce's do), bytes
  counted from the compiled kernels (`qcollect.memory_bytes`); the fastest
  of the three is the bandwidth of the floors (STREAM counts a write once,
  though a write-allocate cache reads the line first, so a kernel that
  mostly reads can beat the triad's rate);
* per method (``psum``, the compressed methods of the network benchmark,
  each as the bare collective and as `transforms.compressed_all_reduce`
  with error feedback, the training path): the kernels that read or write
  at least one device's chunk (``1 / devices`` of the gradient: the
  "gradient-sized passes"), the total traffic per device in gradients
  (bytes / (4 * values)), the memory floor ``devices * traffic / triad
  bandwidth``, the measured median and ``efficiency = floor / measured``
  (1.0: the step moves its bytes at the fastest rate measured).

``--kernels`` also lists each method's gradient-sized kernels with their
bytes, so that a pass that need not exist can be found. Medians of
``--repeats`` interleaved runs; ``--json`` writes the rows.

Examples::

    python -m qcollect.bench passes
    python -m qcollect.bench passes --methods onebit,qsgd-4 --exchange permute,all_to_all

Measured: docs/benchmarks.md, "Passes: the memory traffic of each all-reduce".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
from qcollect.bench import _options
from qcollect.bench._network import COMPRESSED, method_compressor
from qcollect.bench._timing import Call, interleaved_medians
from qcollect.bench.collectives import _structured

METHODS = ("psum",) + COMPRESSED
#: How a method's step runs: the bare collective, or the optax transform.
StepPath = Literal["collective", "transform"]
PATHS: tuple[StepPath, ...] = get_args(StepPath)
#: Compiles a function of ``count`` arrays (`stream_calls`).
Wrap = Callable[[Callable[..., Any], int], Callable[..., Any]]


def _mesh(n: int) -> jax.sharding.Mesh:
    """The one-axis mesh ``"d"`` of the first ``n`` devices."""
    return jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])


def _per_device(fn: Callable[..., jax.Array], mesh: jax.sharding.Mesh, count: int = 1
                ) -> Callable[..., jax.Array]:
    """``jit(shard_map)`` of ``fn`` over ``count`` arrays of rows, one row per device."""
    body = lambda *vs: fn(*(v[0] for v in vs))[None]  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"),) * count,
                                 out_specs=P("d")))


#: STREAM-style kernels: name -> (function of two arrays, how many it reads).
STREAM: dict[str, tuple[Callable[[jax.Array, jax.Array], jax.Array], int]] = {
    "read": (lambda a, b: jnp.sum(a.reshape(-1, 1024), axis=1), 1),
    "copy": (lambda a, b: a + 1.0, 1),
    "triad": (lambda a, b: a + 1.5 * b, 2),
}


def _jit(fn: Callable[..., Any], count: int) -> Callable[..., Any]:
    """`stream_calls`' default ``wrap``: ``jax.jit(fn)``, whatever ``count``."""
    return jax.jit(fn)


def _first_only(fn: Callable[[jax.Array, jax.Array], jax.Array]
                ) -> Callable[[jax.Array], jax.Array]:
    """``fn`` of one array (a kernel that reads one array ignores the second)."""
    return lambda a: fn(a, None)


def stream_calls(a: jax.Array, b: jax.Array, wrap: Wrap = _jit) -> dict[str, Call]:
    """The `STREAM` kernels on ``a`` (and ``b``) as `interleaved_medians`
    calls, each function of ``count`` arrays compiled by ``wrap(fn, count)``."""
    calls = {}
    for name, (fn, count) in STREAM.items():
        kernel = fn if count == 2 else _first_only(fn)
        calls[f"stream {name}"] = (wrap(kernel, count), (a, b)[:count])
    return calls


def bandwidths(calls: dict[str, Call], seconds: dict[str, float], devices: int = 1
               ) -> dict[str, float]:
    """Bytes per second of each `stream_calls` kernel (its compiled bytes
    times ``devices``, over its median), and ``"best"``, the fastest."""
    rates = {name.removeprefix("stream "): devices * qc.memory_bytes(fn, *args) / seconds[name]
             for name, (fn, args) in calls.items() if name.startswith("stream ")}
    return {**rates, "best": max(rates.values())}


def stream(values: int, n: int, repeats: int) -> dict[str, float]:
    """`bandwidths` of the STREAM kernels run on every device at once."""
    mesh = _mesh(n)
    a, b = (jax.device_put(jnp.full((n, values), v, jnp.float32), NamedSharding(mesh, P("d")))
            for v in (1.0, 2.0))

    calls = stream_calls(a, b, lambda fn, count: _per_device(fn, mesh, count))
    return bandwidths(calls, interleaved_medians(calls, repeats), n)


def _step(method: str, path: StepPath, grads: jax.Array, mesh: jax.sharding.Mesh,
          exchange: qc.Exchange) -> Call:
    """``(jitted step, its arguments)``: one device's gradient all-reduced by
    ``method``, as the bare collective or as the transform (whose new state
    is an output, so that its residuals are computed)."""
    n, values = grads.shape
    if method == "psum":
        return _per_device(lambda g: lax.psum(g, "d"), mesh), (grads,)
    compressor, algorithm = method_compressor(method, values, n)
    key = jax.random.key(0)
    if path == "collective":
        return _per_device(lambda g: qc.compressed_all_reduce(
            g, "d", compressor, key, algorithm=algorithm, exchange=exchange).value,
            mesh), (grads,)
    import transforms  # the optax layer, only for this path

    tx = transforms.compressed_all_reduce("d", compressor=compressor, key=key,
                                          algorithm=algorithm, exchange=exchange)
    state = transforms.init_sharded(tx, jnp.zeros(values, jnp.float32), mesh, "d")
    specs = transforms.state_specs(state, "d")

    def update(g: jax.Array, s: Any) -> tuple[jax.Array, Any]:
        updates, s = tx.update(g[0], s)
        return updates[None], s

    return jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P("d"), specs),
                                 out_specs=(P("d"), specs))), (grads, state)


def measure(values: int, n: int, methods: Sequence[str], paths: Sequence[StepPath],
            exchanges: Sequence[qc.Exchange], repeats: int, bandwidth: float
            ) -> list[dict[str, Any]]:
    """One row per method, path and exchange (``psum`` once)."""
    collective: tuple[StepPath] = ("collective",)
    permute: tuple[qc.Exchange] = ("permute",)
    mesh = _mesh(n)
    grads = jax.device_put(_structured(values, n), NamedSharding(mesh, P("d")))
    chunk = 4 * values / n
    calls, meta = {}, {}
    for method in methods:
        for path in (collective if method == "psum" else paths):
            for exchange in (permute if method == "psum" else exchanges):
                label = method if method == "psum" else f"{method} {path} {exchange}"
                calls[label] = _step(method, path, grads, mesh, exchange)
                meta[label] = (method, path, exchange)
    seconds = interleaved_medians(calls, repeats)
    rows = []
    for label, (fn, args) in calls.items():
        kernels = qc.memory_report(fn, *args)
        big = [k for k in kernels if max(k.read, k.written) >= chunk]
        traffic = sum(k.traffic for k in kernels)
        floor = n * traffic / bandwidth
        method, path, exchange = meta[label]
        rows.append({
            "method": method, "path": path, "exchange": exchange, "devices": n,
            "values": values, "passes": sum(k.multiplicity for k in big),
            "traffic_gradients": traffic / (4 * values),
            "floor_ms": 1e3 * floor, "median_ms": 1e3 * seconds[label],
            "efficiency": floor / seconds[label],
            "kernels": [{"op": k.op, "name": k.name, "shape": k.shape, "read": k.read,
                         "written": k.written, "multiplicity": k.multiplicity} for k in big],
        })
    return rows


HEADER = ("| method | path | exchange | gradient-sized passes | traffic / gradient "
          "| memory floor ms | measured ms | efficiency |\n|---|---|---|---:|---:|---:|---:|---:|")


def row_text(r: dict[str, Any]) -> str:
    """One row of the table."""
    return (f"| {r['method']} | {r['path']} | {r['exchange']} | {r['passes']} "
            f"| {r['traffic_gradients']:.2f} | {r['floor_ms']:.2f} | {r['median_ms']:.2f} "
            f"| {r['efficiency']:.2f} |")


def kernel_text(r: dict[str, Any], values: int) -> str:
    """The gradient-sized kernels of one row, their bytes in gradients."""
    lines = [f"\n{r['method']} {r['path']} {r['exchange']}:"]
    for k in r["kernels"]:
        times = f" x{k['multiplicity']}" if k["multiplicity"] > 1 else ""
        lines.append(f"  {k['op']:<20} {k['shape'][:48]:<48} read {k['read'] / (4 * values):.3f}"
                     f"  write {k['written'] / (4 * values):.3f}{times}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measures and prints the table; 0, or 2 for a bad argument."""
    parser = argparse.ArgumentParser(prog="python -m qcollect.bench passes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=1 << 22,
                        help="float32 values per device (default 4M: 16 MiB), a multiple of 64")
    parser.add_argument("--devices", type=int, default=4, help="simulated devices (default 4)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help="collective (qc.compressed_all_reduce), transform "
                             "(transforms.compressed_all_reduce, error feedback) or both")
    parser.add_argument("--exchange", default="permute",
                        help="comma-separated exchange values (permute, all_to_all)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kernels", action="store_true",
                        help="also list each method's gradient-sized kernels")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    split = lambda text: [v.strip() for v in text.split(",") if v.strip()]  # noqa: E731
    methods, path_names, exchange_names = (split(args.methods), split(args.paths),
                                           split(args.exchange))
    for flag, got, allowed in (("--methods", methods, METHODS), ("--paths", path_names, PATHS),
                               ("--exchange", exchange_names, qc.EXCHANGES)):
        if not got or set(got) - set(allowed):
            parser.error(f"{flag} must name some of {', '.join(allowed)}, got {got}")
    paths = [_options.choose("--paths", name, PATHS) for name in path_names]
    exchanges = [_options.exchange(name) for name in exchange_names]
    if args.values < 64 or args.values % 64:
        parser.error("--values must be a positive multiple of 64")
    if args.devices < 2 or args.repeats < 1:
        parser.error("--devices must be >= 2 and --repeats >= 1")
    try:
        jax.config.update("jax_num_cpu_devices", args.devices)
    except RuntimeError:  # JAX is already running (called from Python): its devices count
        pass
    if jax.device_count() < args.devices:
        parser.error(f"only {jax.device_count()} devices; JAX was initialised before "
                     "the device count could be set")
    bandwidth = stream(args.values, args.devices, args.repeats)
    print(f"# {args.values:,} float32 values per device, {args.devices} "
          f"{jax.devices()[0].platform} devices in one process, median of {args.repeats} "
          f"interleaved runs\n# memory bandwidth (all devices at once): read "
          f"{bandwidth['read'] / 1e9:.1f} GB/s, copy {bandwidth['copy'] / 1e9:.1f} GB/s, "
          f"triad {bandwidth['triad'] / 1e9:.1f} GB/s", flush=True)
    rows = measure(args.values, args.devices, methods, paths, exchanges, args.repeats,
                   bandwidth["best"])
    print(HEADER)
    for r in rows:
        print(row_text(r))
    if args.kernels:
        for r in rows:
            print(kernel_text(r, args.values))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
