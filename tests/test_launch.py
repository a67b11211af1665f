"""``python -m qcollect.launch``: multi-process runs, shaped network, failures, arguments."""

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import qcollect.launch
from qcollect.launch import _args, _env, _netns, _runner, _stall, _worker

HERE = pathlib.Path(__file__).resolve().parent
WORKER = str(HERE / "launch_worker.py")


def _clean_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "PYTEST_XDIST_WORKER") and not k.startswith("QCOLLECT_")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _launch(*argv, timeout=60):
    """Runs the launcher to completion; returns (status, stdout, stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "qcollect.launch", *argv], env=_clean_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _pids(out_dir: pathlib.Path):
    return [int(p.read_text()) for p in sorted(out_dir.glob("pid*"))]


def _workers_of(marker: str) -> list[int]:
    """Live worker processes (any stage of start-up) whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        if marker in cmdline and "qcollect.launch" not in cmdline and _alive(int(entry)):
            found.append(int(entry))
    return found


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _gone_within(pids, seconds: float) -> float | None:
    """Seconds until every process in ``pids`` is gone, or None after ``seconds``."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not any(_alive(p) for p in pids):
            return time.monotonic() - start
        time.sleep(0.02)
    return None


class _Launched:
    """A launcher run in the background: stdout lines with arrival times, stderr
    in a file; `close` kills whatever is left of it."""

    def __init__(self, argv, tmp_path, env=None):
        self.marker = str(tmp_path)
        self.err_path = tmp_path / "launcher.err"
        self.lines: list[tuple[float, str]] = []
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "qcollect.launch", *argv],
                                         env=env or _clean_env(), stdout=subprocess.PIPE,
                                         stderr=err, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def wait_for(self, text: str, count: int = 1, timeout: float = 60) -> float:
        """Arrival time of the ``count``-th stdout line that contains ``text``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [t for t, line in list(self.lines) if text in line]
            if len(hits) >= count:
                return hits[count - 1]
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no {count} x {text!r} in time: {self.output()}")

    def finish(self, timeout: float) -> tuple[int, float]:
        """Exit status and the time it ended (``time.monotonic()``)."""
        status = self.proc.wait(timeout=timeout)
        ended = time.monotonic()
        self.reader.join(timeout=5)
        return status, ended

    def stderr(self) -> str:
        return self.err_path.read_text()

    def output(self) -> str:
        return "".join(line for _, line in self.lines) + self.stderr()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        _kill(_workers_of(self.marker))


def _assert_results_match_single_process(out_dir):
    """Every process's rows are those of the same programs on 4 local devices,
    to float32 rounding: the two are different programs (collectives across
    processes against collectives in one), free to add in another order, so
    a row may differ from the other by a few units in the last place of its
    largest value."""
    import launch_worker

    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    want = {name: np.asarray(a) for name, a in launch_worker.compute(mesh).items()}
    seen = set()
    for rank in range(2):
        with np.load(out_dir / f"rank{rank}.npz") as rows:
            for key in rows.files:
                name, row = key.split("/")
                expected = want[name][int(row)]
                scale = float(np.max(np.abs(expected), initial=1.0))
                np.testing.assert_allclose(rows[key], expected, rtol=0, atol=8e-7 * scale,
                                           err_msg=key)
                seen.add((name, int(row)))
    assert seen == {(name, r) for name in want for r in range(4)}


def test_two_processes_two_devices_match_numpy_and_single_process(tmp_path):
    status, out, err, _ = _launch("--nproc", "2", "--devices-per-process", "2",
                                  WORKER, "check", str(tmp_path))
    assert status == 0, out + err
    for rank in range(2):
        assert f"[rank {rank}] process {rank} of 2, 2 of 4 devices" in out
        assert f"[rank {rank}] ok" in out
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in out.splitlines())
    _assert_results_match_single_process(tmp_path)


