"""Runs one worker's script as ``__main__``, as ``python script.py args`` would.

Started by the launcher as ``python _worker.py script.py args`` (standard
library only, so nothing is imported before the script). The difference from
running the script directly: when it fails (an uncaught exception or
``sys.exit`` with a non-zero status) the process ends at once with that status,
skipping interpreter shutdown. JAX's exit handler would otherwise wait in the
``jax.distributed`` shutdown barrier for the other processes, which may be
blocked in a collective with this one, so a failed process would never exit
and the launcher could not notice it.
"""

import os
import runpy
import sys
import traceback


def _status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _die(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


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
    except BaseException:
        traceback.print_exc()
        _die(1)


if __name__ == "__main__":
    run(sys.argv[1:])
