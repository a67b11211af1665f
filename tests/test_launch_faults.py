"""``python -m qcollect.launch`` when a process fails, ends early, comes late,
never joins, or cannot serve the coordinator: which process the launcher names."""

import pathlib
import socket
import time

import pytest
import test_launch
from test_launch import _launch

from qcollect.launch import _args, _runner, _stall, _worker

# Modes (first argument), each after three psums over every process's devices:
#   late S: process 1 sleeps S seconds before its first collective.
#   raise / kill: process 1 raises / kills itself with SIGKILL while process 0
#     waits in a collective with it.
#   early [LENGTH]: process 1 returns while process 0 keeps calling the
#     collective, of LENGTH floats per device (default 4: XLA runs it inline,
#     with no JAX frame on the stack; 65536 are waited for in JAX).
SCRIPT = """\
import functools, os, signal, sys, time
import qcollect.launch
qcollect.launch.initialize()
import jax
import numpy as np

mode = sys.argv[1]
length = int(sys.argv[2]) if mode == "early" and len(sys.argv) > 2 else 4
rank = jax.process_index()
n = jax.device_count()
mesh = jax.make_mesh((n,), ("d",))
x = jax.make_array_from_callback((n, length), jax.NamedSharding(mesh, jax.P("d")),
                                 lambda i: np.ones((n, length), np.float32)[i])
psum = jax.jit(jax.shard_map(functools.partial(jax.lax.psum, axis_name="d"), mesh=mesh,
                             in_specs=jax.P("d"), out_specs=jax.P()))
if mode == "late" and rank == 1:
    print("late", flush=True)
    time.sleep(float(sys.argv[2]))
for _ in range(3):
    jax.block_until_ready(psum(x))
if rank == 1:
    time.sleep(0.5)   # process 0 is in the next collective by now
    if mode == "raise":
        raise ValueError("process 1 failed")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "early":
        print("finished", flush=True)
        sys.exit(0)
while mode != "late":
    jax.block_until_ready(psum(x))
"""


def _script(tmp_path: pathlib.Path, text: str = SCRIPT) -> str:
    path = tmp_path / "script.py"
    path.write_text(text)
    return str(path)


# A rank late to its first collective -------------------------------------------------

GLOO_TIMEOUT = ("UNKNOWN: Gloo context initialization failed: DEADLINE_EXCEEDED: GetKeyValue() "
                "timed out with key: cpu:gloo/0,2048,4096/2 and duration: 29.999999949s "
                "[type.googleapis.com/tensorflow.CoordinationServiceError='']")


def test_worker_reads_the_late_process_from_gloos_set_up_timeout():
    try:
        try:
            raise ValueError(GLOO_TIMEOUT)
        except ValueError as e:
            raise RuntimeError("step failed") from e
    except RuntimeError as e:
        assert _worker.setup_timeout(e, {0: 0, 2048: 1, 4096: 2}) == [2]
        assert _worker.setup_timeout(e, {}) == [2]   # the id's block of 2048
        assert not _worker.is_peer_loss(e)
    assert _worker.setup_timeout(ValueError("Gloo all-reduce failed: Timed out")) is None


def test_set_up_timeout_message_names_the_late_rank():
    now = 100.0
    reports = {0: _stall.Report("timeout", 0, None, now, late=(1,)),
               1: _stall.Report("user", 31, None, now),
               2: _stall.Report("timeout", 0, None, now)}
    msg = _stall.setup_stall(reports, [0, 1, 2], now)
    assert msg.startswith("rank 1 (outside JAX for 31.0 s) came more than 30 s after rank 0 "
                          "to their first collective"), msg
    assert "--stall-timeout does not change" in msg
    assert _stall.setup_stall({0: reports[2], 1: reports[1]}, [0, 1], now) is None


@pytest.mark.slow
def test_a_rank_late_to_its_first_collective_is_named(tmp_path):
    """Gloo gives up after 30 s whatever --stall-timeout says; the launcher
    names the late rank and the deadline, not the rank that waited."""
    status, out, err, seconds = _launch("--nproc", "2", "--stall-timeout", "100",
                                        _script(tmp_path), "late", "35", timeout=90)
    print(f"rank 1 late by 35 s: status {status} after {seconds:.1f} s")
    assert status == 124, out + err
    assert "[launch] rank 1 (outside JAX for" in err, err
    assert "came more than 30 s after rank 0 to their first collective" in err, err
    assert "--stall-timeout does not change" in err
    assert seconds < 50, seconds


# The first rank to fail ---------------------------------------------------------------

@pytest.mark.parametrize("mode,status", [("raise", 1), ("kill", 137)])
def test_the_first_rank_to_fail_is_named_with_its_status(tmp_path, mode, status):
    """Process 0 dies of process 1's failure, often in the same instant."""
    got, out, err, seconds = _launch("--nproc", "2", "--stall-timeout", "60",
                                     _script(tmp_path), mode, timeout=60)
    print(f"rank 1 {mode}: status {got} after {seconds:.1f} s")
    assert got == status, out + err
    assert f"[launch] rank 1 exited with status {status}" in err, err
    assert seconds < 30, seconds


