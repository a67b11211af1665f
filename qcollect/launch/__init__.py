"""Local multi-process launcher on JAX's distributed runtime (a small ``torchrun``).

Run ``N`` processes of a script, each with ``K`` simulated CPU devices, joined
by ``jax.distributed`` with Gloo CPU collectives::

    python -m qcollect.launch --nproc 2 --devices-per-process 2 train.py --steps 5
    sudo python -m qcollect.launch --nproc 4 --bandwidth 1gbit train.py

The script calls `initialize` first, before any other JAX use::

    import qcollect.launch
    qcollect.launch.initialize()      # no-op when not started by the launcher
    import jax
    mesh = jax.make_mesh((jax.device_count(),), ("data",))   # N * K devices

``--bandwidth RATE`` (and ``--latency DELAY``) run every process in its own
network namespace, linked to a bridge by a veth pair shaped with ``tc``; see
`qcollect.launch._netns`. The launcher prefixes each output line with
``[rank r] ``, and when one process fails it stops the others and exits with
the failing process's status.

Environment of every process: ``QCOLLECT_COORDINATOR_ADDRESS``,
``QCOLLECT_NUM_PROCESSES``, ``QCOLLECT_PROCESS_ID`` and
``QCOLLECT_DEVICES_PER_PROCESS`` (read by `initialize`), and
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``. JAX
0.10 reads only ``JAX_COORDINATOR_ADDRESS`` itself: its cluster auto-detection
(``jax._src.clusters``: SLURM, Open MPI, mpi4py, Kubernetes, Cloud TPU) has no
environment-variable cluster for the process count and id, so a bare
``jax.distributed.initialize()`` fails and scripts call `initialize`.

Scripts run as ``__main__`` exactly as ``python script.py args`` would run
them, except that a failing process (uncaught exception, non-zero
``sys.exit``) ends at once instead of waiting in JAX's exit-time
``jax.distributed`` shutdown barrier for peers that may be blocked in a
collective with it.
"""

from __future__ import annotations

import os

from qcollect.launch import _env

__all__ = ["initialize", "is_launched", "main"]


def is_launched() -> bool:
    """True in a process started by ``python -m qcollect.launch``."""
    return all(v in os.environ for v in (_env.COORDINATOR, _env.NUM_PROCESSES, _env.PROCESS_ID))


def _set_device_count(count: int) -> None:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={count}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def initialize() -> bool:
    """Joins the launched job: devices, Gloo CPU collectives, ``jax.distributed``.

    In a process started by ``python -m qcollect.launch``: sets
    ``--xla_force_host_platform_device_count=K`` in ``XLA_FLAGS`` (replacing a
    count already there), selects Gloo for CPU collectives
    (``jax_cpu_collectives_implementation``) and calls
    ``jax.distributed.initialize(coordinator, N, rank)``. Elsewhere it does
    nothing, so the same script also runs as a single process. Calling it again
    after it joined is a no-op.

    Call it before any other JAX use (before the first ``jax.devices()`` or
    computation): device count and collectives are fixed when JAX creates its
    CPU backend.

    Returns:
      True when it joined (or had joined) a launched job, False otherwise.

    Raises:
      RuntimeError: JAX's backends already exist (``jax.distributed`` refuses).

    Example:
      >>> import qcollect.launch
      >>> qcollect.launch.initialize()   # not launched: nothing happens
      False
    """
    if not is_launched():
        return False
    import jax

    if jax.distributed.is_initialized():
        return True
    count = int(os.environ.get(_env.DEVICES_PER_PROCESS, "1"))
    _set_device_count(count)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=os.environ[_env.COORDINATOR],
                               num_processes=int(os.environ[_env.NUM_PROCESSES]),
                               process_id=int(os.environ[_env.PROCESS_ID]))
    return True


def main(argv=None) -> int:
    """Entry point of ``python -m qcollect.launch``; returns the exit status."""
    from qcollect.launch._args import parse_args
    from qcollect.launch._runner import Launcher

    return Launcher(parse_args(argv)).run()
