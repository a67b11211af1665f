"""`qcollect.launch.initialize` under real cluster launchers: Open MPI's
``mpirun`` and a one-machine SLURM (``slurmctld`` + ``slurmd``), and the
detection rules on their environments.

The engines come from Debian's ``openmpi-bin`` and ``slurm-wlm`` (``.ci/run``
installs them when it runs as root); without them, or without root (SLURM's
daemons), the engine tests skip with the reason.
"""

from __future__ import annotations

import contextlib
import csv
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from qcollect import _cluster
from qcollect.launch import _runner

HERE = pathlib.Path(__file__).resolve().parent
WORKER = str(HERE / "launch_worker.py")
ROOT = HERE.parent


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "PYTEST_XDIST_WORKER") and not k.startswith(
               ("QCOLLECT_", "SLURM_", "OMPI_", "PMIX_", "PMI_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **extra)
    return env


# ---------------------------------------------------------------- detection


@pytest.fixture
def bare_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("QCOLLECT_", "SLURM_", "OMPI_", "PMIX_", "PMI_", "MPI_")) or key in (
                "KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX"):
            monkeypatch.delenv(key)
    return monkeypatch


SRUN_TASK = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[1-2]",
             "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3",
             "SLURM_LOCALID": "1"}


def test_detection_reads_each_launchers_environment(bare_env):
    assert _cluster.detect() is None
    for key, value in SRUN_TASK.items():
        bare_env.setenv(key, value)
    assert _cluster.detect() == _cluster.Job("slurm", 4, 3)
    bare_env.setenv("SLURM_STEP_ID", "batch")  # the batch script itself: one process
    assert _cluster.detect() is None
    bare_env.setenv("OMPI_MCA_orte_hnp_uri", "1851392000.0;tcp://10.0.0.1:40731")
    bare_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    bare_env.setenv("OMPI_COMM_WORLD_RANK", "1")
    assert _cluster.detect() == _cluster.Job("ompi", 2, 1)
    bare_env.setenv("QCOLLECT_COORDINATOR_ADDRESS", "127.0.0.1:1234")
    bare_env.setenv("QCOLLECT_NUM_PROCESSES", "2")
    bare_env.setenv("QCOLLECT_PROCESS_ID", "0")
    assert _cluster.detect().source == "qcollect"  # the launcher's own first
    assert _cluster.detect("none") is None
    bare_env.setenv(_cluster.CLUSTER, "none")
    assert _cluster.detect() is None
    bare_env.setenv("SLURM_STEP_ID", "0")
    assert _cluster.detect("slurm").source == "slurm"  # the argument wins


def test_detection_errors_name_the_fix(bare_env):
    with pytest.raises(ValueError, match="QCOLLECT_CLUSTER"):
        _cluster.detect("lsf")
    with pytest.raises(ValueError, match="no slurm job"):
        _cluster.detect("slurm")
    bare_env.setenv("PMI_RANK", "0")  # MPICH-style rank without Open MPI 4's variables
    if _cluster._needs("mpi4py"):  # mpi4py absent
        with pytest.raises(ValueError, match="pip install mpi4py"):
            _cluster.detect()
    bare_env.delenv("PMI_RANK")
    bare_env.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert _cluster.detect() is None  # a pod, not an indexed job: one process


