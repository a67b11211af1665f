"""The device benchmark's language-model part, run as a program of the checkout.

The model's step is Flax and optax code of the examples, which `qcollect`
never imports: `lm_part` runs ``examples/lm/step_time.py`` as a subprocess
(``sys.executable PROGRAM --out FILE ...``), found by its path in the
examples folder (`qcollect.bench.training.examples_dir`), passes it the
setting and what is left of the time budget, forwards its progress lines
and reads the JSON it writes. Without the folder the part is skipped and
says so.

The program runs on the device the benchmark measures while the
benchmark's own process holds its device memory, so it allocates as it
goes (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, unless the environment sets
it) instead of reserving most of a GPU's memory as JAX does by default.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from qcollect.bench._device_report import STEP_OVERHEAD_TARGET
from qcollect.bench.device_timing import Clock, Say
from qcollect.bench.training import examples_dir

#: The program, relative to the examples folder.
PROGRAM = ("lm", "step_time.py")
#: The model's settings the program takes as flags of the same names.
MODEL = ("width", "depth", "heads", "context", "batch")


def program() -> pathlib.Path:
    """The checkout's ``examples/lm/step_time.py``.

    Raises:
      FileNotFoundError: no examples folder, or one without the program;
        the message starts with "no examples folder".
    """
    try:
        folder = examples_dir()
    except FileNotFoundError as err:
        raise FileNotFoundError(f"no examples folder: {err}") from err
    path = folder.joinpath(*PROGRAM)
    if not path.is_file():
        raise FileNotFoundError(f"no examples folder with {'/'.join(PROGRAM)}: {path} is missing")
    return path


def lm_names() -> list[str]:
    """The all-reduces the program can time (its ``--list``: ``none``,
    ``local`` and each one-compressor name of the examples), or ``[]``
    without the examples folder."""
    try:
        path = program()
    except FileNotFoundError:
        return []
    listed = subprocess.run([sys.executable, str(path), "--list"], capture_output=True,
                            text=True, check=True)
    return [str(name) for name in json.loads(listed.stdout)]


def _streamed(command: list[str], say: Say) -> int:
    """Runs ``command``, each line it prints passed to ``say``; its exit status."""
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip():
                say(line.rstrip())
    return proc.returncode


def lm_part(setting: dict[str, int], names: Sequence[str], clock: Clock, say: Say, *,
            repeats: int, calls: int, profile_top: int) -> dict[str, Any]:
    """The language model's rows (``rows``, ``not_measured``, ``profiles``
    as ``examples/lm/step_time.py`` writes them) beside ``setting`` (the
    model: `MODEL`), or ``skipped`` and why: no examples folder, the time
    budget, the program's failure."""
    try:
        path = program()
    except FileNotFoundError as err:
        return {"setting": setting, "rows": [], "skipped": str(err)}
    if clock.out():
        return {"setting": setting, "rows": [], "skipped": clock.why()}
    with tempfile.TemporaryDirectory() as folder:
        out = pathlib.Path(folder) / "steps.json"
        command = [sys.executable, str(path), "--out", str(out), "--lm", ",".join(names),
                   *(f for k in MODEL for f in (f"--{k}", str(setting[k]))),
                   "--repeats", str(repeats), "--calls", str(calls),
                   "--profile-top", str(profile_top),
                   "--profile-over", repr(STEP_OVERHEAD_TARGET),
                   "--budget", repr(clock.budget), "--spent", repr(clock.elapsed())]
        status = _streamed(command, say)
        result = (json.loads(out.read_text()) if out.is_file() else
                  {"error": f"{'/'.join(PROGRAM)} exited with status {status} without "
                            "writing its rows"})
    if "error" in result:
        return {"setting": setting, "rows": [], "skipped": f"failed: {result['error']}"}
    return {"setting": setting, **result}
