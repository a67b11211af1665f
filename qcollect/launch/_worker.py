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
  (`qcollect.launch._stall`) reads these reports.
"""

import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback

# The same names as in `qcollect.launch._env` (this file imports nothing of qcollect).
LAUNCHER_PID = "QCOLLECT_LAUNCHER_PID"
STATUS_FD = "QCOLLECT_STATUS_FD"
STALL_TIMEOUT = "QCOLLECT_STALL_TIMEOUT"
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

_status_fd = None
_final = threading.Event()   # set once the last report is out: sampling stops


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


def _status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _die(status: int) -> None:
    _flush()
    os._exit(status)


def report(record: dict) -> bool:
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


def is_collective_timeout(error: BaseException) -> bool:
    """True when ``error`` (or what caused it) is a Gloo collective that timed out."""
    seen = 0
    while error is not None and seen < 8:
        text = str(error)
        if "Gloo" in text and "Timed out" in text:
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _stdlib_dir() -> str:
    return os.path.dirname(os.__file__) + os.sep


def _jax_dirs() -> tuple:
    dirs = []
    for name in ("jax", "jaxlib"):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.append(os.path.dirname(path) + os.sep)
    return tuple(dirs)


def classify(frame, jax_dirs: tuple, stdlib: str):
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
    state, state_start = None, 0.0
    call, call_start, call_cpu = None, 0.0, 0.0   # (frame, f_lasti) of one JAX call
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
        key = None if jax_frame is None else (jax_frame, jax_frame.f_lasti)
        if key is None or call is None or key[0] is not call[0] or key[1] != call[1]:
            call, call_start, call_cpu = key, now, cpu
        del jax_frame, key
        waited = None
        if call is not None and cpu - call_cpu <= IDLE_CPU_SHARE * (now - call_start) + \
                IDLE_CPU_SECONDS:
            waited = round(now - call_start, 2)
        if _final.is_set() or not report({"state": state, "for": round(now - state_start, 2),
                                           "wait": waited}):
            return
        time.sleep(SAMPLE_SECONDS)


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
                     name="qcollect-launch-watch", daemon=True).start()


def run(argv) -> None:
    """Runs ``argv[0]`` with arguments ``argv[1:]``; exits at once if it fails."""
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        status = _status(e.code)
        if status != 0:
            _die(status)
        raise
    except BaseException as e:
        traceback.print_exc()
        _final.set()
        if (is_collective_timeout(e) and float(os.environ.get(STALL_TIMEOUT) or 0) > 0
                and report({"state": "timeout"})):
            # Process 0 holds the coordination service, whose end would take the
            # others down at once; the launcher first sees who else times out.
            _flush()
            time.sleep(TIMEOUT_LINGER_SECONDS)
        _die(1)


if __name__ == "__main__":
    die_with_launcher()
    # The launcher blocks these while it starts workers; the mask is inherited.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    start_reports()
    run(sys.argv[1:])
