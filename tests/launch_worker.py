"""Worker script for tests/test_launch.py, run by ``python -m qcollect.launch``.

Modes (first argument):
  ``check OUT_DIR``: ring, compressed and optax all-reduces on the global mesh
    (every process's devices), and hierarchical ones over ``("node", "local")``
    with one process per node, checked against sums computed with numpy; each
    process writes its rows to ``OUT_DIR/rank<r>.npz``. Exits 1 on mismatch.
  ``crash OUT_DIR``: process 1 exits with status 3 right after joining while
    process 0 waits in a collective that can never finish.
  ``sleep OUT_DIR``: prints ``ready`` and sleeps (for signal tests).
  ``hello OUT_DIR``: prints ``ok`` and exits.
  ``listen OUT_DIR``: process 0 prints the local addresses of the sockets
    listening on the coordinator's port (from ``/proc/net/tcp*``).
  ``stall OUT_DIR [LENGTH]``: three psums of ``LENGTH`` (default 4) floats per
    device, then process 1 prints ``stalling`` and sleeps while the others
    print ``waiting`` and keep calling the psum (a process that stopped
    arriving). Four floats run inline in the jitted call (no JAX frame on the
    Python stack); 65536 are dispatched asynchronously and waited for in
    ``jax.block_until_ready``.
Every mode writes its process id to ``OUT_DIR/pid<r>``.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sys
import time

import qcollect.launch

LENGTH = 1001   # not a multiple of the device count
SHARDED = 1000  # the reduce-scatter's length: a multiple of 1, 2, 4 and 8 devices
NODE_AXES = ("node", "local")
STEPS = 2
QSGD_LEVELS = 7  # 4-bit QSGD: a sign bit and 3-bit levels 0..7


def inputs(num_devices: int, step: int = 0):
    """Integer-valued float32 vectors, one row per device (sums are exact)."""
    import numpy as np

    rows = [np.random.default_rng(1000 * step + d).integers(-8, 9, LENGTH)
            for d in range(num_devices)]
    return np.stack(rows).astype(np.float32)


def global_array(mesh, full, spec=None):
    """A ``spec``-sharded (default ``P("d")``) array from the full host value (any
    process count)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.dtypes.issubdtype(full.dtype, jax.dtypes.prng_key):
        data = global_array(mesh, jax.random.key_data(full), spec)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(full))
    full = np.asarray(full)
    return jax.make_array_from_callback(full.shape, NamedSharding(mesh, spec or P("d")),
                                        lambda index: full[index])


def _in_small_pieces(run) -> dict:
    """``run()`` traced with 256-byte swap pieces, so that the pieces of a swap
    between processes (qcollect.collectives._ring.permute) are exercised, unevenly split."""
    from qcollect import _backend

    saved = _backend.SWAP_PIECE_BYTES
    _backend.SWAP_PIECE_BYTES = 256
    try:
        return run()
    finally:
        _backend.SWAP_PIECE_BYTES = saved


