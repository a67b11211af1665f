"""Measurements of ``python -m qcollect.bench network`` (runs in every process).

The methods as reducers of one device's buffer, the buffers and meshes of a
job, the timed table and the probes (``--swap-probe``, ``--message-probe``,
``--node-probe``), and the physical floors added afterwards. What each
measures is described in `qcollect.bench.network` and, with the measured
tables, in docs/multiprocess.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Var
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
from qcollect.bench import _options
from qcollect.bench._timing import Call, interleaved_medians
from qcollect.bench.collectives import _pca_for, _structured
from qcollect.bench.compile import parse_batch_buckets

MIB = 1 << 20
#: Methods without a codec: their transport is themselves.
UNCOMPRESSED = ("psum", "psum-bf16", "ring")
#: The mesh axes of a run with several devices per process: one node per process.
NODE_AXES = ("node", "local")
#: Suffix of a method run hierarchically over `NODE_AXES`.
HIERARCHICAL = "/h"
#: A function of one device's buffer (or list of leaves) inside ``shard_map``.
Reducer = Callable[[Any], Any]


def transport_only(compressor: qc.Compressor) -> qc.Compressor:
    """``compressor``'s wire format without its codec.

    Encoding fills a payload of the real one's shapes and dtypes (read with
    `jax.eval_shape`) with the chunk's first values, converted; decoding
    broadcasts the sum of the payload's words over the output.
    In `compressed_all_reduce` it runs the same collectives on the same bytes
    as ``compressor``, so its time is what the transfers alone take on the
    link: the transport floor.
    """

    def encode(x: jax.Array, key: jax.Array | None = None, **kwargs: Any) -> qc.Payload:
        def real(x: jax.Array) -> Any:
            return compressor.encode(x, jax.random.key(0), **kwargs).arrays

        template = jax.eval_shape(lambda x: compressor.encode(x, jax.random.key(0), **kwargs), x)
        order = [path[0].key for path, _ in
                 jax.tree_util.tree_flatten_with_path(template.arrays)[0]]
        constant = dict(zip(order, _constant_outputs(jax.make_jaxpr(real)(x)), strict=True))
        flat = jnp.ravel(x)
        arrays = {}
        for k, (name, leaf) in enumerate(template.arrays.items()):
            count = int(np.prod(leaf.shape))
            if constant[name]:
                # A constant of the real payload (PCA's weight) stays one: in a batch
                # of buckets it is sent once, as the real one is.
                arrays[name] = jnp.full(leaf.shape, k, leaf.dtype)
                continue
            values = jnp.resize(flat, (count,)) if flat.size else jnp.zeros((count,), flat.dtype)
            # + k: arrays of one shape must differ, or XLA sends one for both.
            arrays[name] = (values + k).astype(leaf.dtype).reshape(leaf.shape)
        return qc.Payload(arrays, template.shape, template.dtype, "transport/" + compressor.name)

    def decode(payload: qc.Payload) -> jax.Array:
        # Every word is read (a sum), so that XLA leaves no piece of a
        # transfer unsent as dead code.
        total = sum(jnp.sum(leaf, dtype=jnp.float32) for leaf in jax.tree.leaves(payload.arrays))
        return jnp.broadcast_to(total, payload.shape).astype(payload.dtype)

    return qc.Compressor("transport/" + compressor.name, encode, decode,
                         linear=compressor.linear, stochastic=False, block=compressor.block,
                         grouping=compressor.grouping, masks_padding=compressor.masks_padding)


def _in_leaves(reduce: Reducer, leaves: int) -> Reducer:
    """``reduce`` of ``v`` cut into ``leaves`` equal leaves (a list), the sums
    joined back into one vector."""
    if leaves == 1:
        return reduce
    return lambda v: jnp.concatenate(reduce(list(v.reshape(leaves, -1))))


def _constant_outputs(closed: Any) -> list[bool]:
    """For each output of a closed jaxpr (in `jax.tree`'s order of its
    leaves), whether it depends on none of the inputs."""
    jaxpr = closed.jaxpr
    varying = set(map(id, jaxpr.invars))
    for eqn in jaxpr.eqns:
        if any(id(v) in varying for v in eqn.invars if isinstance(v, Var)):
            varying.update(map(id, eqn.outvars))
    return [not (isinstance(v, Var) and id(v) in varying) for v in jaxpr.outvars]


#: The compressed methods, each one compressor and algorithm (`method_compressor`).
COMPRESSED = ("cast-bf16", "qsgd-8", "qsgd-4", "onebit", "adaptive", "pca")


def method_compressor(method: str, size: int, n: int) -> tuple[qc.Compressor, qc.Algorithm]:
    """``(compressor, algorithm)`` of a compressed method of `COMPRESSED` for
    buffers of ``size`` values on ``n`` devices."""
    methods: dict[str, tuple[Callable[[], qc.Compressor], qc.Algorithm]] = {
        "cast-bf16": (lambda: qc.cast("bfloat16"), "ring"),
        "qsgd-8": (lambda: qc.qsgd(bits=8), "pairwise"),
        "qsgd-4": (lambda: qc.qsgd(bits=4), "pairwise"),
        "onebit": (lambda: qc.onebit(), "pairwise"),
        "adaptive": (lambda: qc.adaptive(grouping="bucket"), "pairwise"),
        "pca": (lambda: _pca_for(size, n), "ring"),
    }
    compressor, algorithm = methods[method]
    return compressor(), algorithm


def reducer(method: str, size: int, n: int, transport: bool = False, leaves: int = 1,
             bucket_bytes: int = qc.BUCKET_BYTES) -> Reducer:
    """``v -> estimate of the sum over every device`` for one method: over axis
    ``"d"``, or hierarchically over `NODE_AXES` for ``METHOD/h`` (``transport``:
    the same collectives without the codec, `transport_only`), with ``v`` cut
    into ``leaves`` equal leaves and reduced in buckets of ``bucket_bytes``. A
    suffix ``@B`` sets ``batch_buckets``, then ``:X`` the ``exchange``."""
    method, colon, exchange_text = method.partition(":")
    exchange = _options.exchange(exchange_text if colon else "permute")
    method, at, batch_text = method.partition("@")
    batch = parse_batch_buckets(batch_text) if at else qc.BATCH_BUCKETS
    if method == "psum":
        return _in_leaves(lambda v: lax.psum(v, "d"), leaves)
    if method == "psum-bf16":  # what a user writes: XLA:CPU sums it as float32
        return _in_leaves(lambda v: lax.psum(v.astype(jnp.bfloat16), "d").astype(v.dtype),
                          leaves)
    if method == "ring":
        return _in_leaves(lambda v: qc.ring_all_reduce(
            v, "d", bucket_bytes=bucket_bytes, batch_buckets=batch), leaves)
    axes: str | tuple[str, ...] = "d"
    if method.endswith(HIERARCHICAL):
        method, axes = method[:-len(HIERARCHICAL)], NODE_AXES
    method, _, pieces = method.partition("/p")
    c, algorithm = method_compressor(method, size, n)
    if transport:
        c = transport_only(c)
    key = jax.random.key(0)
    pipeline = int(pieces or 1)
    return _in_leaves(lambda v: qc.compressed_all_reduce(
        v, axes, c, key, algorithm=algorithm, pipeline=pipeline, bucket_bytes=bucket_bytes,
        batch_buckets=batch, exchange=exchange).value, leaves)


def variants(methods: list[str], pipelines: list[int], hierarchical: bool = False,
             batches: tuple[str, ...] = (), exchanges: tuple[str, ...] = ()) -> list[str]:
    """Every compressed method once per pipeline count: ``onebit`` for 1,
    ``onebit/p4`` for 4 (uncompressed methods once); with ``hierarchical``
    also ``onebit/h`` over `NODE_AXES`; with ``batches`` (``"always"``,
    ``"never"``) each of those once per ``batch_buckets``, as
    ``onebit@always``, ``onebit@never``; with ``exchanges`` each once per
    ``exchange``, as ``onebit:all_to_all``, ``onebit:permute``."""
    out = []
    for m in methods:
        if m in UNCOMPRESSED:
            out.append(m)
            continue
        named = [m if p == 1 else f"{m}/p{p}" for p in pipelines]
        named += [m + HIERARCHICAL] if hierarchical else []
        named = [f"{v}@{b}" for v in named for b in batches] if batches else named
        out += [f"{v}:{e}" for v in named for e in exchanges] if exchanges else named
    return out


def buffers(size: int, mesh: jax.sharding.Mesh) -> jax.Array:
    """``(devices, size)`` float32, gradient-like, a different draw per process,
    split over all of ``mesh``'s axes."""
    local = _structured(size, jax.local_device_count(), seed=1 + jax.process_index())
    spec = P(tuple(mesh.axis_names))
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), np.asarray(local))