def test_single_process_says_so_once(bare_env, tmp_path):
    script = tmp_path / "single.py"
    script.write_text("import qcollect.launch\n"
                      "print(qcollect.launch.initialize(), qcollect.launch.initialize())\n"
                      "import jax; print(jax.process_count())\n")
    out = subprocess.run([sys.executable, str(script)], env=_clean_env(), capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False", "1"]
    assert out.stderr.count("single process") == 1, out.stderr
    forced = subprocess.run([sys.executable, str(script)],
                            env=_clean_env(QCOLLECT_CLUSTER="none", **SRUN_TASK),
                            capture_output=True, text=True, timeout=60, check=True)
    assert forced.stdout.split() == ["False", "False", "1"]
    assert "single process" not in forced.stderr  # asked for: nothing to say


# ---------------------------------------------------------------- engines


def _check_run(out_dir: pathlib.Path, text: str) -> None:
    """Both ranks joined one 2-process job and computed what 4 local devices do."""
    from test_launch import _assert_results_match_single_process

    for rank in range(2):
        assert f"process {rank} of 2, 2 of 4 devices" in text, text
    assert text.count("ok") >= 2, text
    _assert_results_match_single_process(out_dir)


MNIST = [sys.executable, str(ROOT / "examples" / "mnist_mlp" / "main.py"), "--steps", "20",
         "--compressors", "none,qsgd-4", "--train-examples", "2048", "--test-examples", "512",
         "--progress", "false"]


def _check_mnist(out_dir: pathlib.Path, text: str) -> None:
    """Rank 0's report: one job of 2 processes (one device each); the exact
    run's bytes are a 2-device ring all-reduce of every parameter."""
    import json

    assert "2 devices in 2 processes" in text, text
    runs = {r["name"]: r for r in json.loads((out_dir / "mnist_mlp.json").read_text())["runs"]}
    params = 784 * 256 + 256 + 2 * (256 * 256 + 256) + 256 * 10 + 10
    assert runs["none"]["wire_bytes"] == 2 * (2 - 1) // 2 * 4 * params  # 2 (N-1)/N x 4 bytes
    assert 0 < runs["qsgd-4"]["wire_bytes"] < runs["none"]["wire_bytes"] / 6


def _mpirun_missing() -> str | None:
    if shutil.which("mpirun") is None:
        return "needs mpirun (Debian: apt-get install openmpi-bin)"
    return None


MPIRUN = ["mpirun", "--oversubscribe", "--bind-to", "none", "-x", "JAX_PLATFORMS",
          "-x", "PYTHONPATH"]
if os.geteuid() == 0:
    MPIRUN.insert(1, "--allow-run-as-root")


@pytest.mark.skipif(_mpirun_missing() is not None, reason=str(_mpirun_missing()))
def test_mpirun_runs_one_job(tmp_path):
    proc = subprocess.run([*MPIRUN, "-x", "QCOLLECT_DEVICES_PER_PROCESS=2", "-np", "2",
                           sys.executable, WORKER, "check", str(tmp_path)],
                          env=_clean_env(), capture_output=True, text=True, timeout=180,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_run(tmp_path, proc.stdout)


def _check_ends_at_once(tmp_path, proc) -> None:
    """The job of ``launch_worker.py raise`` ended within 15 s of the raise,
    failed, showed rank 1's traceback and left no process behind."""
    ended = time.time()
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    assert "RuntimeError: rank 1 fails after five collectives" in text, text
    raised = float(re.search(r"raising at ([0-9.]+)", text).group(1))
    assert ended - raised < 15, f"the job ended {ended - raised:.0f} s after the raise: {text}"
    for pid_file in tmp_path.glob("pid*"):
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pid), f"process {pid} ({pid_file.name}) is still running"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = pathlib.Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


#: A script that runs a qcollect collective without `initialize` (its argument:
#: ``ring`` for `qc.ring_all_reduce`, ``psum`` for `qc.fused_psum`, ``none`` for
#: JAX alone), printing the process count and the sum.
ALONE = """\
import sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import qcollect as qc
mesh = jax.make_mesh((1,), ("d",))
reduce = {"ring": qc.ring_all_reduce, "psum": qc.fused_psum, "none": jax.lax.psum}[sys.argv[1]]
f = jax.shard_map(lambda v: reduce(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P())
x = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("d")))
print(jax.process_count(), f(x).tolist(), flush=True)
"""


def _check_never_joined(proc: subprocess.CompletedProcess, ranks: int) -> None:
    """``ranks`` ranks of a 2-process ``ompi`` job ran alone, exited 0 and
    said so in one line each."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "never joined" in ln]
    assert len(lines) == ranks and "ompi job, process 0 of 2" in proc.stderr, proc.stderr
    assert "call qcollect.launch.initialize()" in lines[0]


@pytest.mark.parametrize("reduce", ["ring", "psum"])
def test_a_rank_that_runs_a_collective_without_joining_says_so(tmp_path, reduce):
    """One rank of an ``mpirun -np 2`` job (its environment, without mpirun):
    the first qcollect collective traced registers the exit-time line; JAX's
    own collective alone, or ``import qcollect``, registers nothing."""
    script = tmp_path / "alone.py"
    script.write_text(ALONE)
    rank = _clean_env(OMPI_MCA_orte_hnp_uri="1851392000.0;tcp://10.0.0.1:40731",
                      OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0")
    proc = subprocess.run([sys.executable, str(script), reduce], env=rank, capture_output=True,
                          text=True, timeout=120, check=False)
    _check_never_joined(proc, 1)
    assert proc.stdout.split()[0] == "1"
    quiet = subprocess.run([sys.executable, str(script), "none"], env=rank, capture_output=True,
                           text=True, timeout=120, check=True)
    assert "never joined" not in quiet.stderr, quiet.stderr


@pytest.mark.skipif(_mpirun_missing() is not None, reason=str(_mpirun_missing()))
def test_a_script_that_never_joins_the_mpirun_job_says_so(tmp_path):
    """A script that runs a qcollect collective without `initialize` under
    mpirun: each rank runs alone, as asked, but says so in one line at exit
    (before: two lone runs, exit 0, not a word)."""
    script = tmp_path / "alone.py"
    script.write_text(ALONE)
    proc = subprocess.run([*MPIRUN, "-np", "2", sys.executable, str(script), "ring"],
                          env=_clean_env(), capture_output=True, text=True, timeout=180,
                          check=False)
    _check_never_joined(proc, 2)


@pytest.mark.skipif(_mpirun_missing() is not None, reason=str(_mpirun_missing()))
def test_a_rank_that_raises_ends_the_mpirun_job_at_once(tmp_path):
    """Rank 1 raises after five collectives while rank 0 waits in the sixth:
    the rank exits with its traceback instead of waiting in JAX's shutdown
    barrier, and mpirun's abort on a failed rank ends the job (before: 309 s,
    blaming rank 0)."""
    proc = subprocess.run([*MPIRUN, "-np", "2", sys.executable, WORKER, "raise", str(tmp_path)],
                          env=_clean_env(), capture_output=True, text=True, timeout=180,
                          check=False)
    _check_ends_at_once(tmp_path, proc)


@pytest.mark.slow
@pytest.mark.skipif(_mpirun_missing() is not None, reason=str(_mpirun_missing()))
def test_mpirun_trains_the_mnist_example_as_one_job(tmp_path):
    proc = subprocess.run([*MPIRUN, "-np", "2", *MNIST, "--output-dir", str(tmp_path)],
                          env=_clean_env(), capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_mnist(tmp_path, proc.stdout)


class Slurm:
    """A one-machine SLURM cluster: ``slurmctld`` and ``slurmd`` as root from a
    generated ``slurm.conf`` under ``root``, on free ports; `close` stops them."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        for sub in ("state", "spool", "log"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        ctl, node = _runner.free_port(), _runner.free_port()
        self.conf = root / "slurm.conf"
        self.conf.write_text("\n".join([
            f"ClusterName=qc{os.getpid()}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctl}", f"SlurmdPort={node}",
            "AuthType=auth/none", "CredType=cred/none",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
            f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "ReturnToService=2", "MpiDefault=none",
            "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
            f"PartitionName=local Nodes={host} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=YES", ""]))
        self.env = {"SLURM_CONF": str(self.conf)}
        self.daemons = []
        for daemon in ("slurmctld", "slurmd"):
            self.daemons.append(subprocess.Popen(
                [daemon, "-D", "-c", *(["-i"] if daemon == "slurmctld" else [])],
                env={**os.environ, **self.env}, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = self.run(["sinfo", "-h", "-o", "%t"], check=False).stdout.strip()
            if state in ("idle", "mix", "alloc"):
                return
            if any(d.poll() is not None for d in self.daemons):
                break
            time.sleep(0.5)
        self.close()
        logs = "".join(p.read_text()[-2000:] for p in (root / "log").glob("*.log"))
        raise RuntimeError(f"SLURM did not come up: {logs}")

    def run(self, argv, check=True, timeout=180, **env):
        return subprocess.run(argv, env=_clean_env(**self.env, **env), capture_output=True,
                              text=True, timeout=timeout, check=check)

    def close(self) -> None:
        for daemon in self.daemons:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, 15)
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, 9)
                daemon.wait()


