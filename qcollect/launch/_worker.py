"""Runs one worker's script as ``__main__``, as ``python script.py args`` would.

Started by the launcher as ``python _worker.py script.py args``. It imports the
standard library only, so nothing of JAX is loaded before the script. What it
adds to running the script directly:

- It dies with the launcher: the parent-death signal (``prctl``
  ``PR_SET_PDEATHSIG``) is SIGKILL, set before anything else runs; a
  launcher that died before that is noticed by the parent process id. Under ``--bandwidth`` the
  worker still is the launcher's child, since ``ip netns exec``, ``unshare``
  and ``sh -c 'exec ...'`` each replace themselves by the next program.
- A failing script (an uncaught exception or ``sys.exit`` with a non-zero
  status) ends the process at once with that status, skipping interpreter
  shutdown. JAX's exit handler would otherwise wait in the ``jax.distributed``
  shutdown barrier for the other processes, which may be blocked in a
  collective with this one, so a failed process would never exit and the
  launcher could not notice it.
- A daemon thread samples the main thread's Python stack every
  `SAMPLE_SECONDS` and reports to the launcher (one JSON line per sample on
  the pipe the launcher passes) whether the script is inside JAX (the
  innermost frame outside the standard library belongs to the ``jax`` or
  ``jaxlib`` package: ``block_until_ready``, ``__array__``, ``device_get``, a
  compilation, ``jax.distributed``) or in its own code, for how long, and for
  how long it has been blocked in one and the same JAX call while the process
  stayed idle. A collective that failed on XLA's collective timeout is
  reported too, and the process then waits up to `TIMEOUT_LINGER_SECONDS` for
  the launcher to stop the job. The launcher's stall detection
  (``_stall.py``) reads these reports.
- A script that returned (or called ``sys.exit(0)``) ends as interpreter
  shutdown begins (non-daemon threads joined, ``atexit`` handlers run, JAX's
  shutdown barrier among them) and then exits 0 at once (`_finish`): the
  rest of shutdown can abort a process whose work is done.
- The last report says how the script ended, stamped with this process's
  ``time.monotonic()`` (one clock for every process of the machine): ``failed``
  with its status, and whether the error only says that a peer went away
  (`is_peer_loss`), so that the launcher names the process that failed
  first rather than the ones that died of it; or ``done`` when it returned,
  sent before JAX's exit-time shutdown barrier, where a process that
  finished early waits for the others.
- Every report says whether the script joined the job (`joined`): a script
  that started JAX without calling `qcollect.launch.initialize` can no longer
  join, and the launcher stops the job at the first such report.
- In process 0 it first checks that the coordinator's port can be served
  (`coordinator_port_free`). On a port another program listens on,
  ``jax.distributed`` fails in process 0 after gRPC logs "Failed to add port
  to server" (the process raises, or crashes with a segmentation fault), so
  the worker reports ``port`` and exits instead, and the launcher starts the
  job again on another port.
"""

from __future__ import annotations

import errno
import json
import os
import re
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any, Literal

# The same names as in ``_env.py`` (this file imports nothing of qcollect).
LAUNCHER_PID = "QCOLLECT_LAUNCHER_PID"
STATUS_FD = "QCOLLECT_STATUS_FD"
STALL_TIMEOUT = "QCOLLECT_STALL_TIMEOUT"
COORDINATOR = "QCOLLECT_COORDINATOR_ADDRESS"
PROCESS_ID = "QCOLLECT_PROCESS_ID"
PR_SET_PDEATHSIG = 1
EXIT_ORPHANED = 1
SAMPLE_SECONDS = 0.5
# A call counts as a wait while the process used at most this share of one
# CPU (plus IDLE_CPU_SECONDS) since it began: a computation is not a wait.
IDLE_CPU_SHARE = 0.1
IDLE_CPU_SECONDS = 0.2
# After a collective timed out: how long to wait for the launcher to stop the
# job (it names the processes that did not arrive) before exiting anyway.
TIMEOUT_LINGER_SECONDS = 10.0
# XLA numbers process p's CPU devices p * 2048 + i (``MAX_DEVICES_PER_PROCESS``
# of the launcher's arguments, ``_args.py``).
DEVICE_ID_STRIDE = 2048
# What an error says when it only reports that a peer process went away.
_PEER_LOSS = ("reset by peer", "closed by peer", "broken pipe", "socket closed",
              "coordination service")
