"""Local multi-process launcher on JAX's distributed runtime (a small ``torchrun``).

Run ``N`` processes of a script, each with ``K`` simulated CPU devices, joined
by ``jax.distributed`` with Gloo CPU collectives::

    python -m qcollect.launch --nproc 2 --devices-per-process 2 train.py --steps 5
    sudo python -m qcollect.launch --nproc 4 --bandwidth 1gbit train.py

The script calls `initialize` first, before any other JAX use::

    import qcollect.launch
    qcollect.launch.initialize()      # joins the job; alone: a single process
    import jax
    mesh = jax.make_mesh((jax.device_count(),), ("data",))   # N * K devices

``--bandwidth RATE`` (and ``--latency DELAY``) run every process in its own
network namespace, linked to a bridge by a veth pair shaped with ``tc``. The
launcher prefixes each output line with ``[rank r] ``, and when one process
fails it stops the others and exits with the status of the process that
failed first. ``--stall-timeout SECONDS`` (default 600) ends a job whose
processes wait that long in a collective for one that does not arrive, with
status 124 and a line naming it. Workers die with the launcher, even after
``kill -9`` of it, and a ``--bandwidth`` launch first removes the namespaces
that launchers killed that way left behind. How each of these works, and
what it was measured to do: docs/multiprocess.md, "The launcher", and
docs/reliability.md.

Environment of every process: ``QCOLLECT_COORDINATOR_ADDRESS``,
``QCOLLECT_NUM_PROCESSES``, ``QCOLLECT_PROCESS_ID``,
``QCOLLECT_DEVICES_PER_PROCESS`` and ``QCOLLECT_STALL_TIMEOUT`` (read by
`initialize`), and
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

import math
import os
import signal
import sys
import threading
from typing import Any

from qcollect import _cluster
from qcollect.launch import _env
from qcollect.launch._args import parse_delay, parse_rate

__all__ = ["Job", "initialize", "is_launched", "job", "main", "parse_delay", "parse_rate",
           "warn_unjoined_at_exit"]

Job = _cluster.Job

# How long a CPU collective waits for its peers before it fails (XLA's default
# is 30 minutes); Gloo raises "Timed out waiting ... for recv operation".
_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"


def job(cluster: str | None = None) -> _cluster.Job | None:
    """The multi-process job this process is part of, without joining it.

    A `Job` (``source``: ``"qcollect"``, ``"slurm"``, ``"ompi"``,
    ``"mpi4py"`` or ``"k8s"``; the process count and id where the
    environment states them), or None for a single process; ``cluster`` as
    for `initialize`.

    Example:
      >>> import qcollect.launch
      >>> qcollect.launch.job("none") is None
      True
    """
    return _cluster.detect(cluster)


def is_launched() -> bool:
    """True in a process started by ``python -m qcollect.launch``."""
    return _cluster.is_launched()


def _set_xla_flags(count: int | None, collective_timeout: float) -> None:
    """Device count ``count`` (replacing one already set; None: as set) and, when
    ``collective_timeout`` > 0 and none is set, XLA's CPU collective timeout."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if count is not None:
        flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
        flags.append(f"--xla_force_host_platform_device_count={count}")
    if collective_timeout > 0 and not any(f.startswith(_COLLECTIVE_TIMEOUT_FLAG) for f in flags):
        flags.append(f"{_COLLECTIVE_TIMEOUT_FLAG}={max(1, math.ceil(collective_timeout))}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def initialize(cluster: str | None = None) -> bool:
    """Joins the job this process is part of: devices, Gloo CPU collectives, ``jax.distributed``.

    Which job (the one `job` returns): one started by ``python -m
    qcollect.launch``; else a cluster launcher's, found by JAX's cluster
    detection: a task of SLURM's ``srun``, a rank of Open MPI's ``mpirun``, a
    rank of another MPI launcher through mpi4py, a pod of a Kubernetes
    indexed job. With none, the process runs alone and says so once on
    stderr; ``cluster="none"`` (or ``QCOLLECT_CLUSTER=none``) asks for that
    without the message, whatever the environment holds.

    Joining sets ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``
    to ``QCOLLECT_DEVICES_PER_PROCESS`` (the launcher's
    ``--devices-per-process``; under a cluster launcher only when set, else
    the flags stay as they are) and, unless ``XLA_FLAGS`` sets one, the CPU
    collective timeout ``--xla_cpu_collective_timeout_seconds`` to
    ``QCOLLECT_STALL_TIMEOUT`` (the launcher's ``--stall-timeout``: a
    collective whose peer does not arrive in time then raises instead of
    waiting); selects Gloo for CPU collectives
    (``jax_cpu_collectives_implementation``); calls
    ``jax.distributed.initialize``; and restores the SIGTERM handler it
    found (the default action, normally), which ``jax.distributed`` replaces
    by one that only records the signal; under a cluster launcher an uncaught
    exception ends the process at once (`_fail_at_once`). A second call is a no-op.

    Call it before any other JAX use (before the first ``jax.devices()`` or
    computation): device count and collectives are fixed when JAX creates its
    CPU backend.

    Args:
      cluster: ``"auto"`` (detect), ``"none"`` (a single process) or the
        source to insist on (``"qcollect"``, ``"slurm"``, ``"ompi"``,
        ``"mpi4py"``, ``"k8s"``); default ``$QCOLLECT_CLUSTER``, else auto.

    Returns:
      True when it joined (or had joined) a multi-process job, False for a
      single process.

    Raises:
      ValueError: an unknown ``cluster``; a chosen one that is absent; an
        MPI or Kubernetes job whose Python package (mpi4py, kubernetes) is
        missing.
      RuntimeError: JAX's backends already exist (``jax.distributed`` refuses).

    Example:
      >>> import qcollect.launch
      >>> qcollect.launch.initialize("none")   # a single process, as asked
      False
    """
    job = _cluster.detect(cluster)
    if job is None:
        _say_single_once(cluster)
        return False
    import jax

    if jax.distributed.is_initialized():
        return True
    devices = os.environ.get(_env.DEVICES_PER_PROCESS)
    _set_xla_flags(int(devices) if devices else None,
                   float(os.environ.get(_env.STALL_TIMEOUT, "0")))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main_thread else None
    if job.source == "qcollect":
        # Rank 0's coordination service answers unauthenticated requests: bind
        # it to the job's address only (JAX's default is every interface).
        coordinator = os.environ[_env.COORDINATOR]
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=int(os.environ[_env.NUM_PROCESSES]),
                                   process_id=int(os.environ[_env.PROCESS_ID]),
                                   coordinator_bind_address=coordinator)
    else:
        jax.distributed.initialize(cluster_detection_method=job.source)
    # jax.distributed's preemption notifier catches SIGTERM and keeps running;
    # under the launcher SIGTERM means "stop now" (or what the script set up).
    if main_thread:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)
    if job.source != "qcollect":   # the launcher's workers do this themselves (_worker.py)
        _fail_at_once()
    return True