def _failing_launcher(tmp_path, reports, deaths):
    args = _args.parse_args(["--nproc", str(len(reports)), _script(tmp_path)])
    launcher = _runner.Launcher(args)
    launcher.procs = [None] * len(reports)
    return launcher, launcher._failures(reports, deaths)


def test_failures_are_ordered_by_when_they_happened(tmp_path, capsys):
    at = 50.0
    # Process 1 was killed (no report) at 10.002; process 0, which lost it,
    # reported its own error a little earlier by the launcher's clock.
    reports = {0: _stall.Report("failed", 0, None, at, t=10.001, status=1, peer_lost=True),
               1: _stall.Report("jax", 3, None, at)}
    launcher, failures = _failing_launcher(tmp_path, reports, {0: (10.01, 1), 1: (10.002, -9)})
    assert launcher._failed(failures, reports, at) == 137
    assert "[launch] rank 1 exited with status 137 (rank 0 failed after it)" in \
        capsys.readouterr().err
    # Two failures of their own: the earlier one, by the workers' clocks.
    reports = {0: _stall.Report("failed", 0, None, at, t=10.2, status=1),
               1: _stall.Report("failed", 0, None, at, t=10.1, status=3),
               2: _stall.Report("user", 1, None, at)}
    launcher, failures = _failing_launcher(tmp_path, reports, {0: (10.3, 1)})
    assert launcher._failed(failures, reports, at) == 3
    assert "[launch] rank 1 exited with status 3 (rank 0 failed after it)" in \
        capsys.readouterr().err


# A rank that finished early -----------------------------------------------------------

@pytest.mark.parametrize("length,xla_flags,said", [
    # XLA's collective timeout (the stall timeout) fails rank 0's inline psum.
    (4, None, "[launch] stalled for 5 s (--stall-timeout): rank 1 stopped arriving "
              "(finished its script"),
    # With XLA's timeout far away, rank 0 is seen waiting in JAX for rank 1.
    (65536, "--xla_cpu_collective_timeout_seconds=1000",
     "[launch] rank 1 finished "),
])
def test_a_rank_that_finished_early_is_named(tmp_path, monkeypatch, length, xla_flags, said):
    if xla_flags:
        monkeypatch.setattr(test_launch, "_clean_env",
                            lambda clean=test_launch._clean_env: {**clean(),
                                                                  "XLA_FLAGS": xla_flags})
    status, out, err, seconds = _launch("--nproc", "2", "--stall-timeout", "5",
                                        _script(tmp_path), "early", str(length), timeout=60)
    print(f"rank 1 finished early ({length} floats): status {status} after {seconds:.1f} s")
    assert "[rank 1] finished" in out, out + err
    assert status == 124, out + err
    assert said in err, err
    if xla_flags:
        assert "s in JAX for it: a process that finished early" in err, err
    assert seconds < 30, seconds


def test_early_finish_verdicts(tmp_path, capsys):
    now = 100.0
    done = _stall.Report("done", 0, None, 90.0)
    waiting = _stall.Report("jax", 6, 5.5, now)
    assert _stall.finished_early({0: waiting, 1: done}, [0, 1], 5, now) == (
        "rank 1 finished 10.0 s before, while rank 0 waited 5.5 s in JAX for it: a process "
        "that finished early (fewer steps or collectives than the others)")
    assert _stall.finished_early({0: _stall.Report("jax", 4, 4.0, now), 1: done},
                                 [0, 1], 5, now) is None
    assert _stall.finished_early({0: _stall.Report("user", 9, None, now), 1: done},
                                 [0, 1], 5, now) is None
    # Before JAX's exit-time barrier aborts the finished process (300 s), even
    # when the stall timeout is longer.
    assert _stall.finished_early({0: _stall.Report("jax", 271, 271.0, now), 1: done},
                                 [0, 1], 600, now).startswith("rank 1 finished 10.0 s before")
    assert _stall.finished_early({0: _stall.Report("jax", 269, 269.0, now), 1: done},
                                 [0, 1], 600, now) is None
    # JAX's exit-time barrier gave up: both abort, the one still running first.
    reports = {0: _stall.Report("jax", 300, 300.0, now), 1: done}
    launcher, failures = _failing_launcher(tmp_path, reports, {0: (99.0, -6), 1: (99.1, -6)})
    assert launcher._failed(failures, reports, now) == 134
    assert ("[launch] rank 0 exited with status 134 while rank 1, which finished 10.0 s "
            "before, waited for it in JAX's exit-time shutdown barrier (it gives up after 300 s)"
            ) in capsys.readouterr().err


# A script that never joins ------------------------------------------------------------