# Gloo's rendezvous: a process waits for the address of each peer of a new
# device group under the key ".../gloo/<device ids>/<peer's index>".
_GLOO_KEY = re.compile(r"gloo/(\d+(?:,\d+)*)/(\d+)")

#: Where the main thread is: in JAX, or in the script's own code.
Kind = Literal["jax", "user"]

_status_fd: int | None = None
_final = threading.Event()   # set once the last report is out: sampling stops
WATCH_THREAD = "qcollect-launch-watch"


def die_with_launcher() -> None:
    """SIGKILL on the launcher's death; exits now if the launcher is already gone."""
    launcher = os.environ.pop(LAUNCHER_PID, None)
    if launcher is None:
        return
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != int(launcher):
        os._exit(EXIT_ORPHANED)


def _status(code: object) -> int:
    """The exit status of ``sys.exit(code)`` (a message prints and gives 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _flush() -> None:
    """Flushes stdout and stderr, whatever state they are in."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _die(status: int) -> None:
    """Exits at once with ``status``, skipping interpreter shutdown."""
    _flush()
    os._exit(status)


def report(record: dict[str, Any]) -> bool:
    """Writes one JSON line to the launcher; False once the pipe is gone."""
    if _status_fd is None:
        return False
    try:
        os.write(_status_fd, (json.dumps(record) + "\n").encode())
    except BlockingIOError:
        pass   # the launcher is behind: drop this sample
    except OSError:
        return False
    return True


def _texts(error: BaseException) -> Iterator[str]:
    """The messages of ``error`` and of what caused it (at most 8)."""
    seen = 0
    current: BaseException | None = error
    while current is not None and seen < 8:
        yield str(current)
        current, seen = current.__cause__ or current.__context__, seen + 1


def is_collective_timeout(error: BaseException) -> bool:
    """True when ``error`` (or what caused it) is a Gloo collective that timed out."""
    return any("Gloo" in text and "Timed out" in text for text in _texts(error))


def is_peer_loss(error: BaseException) -> bool:
    """True when ``error`` only says that a peer process went away."""
    return any(marker in text.lower() for text in _texts(error) for marker in _PEER_LOSS)


