"""Devices for the examples: simulated CPU devices (set before JAX initialises)
and reading per-device results in one process of several."""

import os

import numpy as np

MESHES = (("data",), ("node", "local"))


def simulate_cpu_devices(default: int = 8):
    """Asks XLA for ``QCOLLECT_DEVICES`` (default 8) host CPU devices.

    Only when no accelerator platform is requested and the flag is not set
    already; real GPUs or TPUs are used as they are. Must run before JAX
    creates its backends (before the first ``jax.devices()``).

    In a multi-process job (``python -m qcollect.launch``, SLURM's ``srun``,
    Open MPI's ``mpirun``, ...) `qcollect.launch.initialize` joins it instead
    (``jax.distributed``), with ``QCOLLECT_DEVICES_PER_PROCESS`` devices per
    process where set.
    """
    import qcollect.launch

    # XLA:CPU's LAPACK calls (GradiVeQ's eigendecompositions) go to OpenBLAS,
    # whose own threads then fight the simulated devices' for the cores: one
    # OpenBLAS thread halved a GradiVeQ run at width 2048 on 2 cores (38 s to
    # 19 s for 12 steps with two refits).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if qcollect.launch.initialize():
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    count = int(os.environ.get("QCOLLECT_DEVICES", default))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def local_values(per_device) -> np.ndarray:
    """This process's entries of a per-device ``P("data")`` array, flattened.

    All of them in a single process; with several processes (the launcher),
    other processes' devices cannot be read here.
    """
    return np.concatenate([np.asarray(shard.data).reshape(-1)
                           for shard in per_device.addressable_shards])


def data_mesh(axes=("data",), nodes: int = 0):
    """The data-parallel mesh of the examples.

    Args:
      axes: ``("data",)``, one axis over every device, or ``("node",
        "local")``, a grid of nodes by the devices of each: one node per
        process under the launcher (the processes are joined by the network,
        the devices of one process share its memory), else ``nodes``
        simulated nodes (default 2) of one process's devices.
      nodes: nodes of a one-process run (0: 2); ignored with several processes.

    Returns:
      A `jax.sharding.Mesh`; devices in process order, so a node's devices
      are one process's.
    """
    import jax

    axes = tuple(axes)
    if axes not in MESHES:
        raise ValueError(f"mesh must be one of {[','.join(m) for m in MESHES]}, got "
                         f"{','.join(axes)!r}")
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(axes) == 1:
        return jax.sharding.Mesh(np.asarray(devices), axes)
    count = jax.process_count() if jax.process_count() > 1 else (nodes or 2)
    if len(devices) % count:
        raise ValueError(f"nodes: {len(devices)} devices cannot form {count} equal nodes")
    return jax.sharding.Mesh(np.asarray(devices).reshape(count, -1), axes)
