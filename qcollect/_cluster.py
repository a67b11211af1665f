"""Which job this process belongs to, read from its environment.

`detect` names the source of a multi-process job (first match wins):

- ``"qcollect"``: started by ``python -m qcollect.launch`` (its
  ``QCOLLECT_*`` variables); also what a user sets by hand, e.g. in a
  Kubernetes indexed job (docs/multiprocess.md).
- ``"slurm"``: a task of an ``srun`` step (``SLURM_STEP_ID``, ``SLURM_PROCID``,
  ``SLURM_NTASKS``, ...). A batch script itself (step ``batch``, or no step)
  is not a task of the job: ``python train.py`` run there directly stays one
  process instead of waiting for ``SLURM_NTASKS - 1`` peers that never come.
- ``"ompi"``: a rank of Open MPI's ``mpirun`` up to 4.x
  (``OMPI_MCA_orte_hnp_uri``).
- ``"mpi4py"``: a rank of another MPI launcher (Open MPI 5, MPICH, Intel MPI:
  ``PMIX_RANK`` / ``PMI_RANK``), joined through mpi4py when it is installed.
- ``"k8s"``: a pod of a Kubernetes indexed job (``JOB_COMPLETION_INDEX``)
  with the ``kubernetes`` package installed (JAX asks the API server for
  its peers).

Otherwise ``None``: one process. ``QCOLLECT_CLUSTER`` (or the argument of
`qcollect.launch.initialize`) chooses instead: ``"none"`` forces a single
process whatever the environment says; a name above insists on that source
and fails when its environment is absent.

JAX finds the coordinator, the process count and the id itself for the
clusters (``jax.distributed.initialize(cluster_detection_method=...)``,
``jax._src.clusters``); `detect` only decides whether and which, so that a
job never silently runs as independent processes and a lone process never
waits for peers.

`watch_unjoined` registers, once, the exit-time line of a process that ran
qcollect's collectives inside such a job without joining it. The
collectives call it the first time one is traced (``_ring.py``'s word
exchange, ``_messages.py``'s `fused_psum`), not ``import qcollect``, which
has no side effects. This module reads the environment only: it imports the
standard library, and JAX only once a process has imported it.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import sys
import threading
from typing import Literal, NamedTuple, get_args

#: The environment variable that overrides detection (`detect`'s ``choice``).
CLUSTER = "QCOLLECT_CLUSTER"
#: The variables ``python -m qcollect.launch`` gives each process
#: (`qcollect.launch`; the rest of them are ``launch/_env.py``'s).
COORDINATOR = "QCOLLECT_COORDINATOR_ADDRESS"
NUM_PROCESSES = "QCOLLECT_NUM_PROCESSES"
PROCESS_ID = "QCOLLECT_PROCESS_ID"
#: Who started a multi-process job (`Job.source`).
Source = Literal["qcollect", "slurm", "ompi", "mpi4py", "k8s"]
#: Every `Source`, in the order `detect` tries them.
SOURCES: tuple[Source, ...] = get_args(Source)
_SINGLE = ("none", "single")
_MPI_RANKS = ("PMIX_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID")


class Job(NamedTuple):
    """A detected multi-process job.

    Attributes:
      source: one of `SOURCES`.
      num_processes / process_id: as the environment states them (None
        where only JAX's detection or mpi4py can tell).
    """

    source: Source
    num_processes: int | None
    process_id: int | None

    def describe(self) -> str:
        """``"slurm job, process 1 of 4"``."""
        where = (f"process {self.process_id} of {self.num_processes}"
                 if self.num_processes is not None else "processes counted by MPI")
        return f"{self.source} job, {where}"


def is_launched() -> bool:
    """True in a process started by ``python -m qcollect.launch``."""
    return all(v in os.environ for v in (COORDINATOR, NUM_PROCESSES, PROCESS_ID))


def _int(name: str) -> int | None:
    """The environment variable ``name`` as a non-negative int, or None."""
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else None


def _present(source: Source) -> Job | None:
    """``source``'s job when its environment is there, else None."""
    env = os.environ
    if source == "qcollect":
        if is_launched():
            return Job(source, _int(NUM_PROCESSES), _int(PROCESS_ID))
    elif source == "slurm":
        step = env.get("SLURM_STEP_ID", "")
        keys = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                "SLURM_LOCALID")
        if step.isdigit() and all(k in env for k in keys):
            return Job(source, _int("SLURM_STEP_NUM_TASKS") or _int("SLURM_NTASKS"),
                       _int("SLURM_PROCID"))
    elif source == "ompi":
        if "OMPI_MCA_orte_hnp_uri" in env:
            return Job(source, _int("OMPI_COMM_WORLD_SIZE"), _int("OMPI_COMM_WORLD_RANK"))
    elif source == "mpi4py":
        if any(k in env for k in _MPI_RANKS):
            return Job(source, None, None)
    elif source == "k8s":
        if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
            return Job(source, None, _int("JOB_COMPLETION_INDEX"))
    return None


