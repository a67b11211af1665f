"""Environment variables that carry a worker's place in the launched job."""

from __future__ import annotations

# The three that mark a launched process are the core's, which detects the job
# (`qcollect._cluster.is_launched`).
from qcollect._cluster import COORDINATOR, NUM_PROCESSES, PROCESS_ID

__all__ = ["COORDINATOR", "DEVICES_PER_PROCESS", "JAX_COORDINATOR", "JAX_NUM_PROCESSES",
           "JAX_PROCESS_ID", "LAUNCHER_PID", "NUM_PROCESSES", "PROCESS_ID", "STALL_TIMEOUT",
           "STATUS_FD", "worker_environment"]

DEVICES_PER_PROCESS = "QCOLLECT_DEVICES_PER_PROCESS"
# Seconds a collective may wait for a peer (0: no limit set by the launcher);
# `qcollect.launch.initialize` turns it into XLA's CPU collective timeout.
STALL_TIMEOUT = "QCOLLECT_STALL_TIMEOUT"
# Read by the worker wrapper (``_worker.py``) only: the launcher's
# process id (the worker's expected parent) and the pipe that carries its reports.
LAUNCHER_PID = "QCOLLECT_LAUNCHER_PID"
STATUS_FD = "QCOLLECT_STATUS_FD"

# JAX 0.10 reads only the coordinator from the environment
# (``jax.distributed.initialize`` falls back to JAX_COORDINATOR_ADDRESS); it has
# no environment-variable cluster for the process count and id, so a script
# must call `qcollect.launch.initialize`. The other two are set for scripts
# that read them by these conventional names.
JAX_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
JAX_NUM_PROCESSES = "JAX_NUM_PROCESSES"
JAX_PROCESS_ID = "JAX_PROCESS_ID"


def worker_environment(coordinator: str, num_processes: int, rank: int,
                       devices_per_process: int, *, stall_timeout: float = 0.0
                       ) -> dict[str, str]:
    """The variables the launcher adds to worker ``rank``'s environment."""
    return {
        COORDINATOR: coordinator,
        NUM_PROCESSES: str(num_processes),
        PROCESS_ID: str(rank),
        DEVICES_PER_PROCESS: str(devices_per_process),
        STALL_TIMEOUT: repr(float(stall_timeout)),
        JAX_COORDINATOR: coordinator,
        JAX_NUM_PROCESSES: str(num_processes),
        JAX_PROCESS_ID: str(rank),
    }
