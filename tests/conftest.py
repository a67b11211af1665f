"""Test setup: 8 host CPU devices before JAX initialises, hypothesis profile."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One OpenBLAS thread: LAPACK calls from 8 simulated devices otherwise fight
# over the cores (examples/common/devices.py).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

settings.register_profile(
    "default",
    deadline=None,
    max_examples=12,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", deadline=None, max_examples=300,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
