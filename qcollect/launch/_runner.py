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

from qcollect.launch import _env, _netns, _stall, _worker

EXIT_USAGE = 2
EXIT_STALLED = 124   # as timeout(1)
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_STALL_CHECK_SECONDS = 0.25


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

    Ends the job at the first failure, at a stall (`qcollect.launch._stall`)
    or at SIGINT / SIGTERM; in every case it stops all workers and removes
    the shaped network.

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
        self.board: _stall.Board | None = None
        self.reaper: subprocess.Popen | None = None

    @property
    def shaped(self) -> bool:
        return self.args.bandwidth is not None or self.args.latency is not None

    def _say(self, message: str) -> None:
        print(f"[launch] {message}", file=self.stderr, flush=True)

    def _environment(self, rank: int, coordinator: str) -> dict:
        env = dict(os.environ)
        env.update(_env.worker_environment(coordinator, self.args.nproc, rank,
                                           self.args.devices_per_process,
                                           stall_timeout=self.args.stall_timeout))
        env[_env.LAUNCHER_PID] = str(os.getpid())
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self, rank: int, argv: list[str], env: dict, report_fd: int) -> subprocess.Popen:
        """Starts worker ``rank`` (called from the main thread: the workers'
        parent-death signal follows the thread that started them)."""
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                pass_fds=(report_fd,))

    def _start(self, coordinator: str) -> None:
        """Starts and registers every worker with SIGINT and SIGTERM blocked, so
        that a signal cannot leave a started worker unregistered (and running);
        one that arrives meanwhile stops the starting and is handled after."""
        self.board = _stall.Board(self.args.nproc, time.monotonic())
        # Threads started here inherit the mask, so only this one takes the signals.
        signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            for rank in range(self.args.nproc):
                if set(_SIGNALS) & signal.sigpending():
                    break
                argv = [sys.executable, _worker.__file__, self.args.script, *self.args.args]
                if self.network is not None:
                    argv = self.network.command(rank, argv)
                env = self._environment(rank, coordinator)
                read_fd, write_fd = os.pipe()
                env[_env.STATUS_FD] = str(write_fd)
                try:
                    proc = self._spawn(rank, argv, env, write_fd)
                except BaseException:
                    os.close(read_fd)
                    raise
                finally:
                    os.close(write_fd)
                self.procs.append(proc)
                for pipe, sink in ((proc.stdout, self.stdout), (proc.stderr, self.stderr)):
                    t = _Forwarder(pipe, sink, f"[rank {rank}] ")
                    t.start()
                    self.threads.append(t)
                self.board.read(rank, open(read_fd, "rb"), time.monotonic)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)

    def _wait(self) -> int:
        """Waits for all workers; the first failure or a stall stops the others."""
        timeout = self.args.stall_timeout
        grace_end, running, next_check = None, [], 0.0
        while True:
            codes = [p.poll() for p in self.procs]
            now = time.monotonic()
            reports = self.board.snapshot()
            live = [r for r, c in enumerate(codes) if c is None]
            if grace_end is None:
                timed_out = [r for r, rep in reports.items() if rep.state == "timeout"]
                if timed_out:
                    # Detector 1: let the other waiting ranks time out as well.
                    grace_end = now + _stall.GRACE_SECONDS
                    running = [r for r, c in enumerate(codes) if c != 0]   # not finished
                    continue
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    rank, code = failed[0]
                    self._say(f"rank {rank} exited with status {_exit_status(code)}; "
                              "stopping the other processes")
                    return _exit_status(code)
                if all(c == 0 for c in codes):
                    return 0
                if timeout > 0 and now >= next_check:
                    next_check = now + _STALL_CHECK_SECONDS
                    message = _stall.sampled_stall(reports, live, timeout, now)
                    if message is not None:
                        return self._stalled(message)
            elif now >= grace_end or not live:
                return self._stalled(_stall.timeout_stall(reports, running, now))
            time.sleep(0.05)

    def _stalled(self, message: str) -> int:
        self._say(f"stalled for {self.args.stall_timeout:g} s (--stall-timeout): {message}; "
                  "stopping the processes")
        return EXIT_STALLED

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
        for t in self.threads + (self.board.threads if self.board else []):
            t.join(timeout=1.0)

    def _sweep(self) -> None:
        """Removes the namespaces and hosts folders of launchers no longer running."""
        for pid, paths in sorted(_netns.stale().items()):
            errors = _netns.remove(paths)
            names = ", ".join(sorted({os.path.basename(p) for p in paths}))
            self._say(f"removed what launcher {pid}, no longer running, left: {names}")
            for error in errors:
                self._say(f"cleanup: {error}")

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
            if self.args.nproc > _netns.MAX_WORKERS:
                self._say(f"--bandwidth/--latency support at most {_netns.MAX_WORKERS} "
                          f"processes (--nproc {self.args.nproc})")
                return EXIT_USAGE

        def interrupt(signum, frame):
            raise _Interrupted(signum)

        previous = {s: signal.signal(s, interrupt) for s in _SIGNALS}
        try:
            if self.shaped:
                self._sweep()
                self.network = _netns.StarNetwork(
                    f"qc{os.getpid()}", self.args.nproc, self.args.bandwidth, self.args.latency)
                self.reaper = _netns.reaper(self.network.prefix + "-")
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
                if self.reaper is not None:
                    self.reaper.stdin.close()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.reaper.wait(timeout=5)
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
