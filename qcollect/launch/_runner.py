"""Starting, watching, forwarding and stopping the worker processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from qcollect.launch import _env, _netns, _worker

EXIT_USAGE = 2


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _exit_status(returncode: int) -> int:
    """A shell-style exit status: ``128 + n`` for death by signal ``n``."""
    return 128 - returncode if returncode < 0 else returncode


class _Forwarder(threading.Thread):
    """Copies one pipe to ``sink`` line by line with a ``[rank r] `` prefix."""

    lock = threading.Lock()

    def __init__(self, pipe, sink, prefix: str):
        super().__init__(daemon=True)
        self.pipe, self.sink, self.prefix = pipe, sink, prefix

    def run(self):
        with contextlib.suppress(ValueError, OSError):
            for raw in iter(self.pipe.readline, b""):
                line = raw.decode("utf-8", "replace")
                if not line.endswith("\n"):
                    line += "\n"
                with self.lock:
                    self.sink.write(self.prefix + line)
                    self.sink.flush()
        with contextlib.suppress(OSError):
            self.pipe.close()


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Launcher:
    """Runs ``nproc`` copies of a script and tears everything down afterwards.

    Args:
      args: the parsed command line (`qcollect.launch._args.parse_args`).
      stdout / stderr: where the workers' prefixed lines go.
    """

    def __init__(self, args, stdout=None, stderr=None):
        self.args = args
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.procs: list[subprocess.Popen] = []
        self.threads: list[_Forwarder] = []
        self.network: _netns.StarNetwork | None = None

    @property
    def shaped(self) -> bool:
        return self.args.bandwidth is not None or self.args.latency is not None

    def _say(self, message: str) -> None:
        print(f"[launch] {message}", file=self.stderr, flush=True)

    def _environment(self, rank: int, coordinator: str) -> dict:
        env = dict(os.environ)
        env.update(_env.worker_environment(coordinator, self.args.nproc, rank,
                                           self.args.devices_per_process))
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _start(self, coordinator: str) -> None:
        for rank in range(self.args.nproc):
            argv = [sys.executable, _worker.__file__, self.args.script, *self.args.args]
            if self.network is not None:
                argv = self.network.command(rank, argv)
            proc = subprocess.Popen(argv, env=self._environment(rank, coordinator),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            self.procs.append(proc)
            for pipe, sink in ((proc.stdout, self.stdout), (proc.stderr, self.stderr)):
                t = _Forwarder(pipe, sink, f"[rank {rank}] ")
                t.start()
                self.threads.append(t)

    def _wait(self) -> int:
        """Waits for all workers; the first failure stops the others."""
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                self._say(f"rank {rank} exited with status {_exit_status(code)}; "
                          "stopping the other processes")
                return _exit_status(code)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)

    def _stop(self) -> None:
        """SIGTERM to every live worker's process group, SIGKILL after the grace time."""
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.args.kill_timeout
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            # Whole groups: anything a worker started dies with it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for t in self.threads:
            t.join(timeout=1.0)

    def run(self) -> int:
        """Runs the workers to completion; returns the launcher's exit status."""
        if not os.path.isfile(self.args.script):
            self._say(f"script not found: {self.args.script}")
            return EXIT_USAGE
        if self.shaped:
            missing = _netns.missing_requirements()
            if missing:
                self._say("--bandwidth/--latency need " + ", ".join(missing))
                return EXIT_USAGE

        def interrupt(signum, frame):
            raise _Interrupted(signum)

        previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.shaped:
                self.network = _netns.StarNetwork(
                    f"qc{os.getpid()}", self.args.nproc, self.args.bandwidth, self.args.latency)
                try:
                    self.network.open()
                except _netns.NetworkSetupError as e:
                    self._say(f"could not build the shaped network: {e}")
                    return EXIT_USAGE
                coordinator = f"{self.network.address(0)}:{free_port()}"
            else:
                coordinator = f"127.0.0.1:{free_port()}"
            self._start(coordinator)
            return self._wait()
        except _Interrupted as e:
            self._say(f"{e}: stopping the processes")
            return 128 + e.signum
        finally:
            # Teardown must finish even if a second signal arrives.
            for s in previous:
                signal.signal(s, signal.SIG_IGN)
            try:
                self._stop()
                if self.network is not None:
                    for error in self.network.close():
                        self._say(f"cleanup: {error}")
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
