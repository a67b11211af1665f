"""Test setup: 8 host CPU devices before JAX initialises, hypothesis profile."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One OpenBLAS thread: LAPACK calls from 8 simulated devices otherwise fight
# over the cores (examples/common/devices.py).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# The suite is bound by compiling thousands of small programs. It compiles
# them with XLA:CPU's backend (LLVM) at optimisation level 0, which takes
# about a quarter less time over the whole suite. What the tests read is the
# same at every level: the HLO (its collectives, their bytes, the phase marks)
# comes from XLA's own passes before the backend; the numerics differ in
# float32 rounding only, which each comparison of two programs allows for.
# Set XLA_FLAGS=--xla_backend_optimization_level=2 to run it as users compile.
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

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


#: Test modules that run whole programs: the examples and the training gate,
#: notebooks, the docs' code blocks, launched processes and cluster engines,
#: benchmarks, the type checker. They carry the ``integration`` marker, so
#: ``python -m pytest -q -n auto -m "not slow and not integration"`` runs the
#: unit tests alone (the fast tier of docs/README.md#tests).
INTEGRATION = frozenset({
    "test_bench_compile", "test_bench_network", "test_checkpoint", "test_clusters",
    "test_compile_transforms", "test_docs", "test_examples", "test_launch",
    "test_launch_faults", "test_lm_example", "test_model_axes", "test_notebooks",
    "test_same_results", "test_suite_setup", "test_training_gate", "test_types",
})


#: A unit test recorded above this many seconds (``tests/durations.json``)
#: is ``heavy``: ``-m "not slow and not integration and not heavy"`` is the
#: fast tier, the rest of the unit tests in a few minutes on 2 cores.
HEAVY_SECONDS = 1.5


def pytest_collection_modifyitems(config, items):
    """Marks every test of an `INTEGRATION` module ``integration`` and every
    other test recorded above `HEAVY_SECONDS` ``heavy``."""
    import pytest

    from tests.durations import load

    recorded = load()
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in INTEGRATION:
            item.add_marker(pytest.mark.integration)
        elif recorded.get(item.nodeid, 0.0) > HEAVY_SECONDS:
            item.add_marker(pytest.mark.heavy)
