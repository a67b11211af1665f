"""``python -m qcollect.launch``: multi-process runs, shaped network, failures, arguments."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import qcollect.launch
from qcollect.launch import _args, _env, _netns, _runner

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


def _assert_results_match_single_process(out_dir):
    """Every process's rows equal those of the same programs on 4 local devices."""
    import launch_worker

    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    want = {name: np.asarray(a) for name, a in launch_worker.compute(mesh).items()}
    seen = set()
    for rank in range(2):
        with np.load(out_dir / f"rank{rank}.npz") as rows:
            for key in rows.files:
                name, row = key.split("/")
                np.testing.assert_array_equal(rows[key], want[name][int(row)], err_msg=key)
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
    proc = subprocess.Popen(
        [sys.executable, "-m", "qcollect.launch", "--nproc", "2", WORKER, "sleep", str(tmp_path)],
        env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = set()
    deadline = time.monotonic() + 30
    while len(ready) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.endswith("] ready\n"):
            ready.add(line)
    assert len(ready) == 2
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 128 + signal.SIGTERM, err
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


@pytest.mark.parametrize("argv,named", [
    (["--nproc", "0", "s.py"], "--nproc"),
    (["--nproc", "two", "s.py"], "--nproc"),
    (["--nproc", "2", "--devices-per-process", "0", "s.py"], "--devices-per-process"),
    (["--nproc", "2", "--bandwidth", "fast", "s.py"], "--bandwidth"),
    (["--nproc", "2", "--bandwidth", "1gbit", "--latency", "soon", "s.py"], "--latency"),
    (["s.py"], "--nproc"),
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