def test_the_coordinator_listens_on_the_jobs_address_only(tmp_path):
    """Rank 0's coordination service binds the loopback address the job uses,
    not every interface (an unauthenticated service)."""
    status, out, err, _ = _launch("--nproc", "2", WORKER, "listen", str(tmp_path))
    assert status == 0, out + err
    line = next(x for x in out.splitlines() if "listening on" in x)
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, IPv4 or mapped
    addresses = line.split("listening on")[1].split()
    assert addresses and set(addresses) <= loopback, line


def _shaping_unavailable():
    missing = _netns.missing_requirements()
    if missing:
        return "needs " + ", ".join(missing)
    probe = f"qcprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=False)
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, check=False)
    return None if made.returncode == 0 else "network namespaces cannot be created here"


@pytest.mark.skipif(_shaping_unavailable() is not None,
                    reason=str(_shaping_unavailable()))
def test_shaped_network_runs_and_leaves_nothing_behind(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "qcollect.launch", "--nproc", "2", "--bandwidth", "1gbit",
         WORKER, "check", str(tmp_path)],
        env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    assert "[rank 0] ok" in out and "[rank 1] ok" in out
    prefix = f"qc{proc.pid}"
    assert _netns.leftovers(prefix) == []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert prefix not in links
    assert not any(_alive(p) for p in _pids(tmp_path))


def test_crashing_worker_stops_the_others(tmp_path):
    status, out, err, seconds = _launch("--nproc", "2", "--devices-per-process", "2",
                                        WORKER, "crash", str(tmp_path), timeout=30)
    assert status == 3, out + err
    assert seconds < 15, seconds
    assert "[launch] rank 1 exited with status 3" in err
    pids = _pids(tmp_path)
    assert len(pids) == 2
    assert not any(_alive(p) for p in pids)


def test_sigterm_to_the_launcher_stops_every_worker(tmp_path):
    # A long --kill-timeout: the workers must end on SIGTERM itself, which
    # jax.distributed's handler would swallow.
    proc = subprocess.Popen(
        [sys.executable, "-m", "qcollect.launch", "--nproc", "2", "--kill-timeout", "30",
         WORKER, "sleep", str(tmp_path)],
        env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = set()
    deadline = time.monotonic() + 30
    while len(ready) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.endswith("] ready\n"):
            ready.add(line)
    assert len(ready) == 2
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=45)
    seconds = time.monotonic() - signalled
    print(f"SIGTERM to the launcher: it ended {seconds:.2f} s later")
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert seconds < 10, seconds
    assert not any(_alive(p) for p in _pids(tmp_path))


@pytest.mark.parametrize("text,bits", [("1gbit", 10**9), ("100mbit", 10**8),
                                       ("2.5Gbit", 25 * 10**8), ("64kbit", 64000),
                                       ("12.5mbps", 10**8), ("800bit", 800)])
def test_parse_rate(text, bits):
    assert _args.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["1gb", "gbit", "100", "-1mbit", "1 gigabit", "", "0bit"])
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError, match="--bandwidth"):
        _args.parse_rate(text)


@pytest.mark.parametrize("text,micros", [("1ms", 1000), ("250us", 250), ("0.5s", 500000),
                                         ("2msec", 2000), ("0ms", 0)])
def test_parse_delay(text, micros):
    assert _args.parse_delay(text) == micros


@pytest.mark.parametrize("text", ["1", "ms", "-1ms", "1min", "61s"])
def test_parse_delay_rejects(text):
    with pytest.raises(ValueError, match="--latency"):
        _args.parse_delay(text)


def test_parse_args_keeps_the_script_arguments():
    a = _args.parse_args(["--nproc", "2", "--devices-per-process", "3", "--bandwidth", "1gbit",
                          "--latency", "1ms", "train.py", "--steps", "5", "--nproc", "7"])
    assert (a.nproc, a.devices_per_process, a.bandwidth, a.latency) == (2, 3, 10**9, 1000)
    assert a.script == "train.py" and a.args == ["--steps", "5", "--nproc", "7"]
    plain = _args.parse_args(["--nproc", "1", "s.py"])
    assert (plain.bandwidth, plain.latency, plain.devices_per_process) == (None, None, 1)
    assert (plain.stall_timeout, plain.force) == (600.0, False)
    assert _args.parse_args(["--nproc", "1", "--stall-timeout", "0", "s.py"]).stall_timeout == 0