def meshes() -> tuple[jax.sharding.Mesh, jax.sharding.Mesh | None]:
    """The one-axis mesh ``"d"`` over every device in process order, and, with
    several processes of several devices each, the same devices as a
    `NODE_AXES` grid with one node per process (else None: in one process no
    byte crosses between nodes)."""
    devices = np.asarray(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    flat = jax.sharding.Mesh(devices, ("d",))
    if jax.local_device_count() == 1 or jax.process_count() == 1:
        return flat, None
    return flat, jax.sharding.Mesh(devices.reshape(jax.process_count(), -1), NODE_AXES)


def process_link_bytes(fn: Callable[..., Any], x: Any, mesh: jax.sharding.Mesh) -> int:
    """Bytes this process sends to other processes per call, on its link.

    A collective-permute sends its operand once per source-target pair from
    one of this process's devices to another process's. The other
    collectives are counted as Gloo runs them, as a ring over each group's
    devices in order: every ring step from this process to another carries
    one device's bytes (so a psum over all devices, in process order, sends
    one device's ``2 (N - 1) / N`` of the buffer across each boundary, not
    every device's).
    """
    owner = [d.process_index for d in mesh.devices.flat]
    me = jax.process_index()
    total = 0.0
    for op in qc.wire_report(fn, x):
        if op.op == "collective-permute":
            edges = [pair for pair in op.devices or () if pair[0] != pair[1]]
        else:
            groups = op.devices or (tuple(range(len(owner))),)
            edges = [(g[i], g[(i + 1) % len(g)]) for g in groups if len(g) > 1
                     for i in range(len(g))]
        crossing = sum(owner[s] == me and owner[t] != me for s, t in edges)
        total += op.bytes_per_call * op.multiplicity * crossing
    return int(round(total))


def across_nodes(fn: Callable[..., Any], x: Any, grid: jax.sharding.Mesh) -> int:
    """Bytes per device per call that cross between nodes (collectives over any
    group of devices in more than one node; `qcollect.wire_bytes_by_axis`)."""
    return qc.bytes_along(qc.wire_bytes_by_axis(fn, x, mesh=grid), NODE_AXES[0])


def buffer_values(mib: float, leaves: int = 1) -> int:
    """float32 values in ``mib`` MiB, a multiple of 64 (PCA's slices) per leaf,
    at least 64 per leaf."""
    unit = 64 * leaves
    return max(unit, int(round(mib * MIB / 4 / unit)) * unit)


def mapped(fn: Reducer, mesh: jax.sharding.Mesh) -> Callable[..., jax.Array]:
    """``jit(shard_map)`` of a per-device ``fn`` over rows of an array split
    over all of ``mesh``'s axes."""
    spec = P(tuple(mesh.axis_names))
    return jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh,
                                 in_specs=spec, out_specs=spec))