def _fail_at_once() -> None:
    """An uncaught exception ends this process at once with status 1, after
    its traceback.

    Without this, a rank of ``mpirun`` or ``srun`` that raised would wait in
    ``jax.distributed``'s exit-time shutdown barrier (about five minutes)
    for peers that may be blocked in a collective with it, so neither
    ``mpirun``'s abort on a failed rank nor ``srun --kill-on-bad-exit`` could
    act on it. A non-zero ``sys.exit`` is not an exception and still runs
    interpreter shutdown.
    """
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)

    sys.excepthook = hook


_said = threading.Event()


def _say_single_once(cluster: str | None) -> None:
    """One line on stderr, the first time only, unless a single process was asked for."""
    asked = (cluster if cluster is not None else os.environ.get(_cluster.CLUSTER, "auto"))
    if _said.is_set() or asked.strip().lower() != "auto":
        return
    _said.set()
    print("qcollect.launch: no launcher or cluster job found (qcollect, SLURM srun, Open MPI, "
          "MPI, Kubernetes indexed job): running as a single process "
          f"({_cluster.CLUSTER}=none says so without this line)", file=sys.stderr, flush=True)


def warn_unjoined_at_exit() -> None:
    """Registers, once, an exit handler that prints one line on stderr when
    this process used JAX inside a cluster job of several processes (``srun``,
    ``mpirun``, ...) without joining it: a script that forgot `initialize`
    runs as N independent single-process jobs and would otherwise exit 0
    without a word.

    qcollect's collectives register it themselves the first time one is
    traced (`qcollect._cluster.watch_unjoined`; ``import qcollect`` registers
    nothing); a script that uses only JAX's own collectives can call this.
    The local launcher detects the same mistake itself (its workers' reports).

    Example:
      >>> import qcollect.launch
      >>> qcollect.launch.warn_unjoined_at_exit()   # once; later calls do nothing
    """
    _cluster.watch_unjoined()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m qcollect.launch``; returns the exit status."""
    from qcollect.launch._args import parse_args
    from qcollect.launch._runner import Launcher

    return Launcher(parse_args(argv)).run()