@pytest.mark.parametrize("argv,named", [
    (["--nproc", "0", "s.py"], "--nproc"),
    (["--nproc", "two", "s.py"], "--nproc"),
    (["--nproc", "2", "--devices-per-process", "0", "s.py"], "--devices-per-process"),
    (["--nproc", "2", "--bandwidth", "fast", "s.py"], "--bandwidth"),
    (["--nproc", "2", "--bandwidth", "1gbit", "--latency", "soon", "s.py"], "--latency"),
    (["s.py"], "--nproc"),
    (["--nproc", "2", "--stall-timeout", "-1", "s.py"], "--stall-timeout"),
    (["--nproc", "2", "--stall-timeout", "0.5", "s.py"], "--stall-timeout"),
    (["--nproc", "2", "--stall-timeout", "nan", "s.py"], "--stall-timeout"),
    (["--nproc", "2", "--stall-timeout", "soon", "s.py"], "--stall-timeout"),
])
def test_bad_arguments_exit_2_naming_the_argument(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        _args.parse_args(argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_missing_script_exits_2(tmp_path, capsys):
    args = _args.parse_args(["--nproc", "2", str(tmp_path / "absent.py")])
    assert _runner.Launcher(args).run() == 2
    assert "script not found" in capsys.readouterr().err


def test_shaping_without_requirements_exits_2_naming_them(tmp_path, monkeypatch, capsys):
    script = tmp_path / "s.py"
    script.write_text("")
    monkeypatch.setattr(_netns, "missing_requirements",
                        lambda: ["root privileges", "the `tc` program"])
    args = _args.parse_args(["--nproc", "2", "--bandwidth", "1gbit", str(script)])
    assert _runner.Launcher(args).run() == 2
    err = capsys.readouterr().err
    assert "root privileges" in err and "`tc`" in err


def test_missing_requirements_names_programs(monkeypatch):
    monkeypatch.setattr(_netns.shutil, "which", lambda name: None if name == "tc" else "/bin/x")
    assert any("`tc`" in m for m in _netns.missing_requirements())


def test_worker_environment_and_initialize_without_launcher(monkeypatch):
    env = _env.worker_environment("127.0.0.1:1234", 4, 2, 3)
    assert env[_env.COORDINATOR] == env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:1234"
    assert (env[_env.NUM_PROCESSES], env[_env.PROCESS_ID], env[_env.DEVICES_PER_PROCESS]) == \
        ("4", "2", "3")
    for name in (_env.COORDINATOR, _env.NUM_PROCESSES, _env.PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    assert not qcollect.launch.is_launched()
    assert qcollect.launch.initialize() is False


def test_star_network_names_and_worker_command():
    net = _netns.StarNetwork("qc99", 3, rate_bits=10**9)
    assert [net.namespace(r) for r in range(3)] == ["qc99-0", "qc99-1", "qc99-2"]
    assert net.address(2) == "10.213.0.12" and net.hub_address == "10.213.0.1"
    cmd = net.command(1, ["python", "s.py"])
    assert cmd[:4] == ["ip", "netns", "exec", "qc99-1"] and cmd[-2:] == ["python", "s.py"]
    assert "--uts" in cmd and net.hostname(1) in cmd
    assert _netns.tbf_burst_bytes(10**9) == 500000
    with pytest.raises(ValueError, match="size"):
        _netns.StarNetwork("qc99", 0)


@pytest.mark.parametrize("detector,length,xla_flags", [
    # Four floats run inline: only the runtime's collective timeout sees the wait.
    ("runtime", 4, None),
    # With XLA's timeout far away, the stack samples (block_until_ready) end it.
    pytest.param("sampled", 65536, "--xla_cpu_collective_timeout_seconds=1000",
                 marks=pytest.mark.slow),
])
def test_a_stalled_rank_ends_the_job_naming_it(tmp_path, detector, length, xla_flags):
    env = _clean_env()
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    run = _Launched(["--nproc", "2", "--stall-timeout", "5", WORKER, "stall", str(tmp_path),
                     str(length)], tmp_path, env)
    try:
        stalled_at = run.wait_for("[rank 1] stalling", timeout=90)
        status, ended = run.finish(timeout=30)
        err = run.stderr()
        assert status == 124, run.output()
        assert "[launch] stalled for 5 s (--stall-timeout): rank 1 stopped arriving" in err, err
        if detector == "runtime":
            assert "rank 0 timed out waiting in a collective" in err, err
        else:
            assert "rank 0 waited" in err and "in JAX" in err, err
        seconds = ended - stalled_at
        print(f"stall ({detector}): job ended {seconds:.1f} s after rank 1 stopped")
        assert 4.5 <= seconds < 5 + 8, seconds
        pids = _pids(tmp_path)
        assert len(pids) == 2 and not any(_alive(p) for p in pids)
        assert _workers_of(str(tmp_path)) == []
    finally:
        run.close()


def test_sigkill_of_the_launcher_takes_the_workers_down(tmp_path):
    run = _Launched(["--nproc", "2", WORKER, "sleep", str(tmp_path)], tmp_path)
    try:
        run.wait_for("] ready", count=2)
        pids = _pids(tmp_path)
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        run.proc.kill()
        seconds = _gone_within(pids, 5)
        print(f"kill -9 of the launcher: workers gone after {seconds} s")
        assert seconds is not None, [p for p in pids if _alive(p)]
        assert _workers_of(str(tmp_path)) == []
    finally:
        run.close()


def _reaper_of(launcher_pid: int) -> list[int]:
    """The process that removes launcher ``launcher_pid``'s network when it exits."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode("utf-8", "replace").split("\0")
        except OSError:
            continue
        if f"qc{launcher_pid}-" in argv and argv[0] == "sh" and _alive(int(entry)):
            found.append(int(entry))
    return found


@pytest.mark.skipif(_shaping_unavailable() is not None,
                    reason=str(_shaping_unavailable()))
def test_killed_shaped_launchers_leave_nothing_behind(tmp_path):
    """kill -9 of a shaped launcher: its reaper removes the network; kill -9 of
    the reaper too: the next shaped launcher removes it."""
    runs, prefixes = [], []

    def start(name, mode):
        (tmp_path / name).mkdir()
        run = _Launched(["--nproc", "2", "--bandwidth", "1gbit", WORKER, mode,
                         str(tmp_path / name)], tmp_path)
        runs.append(run)
        prefixes.append(f"qc{run.proc.pid}-")
        return run

    try:
        first = start("first", "sleep")
        first.wait_for("] ready", count=2)
        pids = _pids(tmp_path / "first")
        assert _netns.leftovers(prefixes[0])
        killed = time.monotonic()
        first.proc.kill()
        seconds = _gone_within(pids, 5)
        assert seconds is not None, "workers outlived a killed shaped launcher"
        while _netns.leftovers(prefixes[0]) and time.monotonic() - killed < 10:
            time.sleep(0.01)
        cleaned = time.monotonic() - killed
        first.proc.wait(timeout=10)
        print(f"kill -9 of a shaped launcher: workers gone after {seconds:.3f} s, "
              f"namespaces removed {cleaned:.2f} s after the kill")
        assert _netns.leftovers(prefixes[0]) == []

        second = start("second", "sleep")
        second.wait_for("] ready", count=2)
        pids = _pids(tmp_path / "second")
        reapers = _reaper_of(second.proc.pid)
        assert len(reapers) == 1
        _kill(reapers)
        assert _gone_within(reapers, 5) is not None
        second.proc.kill()
        second.proc.wait(timeout=10)
        assert _gone_within(pids, 5) is not None
        left = _netns.leftovers(prefixes[1])
        assert any(p.startswith(_netns.NETNS_RUN) for p in left), left
        assert _netns.stale()[second.proc.pid] == left

        third = start("third", "hello")
        status, _ = third.finish(timeout=90)
        assert status == 0, third.output()
        assert f"[launch] removed what launcher {second.proc.pid}, no longer running" in \
            third.stderr()
        assert all(_netns.leftovers(p) == [] for p in prefixes)
    finally:
        for run in runs:
            run.close()
            _kill(_reaper_of(run.proc.pid))
        for prefix in prefixes:
            _netns.remove(_netns.leftovers(prefix))


def test_sigterm_while_starting_workers_leaves_none(tmp_path, capsys):
    """The signal comes between starting a worker and registering it."""
    script = tmp_path / "s.py"
    script.write_text("import time\ntime.sleep(60)\n")
    args = _args.parse_args(["--nproc", "4", "--kill-timeout", "1", str(script)])
    started = []

    class Interrupted(_runner.Launcher):
        def _spawn(self, rank, argv, env, report_fd):
            proc = super()._spawn(rank, argv, env, report_fd)
            started.append(proc.pid)
            if rank == 1:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
            return proc

    try:
        assert Interrupted(args).run() == 128 + signal.SIGTERM
        assert len(started) == 2   # none started after the signal
        assert not any(_alive(p) for p in started)
        assert "SIGTERM: stopping the processes" in capsys.readouterr().err
    finally:
        _kill(started)


def test_sigterm_to_a_starting_launcher_leaves_no_worker(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import time\ntime.sleep(60)\n")
    run = _Launched(["--nproc", "8", str(script)], tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not _workers_of(str(script)) and time.monotonic() < deadline:
            time.sleep(0.002)
        run.proc.send_signal(signal.SIGTERM)
        status, ended = run.finish(timeout=30)
        assert status == 128 + signal.SIGTERM, run.output()
        seconds = _gone_within(_workers_of(str(script)), 5)
        print(f"SIGTERM while starting: workers gone {seconds} s after the launcher ended")
        assert seconds is not None and _workers_of(str(script)) == []
    finally:
        run.close()


def test_nproc_above_four_per_cpu_exits_2_unless_forced(capsys):
    over = _args.nproc_limit() + 1
    assert _args.nproc_limit() == 4 * os.cpu_count()
    with pytest.raises(SystemExit) as e:
        _args.parse_args(["--nproc", str(over), "s.py"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--nproc {over}" in err and "--force" in err
    assert _args.parse_args(["--nproc", str(over), "--force", "s.py"]).nproc == over


def test_worker_classifies_the_main_threads_stack():
    stdlib = _worker._stdlib_dir()
    namespace = {"sys": sys}
    exec(compile("def inner():\n    return sys._getframe()\n", "/opt/fakejax/api.py", "exec"),
         namespace)
    exec(compile("def lib(f):\n    return f()\n", stdlib + "fakelib.py", "exec"), namespace)
    frame = namespace["lib"](namespace["inner"])
    assert _worker.classify(frame, ("/opt/fakejax/",), stdlib) == ("jax", frame)
    # A standard library frame above a JAX one is skipped; user code is not.
    exec(compile("def top():\n    return sys._getframe()\n", stdlib + "fakelib2.py", "exec"),
         namespace)
    assert _worker.classify(sys._getframe(), ("/opt/fakejax/",), stdlib) == ("user", None)
    assert _worker.classify(namespace["top"](), ("/opt/fakejax/",), stdlib) == ("user", None)


def test_worker_recognizes_a_collective_timeout():
    gloo = ValueError("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/"
                      "unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation")
    try:
        try:
            raise gloo
        except ValueError as e:
            raise RuntimeError("step failed") from e
    except RuntimeError as e:
        assert _worker.is_collective_timeout(e)
    assert not _worker.is_collective_timeout(ValueError("Timed out"))
    assert (_worker.LAUNCHER_PID, _worker.STATUS_FD, _worker.STALL_TIMEOUT) == \
        (_env.LAUNCHER_PID, _env.STATUS_FD, _env.STALL_TIMEOUT)


def test_stall_verdicts():
    now = 100.0

    def rep(state, seconds, wait=None):
        return _stall.Report(state, seconds, wait, now)

    assert _stall.parse(b'{"state": "jax", "for": 2.5, "wait": 2.0}\n', 1.0) == \
        _stall.Report("jax", 2.5, 2.0, 1.0)
    assert _stall.parse(b"not json\n", 1.0) is None
    waiting, stopped = rep("jax", 6, 5.5), rep("user", 7)
    msg = _stall.sampled_stall({0: waiting, 1: stopped}, [0, 1], 5, now)
    assert msg == "rank 1 stopped arriving (outside JAX for 7.0 s); rank 0 waited 5.5 s in JAX"
    # Not yet: the wait is short of the timeout, or another rank is still waiting.
    assert _stall.sampled_stall({0: rep("jax", 4, 4.0), 1: stopped}, [0, 1], 5, now) is None
    assert _stall.sampled_stall({0: waiting, 1: rep("jax", 3, 3.0)}, [0, 1], 5, now) is None
    assert "a deadlock or a lost peer" in _stall.sampled_stall(
        {0: waiting, 1: rep("jax", 5, 5.0)}, [0, 1], 5, now)
    # A finished rank is no longer considered.
    assert _stall.sampled_stall({0: waiting, 1: stopped}, [0], 5, now).startswith("every")
    msg = _stall.timeout_stall({0: rep("timeout", 0), 1: stopped, 2: rep("starting", 9)},
                               [0, 1, 2], now)
    assert msg == ("ranks 1, 2 stopped arriving (1: outside JAX for 7.0 s; 2: no report in "
                   "9.0 s); rank 0 timed out waiting in a collective")
    assert _stall.timeout_stall({0: rep("timeout", 0), 1: rep("jax", 3, 3.0)}, [0, 1], now) == \
        "rank 0 timed out waiting in a collective and rank 1 waited in JAX: " \
        "a deadlock or a lost peer"


def test_initialize_sets_the_collective_timeout_unless_set(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --foo")
    qcollect.launch._set_xla_flags(2, 4.2)
    assert os.environ["XLA_FLAGS"].split() == [
        "--foo", "--xla_force_host_platform_device_count=2",
        "--xla_cpu_collective_timeout_seconds=5"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_timeout_seconds=99")
    qcollect.launch._set_xla_flags(1, 600)
    assert "--xla_cpu_collective_timeout_seconds=99" in os.environ["XLA_FLAGS"]
    assert "=600" not in os.environ["XLA_FLAGS"]
    monkeypatch.setenv("XLA_FLAGS", "")
    qcollect.launch._set_xla_flags(1, 0)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"


@pytest.mark.skipif(_shaping_unavailable() is not None,
                    reason=str(_shaping_unavailable()))
def test_stale_finds_only_what_dead_launchers_left():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True, timeout=30)
    dead, live = int(done.stdout), os.getpid()   # this process started before its names
    made = []
    try:
        for pid in (dead, live):
            name = f"qc{pid}-hub"
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True,
                           timeout=30)
            made.append(os.path.join(_netns.NETNS_RUN, name))
            os.makedirs(os.path.join(_netns.NETNS_ETC, f"qc{pid}-0"))
            made.append(os.path.join(_netns.NETNS_ETC, f"qc{pid}-0"))
        stale = _netns.stale()
        if _netns.process_start_time(dead) is None:   # (its id was not reused meanwhile)
            assert sorted(stale[dead]) == sorted(p for p in made if f"qc{dead}-" in p)
        assert live not in stale
        assert _netns.remove(stale.get(dead, [])) == []
        assert _netns.leftovers(f"qc{dead}-") == []
    finally:
        _netns.remove(made)