def _local_row(x: jax.Array) -> np.ndarray:
    """This process's first device's row, in float64."""
    return np.asarray(x.addressable_shards[0].data, np.float64)[0]


def measure(sizes_mib: list[float], methods: list[str], repeats: int,
            leaves: int = 1, bucket_bytes: int = qc.BUCKET_BYTES) -> list[dict[str, Any]] | None:
    """Times every method at every size (each process's buffer cut into
    ``leaves`` equal leaves, reduced in buckets of ``bucket_bytes``); the rows
    on process 0, None elsewhere."""
    n = jax.device_count()
    if n < 2:
        raise ValueError("the network benchmark needs at least 2 devices, got 1")
    mesh, grid = meshes()
    rank0 = jax.process_index() == 0
    rows: list[dict[str, Any]] = []
    if rank0:
        layout = "" if grid is None else f" ({jax.process_count()} node x " \
            f"{jax.local_device_count()} local)"
        print(f"# {jax.process_count()} processes, {n} devices{layout}, median of {repeats} "
              "interleaved runs", flush=True)
        print(table_header(nodes=grid is not None), flush=True)
    for mib in sizes_mib:
        size = buffer_values(mib, leaves)
        x = buffers(size, mesh)
        xg = None if grid is None else buffers(size, grid)

        def call(m: str, transport: bool = False, size: int = size, x: jax.Array = x,
                 xg: jax.Array | None = xg) -> Call:
            on_grid = m.partition(":")[0].partition("@")[0].endswith(HIERARCHICAL)
            return (mapped(reducer(m, size, n, transport, leaves, bucket_bytes),
                            grid if on_grid else mesh),
                    (xg if on_grid else x,))

        calls = {m: call(m) for m in ["psum"] + [m for m in methods if m != "psum"]}
        exact = _local_row(calls["psum"][0](x))
        errors = {m: float(np.linalg.norm(_local_row(fn(*a)) - exact) / np.linalg.norm(exact))
                  for m, (fn, a) in calls.items()}
        moves = {m: call(m, transport=True) for m in methods if m not in UNCOMPRESSED}
        wire = {m: qc.wire_bytes(fn, *a) for m, (fn, a) in calls.items()}
        for m, (fn, a) in moves.items():
            if qc.wire_bytes(fn, *a) != wire[m]:
                raise AssertionError(f"the transport of {m} moves other bytes than {m}")
        # psum always, for the speedup; each method beside its transport.
        seconds = interleaved_medians(
            {**calls, **{f"{m} transport": call for m, call in moves.items()}}, repeats)
        # With nodes, the bytes that compete for the link are those across nodes.
        # The argument tuple ``a`` goes in whole, as one pytree argument.
        link = wire if grid is None else {m: across_nodes(fn, a, grid)
                                          for m, (fn, a) in calls.items()}
        for m in methods:
            transport = seconds.get(f"{m} transport", seconds[m])
            row = {"processes": jax.process_count(), "devices": n, "mib": mib,
                   "values": size, "leaves": leaves, "method": m, "median_ms": 1e3 * seconds[m],
                   "speedup_vs_psum": seconds["psum"] / seconds[m],
                   "wire_bytes": wire[m], "wire_vs_psum": link["psum"] / link[m],
                   "transport_ms": 1e3 * transport, "relative_error": errors[m]}
            if grid is not None:
                fn, a = calls[m]
                row["across_nodes_bytes"] = link[m]
                row["link_bytes"] = process_link_bytes(fn, a, grid)
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
    n = jax.device_count()
    if n % 2:
        raise ValueError(f"the swap probe needs an even number of devices, got {n}")
    mesh = jax.make_mesh((n,), ("d",))
    perm = [(i, (i + n // 2) % n) for i in range(n)]
    lines = ["| MiB / process | one collective-permute ms | in pieces ms | psum ms "
             "| collective-permutes (one / pieces) |",
             "|---:|---:|---:|---:|---:|"]
    for mib in sizes_mib:
        x = buffers(buffer_values(mib), mesh)
        fns = {"whole": lambda v: lax.ppermute(v, "d", perm),
               "pieces": lambda v: qc.permute(v, "d", perm),
               "psum": lambda v: lax.psum(v, "d")}
        calls = {k: (mapped(f, mesh), (x,)) for k, f in fns.items()}
        t = interleaved_medians(calls, repeats)
        count = {k: sum(op.multiplicity for op in qc.wire_report(calls[k][0], *calls[k][1])
                        if op.op == "collective-permute") for k in ("whole", "pieces")}
        lines.append(f"| {mib:g} | {1e3 * t['whole']:.1f} | {1e3 * t['pieces']:.1f} "
                     f"| {1e3 * t['psum']:.1f} | {count['whole']} / {count['pieces']} |")
        if jax.process_index() == 0:
            print(lines[-1] if len(lines) > 3 else "\n".join(lines), flush=True)
    return "\n".join(lines) if jax.process_index() == 0 else None


def _arrays_per_collective(fn: Callable[..., Any], x: jax.Array) -> str:
    """The operands of each collective in ``fn``'s compiled program, e.g. ``"34"``
    for one tuple all-reduce of 34 arrays, ``"1+1+1"`` for three single ones."""
    return "+".join(str(op.arrays) for op in qc.wire_report(fn, x))


def message_probe(sizes_mib: list[float], repeats: int,
                  leaves: Sequence[int] = (1, 8, 34, 128)) -> str | None:
    """Times what a step pays per message, not per byte.

    For each total size, the buffer cut into ``leaves`` equal arrays and
    summed by one ``lax.psum`` of the list (XLA's tuple all-reduce) against
    `qcollect.fused_psum` (one buffer); and a one-bit payload (sign words and
    two means per bucket: three arrays) sent one step around the ring by a
    ``lax.ppermute`` per array against qcollect's `permute` (one buffer).
    Returns the markdown table on process 0, None elsewhere.
    """
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",))
    perm = [(i, (i + 1) % n) for i in range(n)]
    onebit = qc.onebit()
    lines = ["| MiB / process | arrays | one per array ms | one buffer ms | arrays per collective "
             "(per array / one buffer) |", "|---:|---|---:|---:|---|"]
    for mib in sizes_mib:
        for k in leaves:
            x = buffers(buffer_values(mib, k), mesh)
            lines.append(_probe_row(_split_sums(k), x, mesh, repeats, f"{mib:g} | {k} (psum)"))
        x = buffers(buffer_values(mib), mesh)
        fns: dict[str, Reducer] = {"apart": lambda v: onebit.decode(jax.tree.map(
                   lambda a: lax.ppermute(a, "d", perm), onebit.encode(v))),
               "packed": lambda v: onebit.decode(qc.permute(onebit.encode(v), "d", perm))}
        lines.append(_probe_row(fns, x, mesh, repeats, f"{mib:g} | one-bit payload (ppermute)"))
        if jax.process_index() == 0:
            print("\n".join(lines), flush=True)
    return "\n".join(lines) if jax.process_index() == 0 else None


def _split_sums(k: int) -> dict[str, Reducer]:
    """A buffer cut into ``k`` arrays and summed over ``"d"``: ``"apart"`` by one
    ``lax.psum`` of the list, ``"packed"`` by `qcollect.fused_psum`."""

    def apart(v: jax.Array) -> jax.Array:
        return jnp.concatenate(lax.psum(jnp.split(v, k), "d"))

    def packed(v: jax.Array) -> jax.Array:
        return jnp.concatenate(qc.fused_psum(jnp.split(v, k), "d"))

    return {"apart": apart, "packed": packed}


def _probe_row(fns: dict[str, Reducer], x: jax.Array, mesh: jax.sharding.Mesh, repeats: int,
               label: str) -> str:
    """One row of the message probe: ``fns["apart"]`` beside ``fns["packed"]``."""
    calls = {k: (mapped(f, mesh), (x,)) for k, f in fns.items()}
    t = interleaved_medians(calls, repeats)
    arrays = " / ".join(_arrays_per_collective(calls[k][0], x) for k in ("apart", "packed"))
    return f"| {label} | {1e3 * t['apart']:.1f} | {1e3 * t['packed']:.1f} | {arrays} |"


def node_probe(sizes_mib: list[float], repeats: int) -> str | None:
    """Times the collectives inside a node (over ``"local"`` of the `NODE_AXES`
    grid, one node per process) that a hierarchical all-reduce can use.

    XLA's reduce-scatter (``lax.psum_scatter``) against qcollect's
    ``ppermute`` ring (`qcollect.ring_reduce_scatter`) of the same bytes,
    with ``lax.psum`` and the all-gather (``lax.all_gather``) over
    ``"local"`` and ``lax.psum`` over ``"node"`` for scale. Returns the
    markdown table on process 0, None elsewhere.
    """
    _, grid = meshes()
    if grid is None:
        raise ValueError("the node probe needs several processes of several devices each")
    local = jax.local_device_count()
    lines = ["| MiB / device | psum_scatter ms | ring reduce-scatter ms | psum ms "
             "| all_gather ms | psum over node ms |", "|---:|---:|---:|---:|---:|---:|"]
    for mib in sizes_mib:
        size = buffer_values(mib) // local * local
        x = buffers(size, grid)
        shard = size // local

        def all_gather(v: jax.Array, n: int = shard) -> jax.Array:
            return qc.all_gather_invariant(v[:n], "local")

        fns: dict[str, Reducer] = {"psum_scatter": lambda v: jnp.tile(lax.psum_scatter(
                   v.reshape(local, -1), "local", scatter_dimension=0, tiled=False), local),
               "ring": lambda v: jnp.tile(qc.ring_reduce_scatter(v, "local"), local),
               "psum": lambda v: lax.psum(v, "local"),
               "all_gather": all_gather,
               "node": lambda v: lax.psum(v, "node")}
        t = interleaved_medians({k: (mapped(f, grid), (x,)) for k, f in fns.items()}, repeats)
        lines.append(f"| {mib:g} | " + " | ".join(f"{1e3 * t[k]:.1f}" for k in fns) + " |")
        if jax.process_index() == 0:
            print(lines[-1] if len(lines) > 3 else "\n".join(lines), flush=True)
    return "\n".join(lines) if jax.process_index() == 0 else None


def link_bytes(r: dict[str, Any]) -> int:
    """Bytes a process sends over its link per call: its device's bytes with one
    device per process, else `process_link_bytes`."""
    if r.get("link_bytes") in (None, ""):
        return int(r["wire_bytes"])
    return int(r["link_bytes"])


def with_floors(rows: list[dict[str, Any]], unshaped_ms: dict[tuple[str, str], float],
                rate_bits: int) -> list[dict[str, Any]]:
    """``rows`` (as read from the CSV) with the physical limits of each.

    ``unshaped_ms`` maps ``(mib, method)`` (the CSV's strings) to the median
    of the same program on an unshaped network. Adds ``wire_floor_ms``
    (``8 * link_bytes / rate_bits``), ``unshaped_ms``, ``efficiency``
    (``max(wire floor, unshaped) / median``) and ``of_wire_ratio`` (the
    speedup over psum divided by the wire-byte ratio).
    """
    out = []
    for r in rows:
        median = float(r["median_ms"])
        wire_floor = 1e3 * 8 * link_bytes(r) / rate_bits
        unshaped = unshaped_ms.get((r["mib"], r["method"]), float("nan"))
        out.append(dict(r, wire_floor_ms=wire_floor, unshaped_ms=unshaped,
                        efficiency=max(wire_floor, unshaped) / median,
                        of_wire_ratio=float(r["speedup_vs_psum"]) / float(r["wire_vs_psum"])))
    return out


#: A table column: header, alignment, format of the row's value.
Column = tuple[str, str, Callable[[dict[str, Any]], str]]
_COLUMNS: list[Column] = [
    ("MiB / process", "---:", lambda r: f"{float(r['mib']):g}"),
    ("method", "---", lambda r: r["method"]),
    ("median ms", "---:", lambda r: f"{float(r['median_ms']):.1f}"),
    ("speedup vs psum", "---:", lambda r: f"{float(r['speedup_vs_psum']):.2f}x"),
    ("wire bytes / process", "---:", lambda r: f"{int(r['wire_bytes']):,}"),
    ("wire vs psum", "---:", lambda r: f"{float(r['wire_vs_psum']):.1f}x"),
    ("across nodes / device", "---:", lambda r: f"{int(r['across_nodes_bytes']):,}"),
    ("link bytes / process", "---:", lambda r: f"{int(r['link_bytes']):,}"),
    ("of wire ratio", "---:", lambda r: f"{100 * float(r['of_wire_ratio']):.0f}%"),
    ("wire floor ms", "---:", lambda r: f"{float(r['wire_floor_ms']):.1f}"),
    ("transport ms", "---:", lambda r: f"{float(r['transport_ms']):.1f}"),
    ("unshaped ms", "---:", lambda r: f"{float(r['unshaped_ms']):.1f}"),
    ("efficiency", "---:", lambda r: f"{float(r['efficiency']):.2f}"),
    ("rel. error of sum", "---:", lambda r: f"{float(r['relative_error']):.2e}"),
]
_FLOORS = {"of wire ratio", "wire floor ms", "unshaped ms", "efficiency"}
_NODES = {"across nodes / device", "link bytes / process"}


def _columns(floors: bool, nodes: bool = False) -> list[Column]:
    """The columns of a table with the floors' and the nodes' columns or without."""
    return [c for c in _COLUMNS if (floors or c[0] not in _FLOORS)
            and (nodes or c[0] not in _NODES)]


def _has_nodes(r: dict[str, Any]) -> bool:
    return r.get("across_nodes_bytes") not in (None, "")


def table_header(floors: bool = False, nodes: bool = False) -> str:
    """The markdown header and alignment lines of the measured table."""
    cols = _columns(floors, nodes)
    return ("| " + " | ".join(c[0] for c in cols) + " |\n|"
            + "|".join(c[1] for c in cols) + "|")


def table_row(r: dict[str, Any]) -> str:
    """One row of the measured table (its columns follow the row's fields)."""
    return "| " + " | ".join(c[2](r) for c in _columns("efficiency" in r, _has_nodes(r))) + " |"


def table(rows: list[dict[str, Any]]) -> str:
    """The measured table of ``rows`` in markdown."""
    return "\n".join([table_header("efficiency" in rows[0], _has_nodes(rows[0]))]
                     + [table_row(r) for r in rows])


def plot(rows: list[dict[str, Any]], path: str | os.PathLike[str], bandwidth: str) -> bool:
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