def _slurm_missing() -> str | None:
    missing = [b for b in ("slurmctld", "slurmd", "srun", "sinfo") if shutil.which(b) is None]
    if missing:
        return f"needs {', '.join(missing)} (Debian: apt-get install slurm-wlm)"
    if os.geteuid() != 0:
        return "SLURM's daemons need root here"
    return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = _slurm_missing()
    if reason:
        pytest.skip(reason)
    try:
        cluster = Slurm(tmp_path_factory.mktemp("slurm"))
    except RuntimeError as e:
        pytest.skip(str(e))
    yield cluster
    cluster.close()


@pytest.mark.slow  # srun's default-suite check is the network benchmark's, below
def test_srun_runs_one_job(slurm, tmp_path):
    proc = slurm.run(["srun", "-n", "2", "--oversubscribe", sys.executable, WORKER, "check",
                      str(tmp_path)], check=False, QCOLLECT_DEVICES_PER_PROCESS="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_run(tmp_path, proc.stdout)


def test_srun_runs_the_network_benchmark_as_one_job(slurm, tmp_path):
    """Under ``srun`` the benchmark joins the step's job instead of starting
    its own launcher."""
    out = tmp_path / "net"
    proc = slurm.run(["srun", "-n", "2", "--oversubscribe", sys.executable, "-m",
                      "qcollect.bench", "network", "--nproc", "2", "--bandwidth", "none",
                      "--sizes", "0.0625", "--repeats", "1", "--methods", "psum,qsgd-4",
                      "--out", str(out)], check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[rank " not in proc.stdout  # the local launcher's prefix: not started
    with open(out.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    assert [(r["method"], r["processes"]) for r in rows] == [("psum", "2"), ("qsgd-4", "2")]


@pytest.mark.slow
def test_srun_trains_the_mnist_example_as_one_job(slurm, tmp_path):
    proc = slurm.run(["srun", "-n", "2", "--oversubscribe", *MNIST, "--output-dir",
                      str(tmp_path)], check=False, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_mnist(tmp_path, proc.stdout)


def test_a_rank_that_raises_ends_the_srun_step_at_once(slurm, tmp_path):
    """As under mpirun: ``srun --kill-on-bad-exit=1`` ends the step once the
    raising task exits (before: still running after 100 s)."""
    proc = slurm.run(["srun", "-n", "2", "--oversubscribe", "--kill-on-bad-exit=1",
                      sys.executable, WORKER, "raise", str(tmp_path)], check=False)
    _check_ends_at_once(tmp_path, proc)

