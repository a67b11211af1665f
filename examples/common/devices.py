"""Simulated CPU devices for the examples (before JAX initialises)."""

import os


def simulate_cpu_devices(default: int = 8):
    """Asks XLA for ``QCOLLECT_DEVICES`` (default 8) host CPU devices.

    Only when no accelerator platform is requested and the flag is not set
    already; real GPUs or TPUs are used as they are. Must run before JAX
    creates its backends (before the first ``jax.devices()``).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    count = int(os.environ.get("QCOLLECT_DEVICES", default))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
