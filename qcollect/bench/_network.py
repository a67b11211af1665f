"""Measurements of ``python -m qcollect.bench network`` (runs in every process)."""

from __future__ import annotations

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
from qcollect.bench._timing import interleaved_medians
from qcollect.bench.collectives import _pca_for, _structured

MIB = 1 << 20


def _reducer(method: str, size: int, n: int):
    """``v -> estimate of the sum over axis "d"`` for one method."""
    if method == "psum":
        return lambda v: lax.psum(v, "d")
    if method == "ring":
        return lambda v: qc.ring_all_reduce(v, "d")
    compressor, algorithm = {
        "cast-bf16": (lambda: qc.cast("bfloat16"), "ring"),
        "qsgd-8": (lambda: qc.qsgd(bits=8), "pairwise"),
        "qsgd-4": (lambda: qc.qsgd(bits=4), "pairwise"),
        "onebit": (lambda: qc.onebit(), "pairwise"),
        "adaptive": (lambda: qc.adaptive(grouping="bucket"), "pairwise"),
        "pca": (lambda: _pca_for(size, n), "ring"),
    }[method]
    c = compressor()
    key = jax.random.key(0)
    return lambda v: qc.compressed_all_reduce(v, "d", c, key, algorithm=algorithm).value


def _buffers(size: int, mesh) -> jax.Array:
    """``(devices, size)`` float32, gradient-like, a different draw per process."""
    local = _structured(size, jax.local_device_count(), seed=1 + jax.process_index())
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), np.asarray(local))


def _values(mib: float) -> int:
    """float32 values in ``mib`` MiB, a multiple of 64 (PCA's slices), at least 64."""
    return max(64, int(round(mib * MIB / 4 / 64)) * 64)


def _mapped(fn, mesh):
    """``jit(shard_map)`` of a per-device ``fn`` over rows of a ``P("d")`` array."""
    return jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh,
                                 in_specs=P("d"), out_specs=P("d")))


def _local_row(x: jax.Array) -> np.ndarray:
    return np.asarray(x.addressable_shards[0].data, np.float64)[0]


def measure(sizes_mib: list[float], methods: list[str], repeats: int) -> list[dict] | None:
    """Times every method at every size; the rows on process 0, None elsewhere."""
    n = jax.device_count()
    if n < 2:
        raise ValueError("the network benchmark needs at least 2 devices, got 1")
    mesh = jax.make_mesh((n,), ("d",))
    rank0 = jax.process_index() == 0
    rows = []
    if rank0:
        print(f"# {jax.process_count()} processes, {n} devices, median of {repeats} "
              "interleaved runs", flush=True)
        print(table_header(), flush=True)
    for mib in sizes_mib:
        size = _values(mib)
        x = _buffers(size, mesh)
        calls = {m: (_mapped(_reducer(m, size, n), mesh), (x,))
                 for m in ["psum"] + [m for m in methods if m != "psum"]}
        exact = _local_row(calls["psum"][0](x))
        errors = {m: float(np.linalg.norm(_local_row(fn(*a)) - exact) / np.linalg.norm(exact))
                  for m, (fn, a) in calls.items()}
        wire = {m: qc.wire_bytes(fn, *a) for m, (fn, a) in calls.items()}
        seconds = interleaved_medians(calls, repeats)  # psum always, for the speedup
        for m in methods:
            row = {"processes": jax.process_count(), "devices": n, "mib": mib,
                   "values": size, "method": m, "median_ms": 1e3 * seconds[m],
                   "speedup_vs_psum": seconds["psum"] / seconds[m],
                   "wire_bytes": wire[m], "wire_vs_psum": wire["psum"] / wire[m],
                   "relative_error": errors[m]}
            rows.append(row)
            if rank0:
                print(table_row(row), flush=True)
    return rows if rank0 else None


def swap_probe(sizes_mib: list[float], repeats: int) -> str | None:
    """Times a swap of the buffer between device r and r + N/2 (N even).

    One ``lax.ppermute`` against qcollect's `permute` (256 KiB pieces across
    processes on the CPU backend), with ``psum`` of the same buffer for
    scale. Returns the markdown table on process 0, None elsewhere.
    """
    from qcollect._ring import SWAP_PIECE_BYTES, permute

    n = jax.device_count()
    if n % 2:
        raise ValueError(f"the swap probe needs an even number of devices, got {n}")
    mesh = jax.make_mesh((n,), ("d",))
    perm = [(i, (i + n // 2) % n) for i in range(n)]
    lines = [f"| MiB / process | one collective-permute ms | {SWAP_PIECE_BYTES >> 10} KiB "
             "pieces ms | psum ms | collective-permutes (one / pieces) |",
             "|---:|---:|---:|---:|---:|"]
    for mib in sizes_mib:
        x = _buffers(_values(mib), mesh)
        fns = {"whole": lambda v: lax.ppermute(v, "d", perm),
               "pieces": lambda v: permute(v, "d", perm),
               "psum": lambda v: lax.psum(v, "d")}
        calls = {k: (_mapped(f, mesh), (x,)) for k, f in fns.items()}
        t = interleaved_medians(calls, repeats)
        count = {k: sum(op.multiplicity for op in qc.wire_report(calls[k][0], *calls[k][1])
                        if op.op == "collective-permute") for k in ("whole", "pieces")}
        lines.append(f"| {mib:g} | {1e3 * t['whole']:.1f} | {1e3 * t['pieces']:.1f} "
                     f"| {1e3 * t['psum']:.1f} | {count['whole']} / {count['pieces']} |")
        if jax.process_index() == 0:
            print(lines[-1] if len(lines) > 3 else "\n".join(lines), flush=True)
    return "\n".join(lines) if jax.process_index() == 0 else None


def table_header() -> str:
    return ("| MiB / process | method | median ms | speedup vs psum | wire bytes / process "
            "| wire vs psum | rel. error of sum |\n|---:|---|---:|---:|---:|---:|---:|")


def table_row(r: dict) -> str:
    return (f"| {r['mib']:g} | {r['method']} | {r['median_ms']:.1f} | "
            f"{r['speedup_vs_psum']:.2f}x | {r['wire_bytes']:,} | {r['wire_vs_psum']:.1f}x | "
            f"{r['relative_error']:.2e} |")


def table(rows: list[dict]) -> str:
    return "\n".join([table_header()] + [table_row(r) for r in rows])


def plot(rows: list[dict], path, bandwidth: str) -> bool:
    """Median time against buffer size per method (log-log); False without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return False
    fig = Figure(figsize=(7, 4.5), dpi=100)
    ax = fig.subplots()
    for m in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == m]
        ax.plot([r["mib"] for r in rs], [r["median_ms"] for r in rs], marker="o", label=m,
                linestyle="--" if m == "psum" else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("float32 buffer per process (MiB)")
    ax.set_ylabel("all-reduce median time (ms)")
    links = "unshaped loopback" if bandwidth.lower() == "none" else f"links {bandwidth}"
    ax.set_title(f"{rows[0]['processes']} processes, {links}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    return True
