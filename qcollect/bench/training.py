"""The training gate, a checkout command: real models trained with every compressor.

``python -m qcollect.bench training`` trains the MNIST MLP at width 2048 and
the small CNN of ``examples/`` on simulated CPU devices, once per compressor
of the examples, every run from the same initialisation and on the same
batches, and gives a verdict per (model, compressor) row: whether every
step's loss was finite, the final loss and test accuracy against the
uncompressed run ``none``, the step time against ``none``'s and against a
stored baseline, and the wire bytes. The exit status is 1 when a row fails.
What it trains and how each row is judged: docs/benchmarks.md, "The training
gate".

    python -m qcollect.bench training                          # the full gate
    python -m qcollect.bench training --out examples/results   # ... and the new baseline
    python -m qcollect.bench training --quick                  # the test suite's preset
    python -m qcollect.bench training --help

It is a command of a repository checkout, not of the installed package: the
gate trains Flax models with optax, which `qcollect` itself never imports,
so its code lives in ``examples/training_gate.py`` of the checkout, and this
module only finds that folder and runs the program as a subprocess
(``sys.executable examples/training_gate.py ARGS``; nothing of the examples
is imported here). The folder is

1. the one ``$QCOLLECT_EXAMPLES`` names, when it is set (a package installed
   without ``-e``, used beside a checkout); else
2. ``examples/`` beside the package's own folder: the checkout's, when the
   package is installed from it in editable mode (``pip install -e
   ".[examples]"``).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

GATE = "training_gate.py"
#: The environment variable naming the ``examples/`` folder of a checkout.
EXAMPLES_ENV = "QCOLLECT_EXAMPLES"
#: What ``--help`` says before the gate's own options.
CHECKOUT_NOTE = (
    "python -m qcollect.bench training is a checkout command: it runs\n"
    f"examples/{GATE} of the repository checkout qcollect is installed from\n"
    "(pip install -e \".[examples]\"), or of the examples/ folder that\n"
    f"${EXAMPLES_ENV} names.\n")


def examples_dir() -> pathlib.Path:
    """The ``examples/`` folder whose training gate runs.

    ``$QCOLLECT_EXAMPLES`` when set, else the ``examples/`` folder beside the
    package's own folder (the checkout's, in an editable install).

    Raises:
      FileNotFoundError: the folder or its ``training_gate.py`` is missing;
        the message says how to provide one (an editable install of a
        checkout, or ``$QCOLLECT_EXAMPLES``).

    Example:
      >>> (examples_dir() / GATE).is_file()  # doctest: +SKIP
      True
    """
    named = os.environ.get(EXAMPLES_ENV)
    if named:
        folder = pathlib.Path(named).expanduser().resolve()
        if not (folder / GATE).is_file():
            raise FileNotFoundError(
                f"{EXAMPLES_ENV}={named} names {folder}, which has no {GATE}: set it to the "
                "examples/ folder of a repository checkout, or unset it and install the "
                "checkout with `pip install -e \".[examples]\"`")
        return folder
    folder = pathlib.Path(__file__).resolve().parents[2] / "examples"
    if not (folder / GATE).is_file():
        raise FileNotFoundError(
            f"the training gate needs the repository's examples/ folder ({folder / GATE} is "
            "missing): run it from a repository checkout installed with "
            "`pip install -e \".[examples]\"`, or set "
            f"{EXAMPLES_ENV} to the examples/ folder of a checkout")
    return folder


def main(argv: list[str] | None = None) -> int:
    """Runs ``examples/training_gate.py`` with ``argv`` as a subprocess; its
    exit status (2: no checkout).

    With ``-h`` or ``--help`` it first says that this is a checkout command,
    then the gate prints its options.
    """
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(CHECKOUT_NOTE, flush=True)
    try:
        folder = examples_dir()
    except FileNotFoundError as err:
        print(f"python -m qcollect.bench training: {err}", file=sys.stderr)
        return 2
    # Its own process: the gate sets the simulated CPU devices before JAX starts.
    return subprocess.run([sys.executable, str(folder / GATE), *args], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