def compute(mesh) -> dict:
    """Every checked result on ``mesh`` (axis ``"d"``): name -> global ``(n, LENGTH)`` array."""
    import jax
    from jax.sharding import PartitionSpec as P

    import qcollect as qc
    import transforms

    n = mesh.shape["d"]
    key = jax.random.key(0)
    x = global_array(mesh, inputs(n))

    def mapped(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    def reduce_with(compressor, algorithm, exchange="permute"):
        def body(block):
            out = qc.compressed_all_reduce(block[0], "d", compressor, key, algorithm=algorithm,
                                           exchange=exchange)
            return out.value[None]
        return mapped(body)

    # Each algorithm by the N - 1 shifts (the default) and by one all-to-all.
    results = {
        "ring": mapped(lambda b: qc.ring_all_reduce(b[0], "d")[None]),
        "identity_ring": reduce_with(qc.identity(), "ring"),
        "identity_ring_all_to_all": reduce_with(qc.identity(), "ring", "all_to_all"),
        "qsgd4_pairwise": reduce_with(qc.qsgd(bits=4, stochastic=False), "pairwise"),
        "qsgd4_pairwise_all_to_all": reduce_with(qc.qsgd(bits=4, stochastic=False),
                                                 "pairwise", "all_to_all"),
    }
    def scatter_then_gather(compressor):
        """Sharded training's two collectives: the first SHARDED values
        reduce-scattered through ``compressor``, the shards gathered exactly."""
        def body(block):
            shard = qc.compressed_reduce_scatter(block[0][:SHARDED], "d", compressor, key)
            return qc.compressed_all_gather(shard.value, "d", qc.identity()).value[None]
        return mapped(body)

    results["scatter_gather_identity"] = scatter_then_gather(qc.identity())
    results["scatter_gather_qsgd4"] = scatter_then_gather(qc.qsgd(bits=4, stochastic=False))
    out = {name: jax.block_until_ready(fn(x)) for name, fn in results.items()}
    out.update(compute_hierarchical(mesh, key))
    out.update(_in_small_pieces(lambda: {
        "ring_pieces": jax.block_until_ready(
            mapped(lambda b: qc.ring_all_reduce(b[0], "d")[None])(x)),
        "identity_pairwise_pieces": jax.block_until_ready(
            reduce_with(qc.identity(), "pairwise")(x))}))

    for name, compressor in (("tx_identity", qc.identity()),
                             ("tx_qsgd4", qc.qsgd(bits=4, stochastic=False))):
        tx = transforms.compressed_all_reduce("d", compressor=compressor, key=key, mean=True,
                                              algorithm="auto",
                                              error_feedback=transforms.residual_feedback())
        state = transforms.init_sharded(tx, {"w": jax.numpy.zeros(LENGTH)}, mesh, "d")
        specs = transforms.state_specs(state, "d")

        def update(state, grads, tx=tx):
            updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state)
            return jax.tree.map(lambda u: u[None], updates), state

        step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(specs, P("d")),
                                     out_specs=(P("d"), specs)))
        for t in range(STEPS):
            grads = {"w": global_array(mesh, inputs(n, step=t))}
            updates, state = jax.block_until_ready(step(state, grads))
            out[f"{name}_step{t}"] = updates["w"]
    return out


def node_mesh(mesh):
    """``mesh``'s devices as a ``("node", "local")`` mesh with one process per node
    (two nodes in the single-process comparison)."""
    import jax

    nodes = max(jax.process_count(), 2)
    grid = mesh.devices.reshape(nodes, -1)
    if jax.process_count() > 1:
        assert all(len({d.process_index for d in row}) == 1 for row in grid), grid
    return jax.sharding.Mesh(grid, NODE_AXES)


def compute_hierarchical(mesh, key) -> dict:
    """Hierarchical all-reduces over ``("node", "local")``: name -> ``(n, LENGTH)``."""
    import jax
    from jax.sharding import PartitionSpec as P

    import qcollect as qc

    grid = node_mesh(mesh)
    x = global_array(grid, inputs(grid.size), P(NODE_AXES))

    def reduce_with(compressor, algorithm):
        def body(block):
            out = qc.compressed_all_reduce(block[0], NODE_AXES, compressor, key,
                                           algorithm=algorithm)
            return out.value[None]
        return jax.jit(jax.shard_map(body, mesh=grid, in_specs=P(NODE_AXES),
                                     out_specs=P(NODE_AXES)))

    return {"hier_identity": jax.block_until_ready(reduce_with(qc.identity(), "ring")(x)),
            "hier_qsgd4": jax.block_until_ready(
                reduce_with(qc.qsgd(bits=4, stochastic=False), "pairwise")(x))}


def local_rows(array) -> dict:
    """This process's rows of a ``P("d")`` array: row index -> numpy row."""
    import numpy as np

    return {s.index[0].start: np.asarray(s.data)[0] for s in array.addressable_shards}


def qsgd_bound(rows):
    """Largest error of a pairwise 4-bit QSGD sum with nearest rounding.

    Each contribution is rounded once to a grid of ``max|x| / 7`` (error at
    most half a step) and the owner's sum once more.
    """
    import numpy as np

    total = rows.sum(0)
    return 0.5 * (np.abs(rows).max(1).sum() + np.abs(total).max()) / QSGD_LEVELS + 1e-4