def test_a_script_that_never_joins_fails_naming_it(tmp_path):
    script = _script(tmp_path, "import jax\nprint(jax.process_count(), jax.device_count())\n")
    status, out, err, seconds = _launch("--nproc", "2", "--devices-per-process", "2", script)
    print(f"never joined: status {status} after {seconds:.1f} s")
    assert status == 1, out + err
    assert "started JAX without joining the job: the script must call " \
           "qcollect.launch.initialize()" in err, err


def test_a_script_without_jax_is_left_alone(tmp_path):
    status, out, err, _ = _launch("--nproc", "2", _script(tmp_path, "print('hello')\n"))
    assert status == 0, out + err
    assert "[rank 0] hello" in out and "[rank 1] hello" in out
    assert "[launch]" not in err, err


FINISHING = """
import atexit, pathlib, sys, threading, time
import qcollect.launch
qcollect.launch.initialize()
import jax
out, rank = pathlib.Path(sys.argv[1]), jax.process_index()
def later():
    time.sleep(1.0)
    (out / f"thread{rank}").write_text("joined")
def at_exit():   # runs before JAX's own handler (registered earlier)
    (out / f"atexit{rank}").write_text((out / f"thread{rank}").read_text())
atexit.register(at_exit)
threading.Thread(target=later).start()
print(jax.device_count(), "devices")
"""


def test_a_finished_script_ends_as_interpreter_shutdown_begins(tmp_path):
    """A returned script's non-daemon threads are joined and its ``atexit``
    handlers run (JAX's shutdown barrier among them), then the process exits 0."""
    status, out, err, _ = _launch("--nproc", "2", _script(tmp_path, FINISHING), str(tmp_path))
    assert status == 0, out + err
    assert "[rank 0] 2 devices" in out and "[rank 1] 2 devices" in out
    for rank in range(2):
        assert (tmp_path / f"atexit{rank}").read_text() == "joined"


# --devices-per-process ----------------------------------------------------------------

def test_devices_per_process_has_an_upper_bound(capsys):
    top = _args.MAX_DEVICES_PER_PROCESS
    assert top == 2048
    assert _args.parse_args(["--nproc", "2", "--devices-per-process", str(top),
                             "s.py"]).devices_per_process == top
    for count in (top + 1, 100000):
        with pytest.raises(SystemExit) as e:
            _args.parse_args(["--nproc", "2", "--devices-per-process", str(count), "s.py"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"--devices-per-process must be at most {top}" in err and str(count) in err


# The coordinator's port ---------------------------------------------------------------

def test_a_taken_coordinator_port_is_retried(tmp_path, monkeypatch, capsys):
    """Another program listens on the chosen port: the job starts again on another."""
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    other = socket.socket()   # the other program, with SO_REUSEADDR as servers have
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    other.bind(("127.0.0.1", port))
    other.listen()
    first = {"free_port", "reserve_port"}   # the calls that get the taken port
    reserve, free = getattr(_runner, "reserve_port", None), _runner.free_port

    def taken_first(name, value, otherwise):
        def pick(*a):
            if name in first:
                first.discard(name)
                return value
            return otherwise(*a)
        return pick

    monkeypatch.setattr(_runner, "free_port", taken_first("free_port", port, free))
    monkeypatch.setattr(_runner, "reserve_port", taken_first("reserve_port", held, reserve),
                        raising=False)
    script = _script(tmp_path, "import qcollect.launch\nqcollect.launch.initialize()\n"
                               "import jax\nprint('joined', jax.device_count())\n")
    args = _args.parse_args(["--nproc", "2", "--kill-timeout", "1", script])
    start = time.monotonic()
    try:
        status = _runner.Launcher(args).run()
        seconds = time.monotonic() - start
    finally:
        other.close()
        held.close()
    out, err = capsys.readouterr()
    with capsys.disabled():
        print(f"port taken before the start: status {status} after {seconds:.1f} s")
    assert status == 0, out + err
    assert (f"[launch] the coordinator port {port} is taken by another program; starting the "
            "processes again on another port") in err, err
    assert "[rank 0] joined 2" in out and "[rank 1] joined 2" in out


def test_a_port_taken_while_the_script_starts_is_named(tmp_path):
    """Process 0's coordinator cannot listen (gRPC then crashes the process)."""
    script = _script(tmp_path, """\
import os, socket
if os.environ["QCOLLECT_PROCESS_ID"] == "0":
    port = int(os.environ["QCOLLECT_COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    other.bind(("127.0.0.1", port))
    other.listen()
import qcollect.launch
qcollect.launch.initialize()
""")
    status, out, err, seconds = _launch("--nproc", "2", "--kill-timeout", "1", script)
    print(f"port taken while starting: status {status} after {seconds:.1f} s")
    attempts = getattr(_runner, "PORT_ATTEMPTS", 3)
    assert f"is taken by another program ({attempts} ports tried)" in err, err
    assert err.count("is taken by another program; starting the processes again") == \
        attempts - 1, err
    assert status == 1, out + err
    assert seconds < 30, seconds
