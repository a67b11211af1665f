"""Starting, watching and stopping the worker processes.

Which process failed first is decided in ``_failures.py``, whether the job
stalled in ``_stall.py``; the workers' output is copied by ``_forward.py``,
and a worker's own side is ``_worker.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import TextIO

from qcollect.launch import _env, _netns, _stall, _worker
from qcollect.launch._failures import Deaths, Failure, first_failure, known_failures
from qcollect.launch._forward import Forwarder

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_STALLED = 124   # as timeout(1)
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_STALL_CHECK_SECONDS = 0.25
# After the first failure: how long to gather the other processes' reports and
# deaths before naming the one that failed first.
SETTLE_SECONDS = 1.0
# Starts of the job, each on a fresh port, while the coordinator's port is taken.
PORT_ATTEMPTS = 3
# What gRPC logs in process 0 (which then fails) when the coordinator's port is taken.
_PORT_TAKEN_LOG = "Failed to add port to server"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a free port of ``host``, held to keep the port free.

    It does not listen, and has ``SO_REUSEADDR`` like the ``jax.distributed``
    coordinator, which can therefore still serve on the port; but no program
    can bind the port without ``SO_REUSEADDR`` meanwhile, nor the kernel give
    it to an outgoing connection.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s


class _Interrupted(Exception):
    """SIGINT or SIGTERM arrived: the launcher stops the job."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _PortTaken(Exception):
    """Process 0 could not serve the coordinator: another program has its port."""