def check(results: dict, n: int) -> list[str]:
    """Mismatches of ``results``' local rows against numpy (empty when all agree)."""
    import numpy as np

    errors = []
    total = inputs(n).sum(0)
    expected = {"ring": (total, 0.0), "identity_ring": (total, 0.0),
                "identity_ring_all_to_all": (total, 0.0),
                "qsgd4_pairwise_all_to_all": (total, qsgd_bound(inputs(n))),
                "ring_pieces": (total, 0.0), "identity_pairwise_pieces": (total, 0.0),
                "qsgd4_pairwise": (total, qsgd_bound(inputs(n))),
                "hier_identity": (total, 0.0),
                "scatter_gather_identity": (total[:SHARDED], 0.0),
                # Every block is quantized once, by its origin: no owner term.
                "scatter_gather_qsgd4": (total[:SHARDED], qsgd_bound(inputs(n)[:, :SHARDED])),
                # Each node's sum is quantized once, by the device holding its share.
                "hier_qsgd4": (total, qsgd_bound(inputs(n).reshape(2, -1, LENGTH).sum(1)))}
    for t in range(STEPS):
        g = inputs(n, step=t)
        expected[f"tx_identity_step{t}"] = (g.mean(0), 0.0)
        # Error feedback: this step's input is g plus last step's residual,
        # whose size the first step's bound caps.
        bound = qsgd_bound(g) / n * (1 + t)
        expected[f"tx_qsgd4_step{t}"] = (g.mean(0), bound)
    for name, array in results.items():
        want, tol = expected[name]
        for row, got in local_rows(array).items():
            err = float(np.max(np.abs(got - want)))
            if not err <= tol:
                errors.append(f"{name} row {row}: max error {err} > {tol}")
    return errors


def listening(port: int) -> set[str]:
    """Local addresses (hex, as the kernel lists them) of TCP sockets
    listening on ``port``, IPv4 and IPv6."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    found.add(address)
    return found


def main(argv) -> int:
    mode, out_dir = argv[0], pathlib.Path(argv[1])
    qcollect.launch.initialize()
    import jax
    import numpy as np

    rank = jax.process_index()
    (out_dir / f"pid{rank}").write_text(str(os.getpid()))
    if mode == "sleep":
        print("ready", flush=True)
        time.sleep(120)
        return 0
    if mode == "hello":
        print("ok", flush=True)
        return 0
    if mode == "listen":
        if rank == 0:
            port = int(os.environ["QCOLLECT_COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
            print("listening on", " ".join(sorted(listening(port))), flush=True)
        return 0
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    if mode == "stall":
        length = int(argv[2]) if len(argv) > 2 else 4
        x = global_array(mesh, np.ones((jax.device_count(), length), np.float32))
        psum = jax.jit(jax.shard_map(functools.partial(jax.lax.psum, axis_name="d"), mesh=mesh,
                                     in_specs=jax.P("d"), out_specs=jax.P()))
        for _ in range(3):
            jax.block_until_ready(psum(x))
        if rank == 1:
            print("stalling", flush=True)
            time.sleep(120)
            return 0
        print("waiting", flush=True)
        while True:
            jax.block_until_ready(psum(x))
    if mode == "raise":   # five collectives, then rank 1 raises; rank 0 waits in the sixth
        x = global_array(mesh, inputs(jax.device_count()))
        psum = jax.jit(jax.shard_map(functools.partial(jax.lax.psum, axis_name="d"), mesh=mesh,
                                     in_specs=jax.P("d"), out_specs=jax.P()))
        for _ in range(5):
            jax.block_until_ready(psum(x))
        if rank == 1:
            print(f"raising at {time.time()}", flush=True)
            raise RuntimeError("rank 1 fails after five collectives")
        jax.block_until_ready(psum(x))
        time.sleep(120)
        return 0
    if mode == "crash":
        if rank == 1:
            sys.exit(3)
        x = global_array(mesh, inputs(jax.device_count()))
        psum = jax.jit(jax.shard_map(functools.partial(jax.lax.psum, axis_name="d"), mesh=mesh,
                                     in_specs=jax.P("d"), out_specs=jax.P()))
        print("waiting in a collective", flush=True)
        jax.block_until_ready(psum(x))
        time.sleep(120)
        return 0
    n = jax.device_count()
    print(f"process {rank} of {jax.process_count()}, {jax.local_device_count()} of {n} devices",
          flush=True)
    results = compute(mesh)
    errors = check(results, n)
    for e in errors:
        print(e, file=sys.stderr)
    rows = {f"{name}/{row}": v for name, a in results.items() for row, v in local_rows(a).items()}
    np.savez(out_dir / f"rank{rank}.npz", **rows)
    print("ok" if not errors else f"{len(errors)} mismatches", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