def setup_timeout(error: BaseException, process_of: dict[int, int] | None = None
                  ) -> list[int] | None:
    """The processes that did not join a Gloo device group in time, or None.

    The first collective over a set of devices creates a Gloo communicator
    for them; each process publishes its address in ``jax.distributed``'s
    key-value store and waits for its peers' addresses, each under a key
    ending in the peer's index in the group. Gloo gives up after its context
    timeout, 30 seconds, which XLA does not set and JAX exposes no setting
    for, with ``Gloo context initialization failed: DEADLINE_EXCEEDED:
    GetKeyValue() timed out with key: cpu:gloo/0,2048/1``.

    Args:
      error: what the script raised.
      process_of: device id -> process index (default: JAX's devices, or
        the id's block of `DEVICE_ID_STRIDE` when JAX cannot say).

    Returns:
      The process indices the waiting process gave up on (empty when the key
      cannot be read), or None when ``error`` is not such a timeout.
    """
    for text in _texts(error):
        if "Gloo context initialization failed" not in text or not (
                "DEADLINE_EXCEEDED" in text or "timed out" in text.lower()):
            continue
        match = _GLOO_KEY.search(text)
        if match is None:
            return []
        devices = [int(d) for d in match.group(1).split(",")]
        index = int(match.group(2))
        if index >= len(devices):
            return []
        if process_of is None:
            process_of = _device_processes()
        device = devices[index]
        return [process_of.get(device, device // DEVICE_ID_STRIDE)]
    return None


def _device_processes() -> dict[int, int]:
    """Device id -> process index, from JAX if it is running (else empty)."""
    jax: Any = sys.modules.get("jax")
    try:
        return {d.id: d.process_index for d in jax.devices()}
    except Exception:   # whatever the reason: fall back to the id blocks
        return {}


def joined() -> bool | None:
    """Whether the script joined the launched job: True once it called
    ``jax.distributed.initialize`` (through `qcollect.launch.initialize`),
    False when JAX's backends exist without it (it can no longer join: JAX
    refuses once they exist), None while neither happened. Reads JAX's
    module state without importing anything."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    started = bool(getattr(bridge, "_backends", None))   # read first: joining comes before
    state = getattr(sys.modules.get("jax._src.distributed"), "global_state", None)
    if getattr(state, "coordinator_address", None) is not None:   # kept after shutdown()
        return True
    return False if started else None


def coordinator_port_free(address: str) -> bool:
    """False when another program listens on ``address``'s port.

    ``jax.distributed``'s coordinator serves on every address (``[::]:port``)
    with ``SO_REUSEADDR``; binding the same way fails only where a socket
    listens on the port (the launcher's own reservation does not listen).
    """
    port = int(address.rsplit(":", 1)[1])
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue   # no IPv6 here
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return False
                continue
            return True
    return True


def _stdlib_dir() -> str:
    """The standard library's folder, with a trailing separator."""
    return os.path.dirname(os.__file__) + os.sep


def _jax_dirs() -> tuple[str, ...]:
    """The folders of the imported ``jax`` and ``jaxlib`` packages."""
    dirs = []
    for name in ("jax", "jaxlib"):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.append(os.path.dirname(path) + os.sep)
    return tuple(dirs)


def classify(frame: FrameType | None, jax_dirs: tuple[str, ...], stdlib: str
             ) -> tuple[Kind, FrameType | None]:
    """``("jax", that frame)`` when the innermost frame outside the standard
    library is in ``jax_dirs``, else ``("user", None)``."""
    while frame is not None:
        name = frame.f_code.co_filename
        if jax_dirs and name.startswith(jax_dirs):
            return "jax", frame
        in_stdlib = name.startswith("<frozen") or (
            name.startswith(stdlib) and "-packages" + os.sep not in name[len(stdlib):])
        if not in_stdlib:
            return "user", None
        frame = frame.f_back
    return "user", None


def _watch(main_ident: int) -> None:
    """Samples the main thread's stack and reports it until the pipe closes."""
    stdlib = _stdlib_dir()
    state: Kind | None = None
    state_start = 0.0
    call: tuple[FrameType, int] | None = None   # (frame, f_lasti) of one JAX call
    call_start, call_cpu = 0.0, 0.0
    while True:
        frame = sys._current_frames().get(main_ident)
        if frame is None:
            return
        kind, jax_frame = classify(frame, _jax_dirs(), stdlib)
        del frame
        now, cpu = time.monotonic(), time.process_time()
        if kind != state:
            state, state_start = kind, now
        # Holding the frame keeps its identity: a new call is a new frame object.
        key: tuple[FrameType, int] | None = (
            None if jax_frame is None else (jax_frame, jax_frame.f_lasti))
        if key is None or call is None or key[0] is not call[0] or key[1] != call[1]:
            call, call_start, call_cpu = key, now, cpu
        del jax_frame, key
        waited = None
        if call is not None and cpu - call_cpu <= IDLE_CPU_SHARE * (now - call_start) + \
                IDLE_CPU_SECONDS:
            waited = round(now - call_start, 2)
        if _final.is_set() or not report({"state": state, "for": round(now - state_start, 2),
                                           "wait": waited, "joined": joined()}):
            return
        _final.wait(SAMPLE_SECONDS)   # woken at once by the last report


def start_reports() -> None:
    """Starts the sampling thread when the launcher passed a report pipe."""
    global _status_fd
    fd = os.environ.pop(STATUS_FD, None)
    if fd is None:
        return
    _status_fd = int(fd)
    os.set_inheritable(_status_fd, False)
    os.set_blocking(_status_fd, False)
    threading.Thread(target=_watch, args=(threading.main_thread().ident,),
                     name=WATCH_THREAD, daemon=True).start()


def _fail(status: int, at: float, error: BaseException | None = None) -> None:
    """Reports how the script failed, then exits at once with ``status``."""
    _final.set()
    _flush()
    late = None if error is None else setup_timeout(error)
    timed_out = late is not None or (
        error is not None and is_collective_timeout(error)
        and float(os.environ.get(STALL_TIMEOUT) or 0) > 0)
    if timed_out:
        record: dict[str, Any] = {"state": "timeout", "t": at}
        if late is not None:
            record["late"] = late
        if report(record):
            # Process 0 holds the coordination service, whose end would take the
            # others down at once; the launcher first sees who else times out.
            _flush()
            time.sleep(TIMEOUT_LINGER_SECONDS)
    else:
        report({"state": "failed", "t": at, "status": status, "joined": joined(),
                "peer_lost": error is not None and is_peer_loss(error)})
    _die(status)


def _done() -> None:
    """Reports that the script returned (the last report)."""
    _final.set()
    report({"state": "done", "t": time.monotonic(), "joined": joined()})


def _finish() -> None:
    """Ends a process whose script returned: the sampling thread stopped and
    joined, then what interpreter shutdown does first (wait for the
    script's non-daemon threads, run the ``atexit``
    handlers, JAX's ``jax.distributed`` shutdown barrier among them, flush the
    streams), then exits 0 at once.

    The rest of interpreter shutdown is skipped on purpose: in it CPython
    (3.13 and older) ends daemon threads by ``pthread_exit`` when they next
    take the GIL, which aborts the process when the unwinding passes a C++
    ``catch (...)`` of an extension ("FATAL: exception not rethrown", status
    134) after its work is done (CPython issue 87135), and it destroys
    jaxlib's Gloo contexts while peers may still be closing theirs.
    """
    import atexit

    main = threading.main_thread()
    for t in threading.enumerate():
        if t is not main and (not t.daemon or t.name == WATCH_THREAD):
            t.join()
    atexit._run_exitfuncs()
    _die(0)


def check_port() -> None:
    """In process 0: reports ``port`` and exits 1 when the coordinator's port is taken."""
    address = os.environ.get(COORDINATOR)
    if os.environ.get(PROCESS_ID) != "0" or not address or coordinator_port_free(address):
        return
    print(f"the coordinator port {address} is taken by another program", file=sys.stderr)
    _final.set()
    report({"state": "port", "t": time.monotonic()})
    _die(1)


def run(argv: list[str]) -> None:
    """Runs ``argv[0]`` with arguments ``argv[1:]``; exits at once if it fails."""
    script = argv[0]
    sys.argv = list(argv)
    # The script's folder first on the import path, as `python script.py` puts
    # it: the interpreter put this file's folder there, and runpy.run_path
    # adds a path only when it is a folder or a zip file.
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        status = _status(e.code)
        if status != 0:
            _fail(status, time.monotonic())
    except BaseException as e:
        at = time.monotonic()
        traceback.print_exc()
        _fail(1, at, e)
    _done()
    _finish()


if __name__ == "__main__":
    die_with_launcher()
    # The launcher blocks these while it starts workers; the mask is inherited.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    start_reports()
    check_port()
    run(sys.argv[1:])