class Launcher:
    """Runs ``nproc`` copies of a script and tears everything down afterwards.

    Ends the job at the first failure, at a stall (``_stall.py``) or at
    SIGINT / SIGTERM; in every case it stops all workers and removes the
    shaped network.

    A failure ends the job with the status of the process that failed
    first, not of those that died of it (``_failures.py``): a thread per
    worker notes when it died, and `SETTLE_SECONDS` after the first failure
    the launcher names the earliest one.

    The job also ends, with status 1, as soon as a process starts JAX
    without joining it (its script does not call
    `qcollect.launch.initialize`): such processes run as independent
    single-process jobs with their own devices only, so a training script
    would silently train N separate models, on one device each, whatever
    ``--devices-per-process`` says; a user would rather learn that at once
    than after the run. A process that finished its script while others
    waited for it in JAX is named as having finished early
    (``finished_early`` in ``_stall.py``). The coordinator's port is
    held from the moment it is chosen (`reserve_port`); if another program
    still serves on it, process 0 says so and the job starts again on
    another port, up to `PORT_ATTEMPTS` times.

    Args:
      args: the parsed command line (``parse_args`` in ``_args.py``).
      stdout / stderr: where the workers' prefixed lines go.
    """

    def __init__(self, args: argparse.Namespace, stdout: TextIO | None = None,
                 stderr: TextIO | None = None) -> None:
        self.args = args
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.procs: list[subprocess.Popen[bytes]] = []
        self.threads: list[threading.Thread] = []
        self.network: _netns.StarNetwork | None = None
        self.board: _stall.Board | None = None
        self.reaper: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self.deaths: Deaths = {}
        self.forwarders: dict[int, list[Forwarder]] = {}
        self.port_log = threading.Event()   # process 0 logged that its port is taken

    @property
    def shaped(self) -> bool:
        """The workers run on a shaped network (``--bandwidth``, ``--latency``)."""
        return self.args.bandwidth is not None or self.args.latency is not None

    def _say(self, message: str) -> None:
        print(f"[launch] {message}", file=self.stderr, flush=True)

    def _environment(self, rank: int, coordinator: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(_env.worker_environment(coordinator, self.args.nproc, rank,
                                           self.args.devices_per_process,
                                           stall_timeout=self.args.stall_timeout))
        env[_env.LAUNCHER_PID] = str(os.getpid())
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self, rank: int, argv: list[str], env: dict[str, str], report_fd: int
               ) -> subprocess.Popen[bytes]:
        """Starts worker ``rank`` (called from the main thread: the workers'
        parent-death signal follows the thread that started them)."""
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                pass_fds=(report_fd,))

    def _reap(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        """Waits for worker ``rank`` and notes when it died."""
        code = proc.wait()
        with self._lock:
            self.deaths[rank] = (time.monotonic(), code)

    def _watch_port(self, line: str) -> None:
        if _PORT_TAKEN_LOG in line:
            self.port_log.set()

    def _start(self, coordinator: str) -> None:
        """Starts and registers every worker with SIGINT and SIGTERM blocked, so
        that a signal cannot leave a started worker unregistered (and running);
        one that arrives meanwhile stops the starting and is handled after."""
        board = self.board = _stall.Board(self.args.nproc, time.monotonic())
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
                watch = self._watch_port if rank == 0 else None
                for pipe, sink in ((proc.stdout, self.stdout), (proc.stderr, self.stderr)):
                    assert pipe is not None   # stdout=PIPE, stderr=PIPE
                    t = Forwarder(pipe, sink, f"[rank {rank}] ", watch)
                    t.start()
                    self.threads.append(t)
                    self.forwarders.setdefault(rank, []).append(t)
                reaper = threading.Thread(target=self._reap, args=(rank, proc), daemon=True)
                reaper.start()
                self.threads.append(reaper)
                board.read(rank, open(read_fd, "rb"), time.monotonic)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)

    def _failures(self, reports: dict[int, _stall.Report], deaths: Deaths) -> list[Failure]:
        """``(peer_lost, time, rank, status)`` of every process known to have failed."""
        return known_failures(reports, deaths, len(self.procs))

    def _failed(self, failures: list[Failure], reports: dict[int, _stall.Report],
                now: float) -> int:
        """Names the process that failed first and returns its status."""
        status, message = first_failure(failures, reports, now)
        self._say(message)
        return status

    def _port_taken(self, reports: dict[int, _stall.Report], codes: Sequence[int | None]
                    ) -> bool:
        """Process 0 exited because another program has the coordinator's port."""
        return bool(codes) and codes[0] is not None and (
            reports[0].state == "port" or self.port_log.is_set())

    def _not_joined(self, ranks: list[int]) -> int:
        self._say(f"{_stall.ranks(ranks)} started JAX without joining the job: the script "
                  "must call qcollect.launch.initialize() before any other JAX use, or each "
                  "process runs alone on its own devices; stopping the processes")
        return EXIT_FAILED

    def _wait(self) -> int:
        """Waits for all workers; the first failure or a stall stops the others."""
        timeout = self.args.stall_timeout
        board = self.board
        assert board is not None   # _start made it
        grace_end: float | None = None
        settle_end: float | None = None
        running: list[int] = []
        next_check, drained = 0.0, False
        while True:
            now = time.monotonic()
            reports = board.snapshot()
            with self._lock:
                deaths = dict(self.deaths)
            codes = [deaths[r][1] if r in deaths else None for r in range(len(self.procs))]
            live = [r for r, c in enumerate(codes) if c is None]
            if not live and not drained:
                # Every worker exited: read what they reported last before deciding.
                for t in board.threads:
                    t.join(timeout=1.0)
                drained, reports = True, board.snapshot()
            if grace_end is None:
                if self._port_taken(reports, codes):
                    raise _PortTaken()
                alone = [r for r, rep in reports.items() if rep.joined is False]
                if alone:
                    return self._not_joined(alone)
                timed_out = [r for r, rep in reports.items() if rep.state == "timeout"]
                if timed_out:
                    # Detector 1: let the other waiting ranks time out as well.
                    grace_end = now + _stall.GRACE_SECONDS
                    running = [r for r, c in enumerate(codes) if c != 0]   # not finished
                    continue
                failures = self._failures(reports, deaths)
                if failures:
                    settle_end = settle_end or now + SETTLE_SECONDS
                    if now >= settle_end or not live:
                        for t in self.forwarders.get(0, []) if codes[0] is not None else []:
                            t.join(timeout=1.0)   # its last lines may say why it failed
                        if self._port_taken(reports, codes):
                            raise _PortTaken()
                        return self._failed(failures, reports, now)
                elif all(c == 0 for c in codes):
                    return 0
                elif timeout > 0 and now >= next_check:
                    next_check = now + _STALL_CHECK_SECONDS
                    early = _stall.finished_early(reports, live, timeout, now)
                    if early is not None:   # (maybe before the stall timeout: JAX's deadline)
                        self._say(f"{early}; stopping the processes")
                        return EXIT_STALLED
                    message = _stall.sampled_stall(reports, live, timeout, now)
                    if message is not None:
                        return self._stalled(message)
            elif now >= grace_end or not live:
                setup = _stall.setup_stall(reports, running, now)
                if setup is not None:
                    self._say(f"{setup}; stopping the processes")
                    return EXIT_STALLED
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

    def _restart(self) -> None:
        """Stops every worker and forgets them, for another start of the job."""
        self._stop()
        self.procs, self.threads, self.board = [], [], None
        self.deaths, self.forwarders = {}, {}
        self.port_log.clear()

    def _sweep(self) -> None:
        """Removes the namespaces and hosts folders of launchers no longer running."""
        for pid, paths in sorted(_netns.stale().items()):
            errors = _netns.remove(paths)
            names = ", ".join(sorted({os.path.basename(p) for p in paths}))
            self._say(f"removed what launcher {pid}, no longer running, left: {names}")
            for error in errors:
                self._say(f"cleanup: {error}")

    def _run_job(self) -> int:
        """Starts the workers on a reserved port, again on a new one while
        process 0 finds its port taken; returns the exit status."""
        taken = ""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if attempt > 1:
                self._say(f"{taken}; starting the processes again on another port")
                self._restart()
            with reserve_port() as held:
                port = held.getsockname()[1]
                host = "127.0.0.1" if self.network is None else self.network.address(0)
                self._start(f"{host}:{port}")
                try:
                    return self._wait()
                except _PortTaken:
                    taken = f"the coordinator port {port} is taken by another program"
        self._say(f"{taken} ({PORT_ATTEMPTS} ports tried); stopping the processes")
        return EXIT_FAILED

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

        def interrupt(signum: int, frame: FrameType | None) -> None:
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
            return self._run_job()
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
                if self.reaper is not None and self.reaper.stdin is not None:
                    self.reaper.stdin.close()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.reaper.wait(timeout=5)
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
