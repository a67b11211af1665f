"""Devices for the examples: simulated CPU devices (set before JAX initialises)
and reading per-device results in one process of several."""

import os

import numpy as np


def simulate_cpu_devices(default: int = 8):
    """Asks XLA for ``QCOLLECT_DEVICES`` (default 8) host CPU devices.

    Only when no accelerator platform is requested and the flag is not set
    already; real GPUs or TPUs are used as they are. Must run before JAX
    creates its backends (before the first ``jax.devices()``).

    In a process started by ``python -m qcollect.launch`` it calls
    `qcollect.launch.initialize` instead, which sets the launcher's device
    count per process and joins the job (``jax.distributed``).
    """
    import qcollect.launch

    if qcollect.launch.is_launched():
        qcollect.launch.initialize()
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