def _needs(source: Source) -> str | None:
    """What is missing to join a ``source`` job here (None: nothing)."""
    package = {"mpi4py": "mpi4py", "k8s": "kubernetes"}.get(source)
    if package and importlib.util.find_spec(package) is None:
        return f"pip install {package}"
    return None


def detect(choice: str | None = None) -> Job | None:
    """The job this process is part of, or None for a single process.

    Args:
      choice: ``"auto"`` (detect), ``"none"`` (a single process), or one
        of `SOURCES`; default: ``$QCOLLECT_CLUSTER``, else ``"auto"``.

    Raises:
      ValueError: an unknown ``choice``; a chosen source whose environment
        is absent; a detected MPI or Kubernetes job whose Python package is
        missing (the message says which to install).
    """
    choice = (choice if choice is not None else os.environ.get(CLUSTER, "auto")).strip().lower()
    if choice in _SINGLE:
        return None
    if choice != "auto" and choice not in SOURCES:
        raise ValueError(f"cluster ({CLUSTER}) must be auto, none or one of "
                         f"{', '.join(SOURCES)}, got {choice!r}")
    for source in SOURCES if choice == "auto" else [s for s in SOURCES if s == choice]:
        job = _present(source)
        if job is None:
            continue
        missing = _needs(source)
        if missing is not None:
            raise ValueError(f"this process is part of a {source} job but cannot join it: "
                             f"{missing}, or set {CLUSTER}=none to run it as a single process")
        return job
    if choice != "auto":
        raise ValueError(f"cluster ({CLUSTER}) is {choice!r} but this process's environment "
                         f"has no {choice} job")
    return None


_watching = threading.Event()


def watch_unjoined() -> None:
    """Registers, once per process, the exit handler `warn_unjoined`.

    qcollect's collectives call it the first time one is traced, so that a
    script that runs them inside a cluster job of several processes
    (``srun``, ``mpirun``, ...) without joining it, and so runs as N
    independent single-process jobs, says so in one line at exit instead of
    exiting 0 without a word. A process that never runs a qcollect
    collective registers nothing (``import qcollect`` has no side effects);
    `qcollect.launch.warn_unjoined_at_exit` registers it by hand.
    """
    if not _watching.is_set():
        _watching.set()
        atexit.register(warn_unjoined)


def warn_unjoined() -> None:
    """One line on stderr when this process used JAX inside a cluster job of
    several processes without joining it (``jax.distributed`` never
    initialized); nothing in a process of ``python -m qcollect.launch``,
    whose launcher detects the same mistake itself (its workers' reports).
    """
    jax = sys.modules.get("jax")
    if jax is None or is_launched():
        return
    try:
        found = detect()
    except ValueError:
        return
    if found is None or found.num_processes == 1 or jax.distributed.is_initialized():
        return
    print(f"qcollect.launch: this process is part of a {found.describe()} but never joined "
          "it, so it ran alone: call qcollect.launch.initialize() before any other JAX use",
          file=sys.stderr, flush=True)
