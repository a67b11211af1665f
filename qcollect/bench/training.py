"""The training gate: real models trained with every compressor, verdict per row.

``python -m qcollect.bench training`` trains the MNIST MLP at width 2048
(depth 3, 300 steps) and the small CNN of ``examples/`` (1200 steps) on 4
simulated CPU devices (``QCOLLECT_DEVICES``), once per compressor of the
examples (``none``, ``bf16``, ``onebit``, ``onebit-column``, ``threshold``,
``adaptive``, ``qsgd-2``, ``qsgd-4``, ``qsgd-8``, ``entropy``,
``powersgd``, ``gradiveq``), every run from the same initialisation and
with the same batches. Per (model, compressor) it measures whether every
step's loss was finite, the final loss (mean of the last 10% of the steps,
at least 10) and test accuracy against the uncompressed run ``none``, the
median step time against ``none``'s in the same run and against that ratio
in a stored baseline, and the wire bytes per step and device. A row passes
when its final loss is at most 1.1 times ``none``'s; above that, ``threshold``
and ``entropy`` are only reported, a row whose baseline missed the target
too is a known ``gap`` while it is no more than 1.1 times the baseline's
ratio, and every other row fails, as does any non-finite loss. A step-time
ratio more than 1.25 times the baseline's is flagged ``slower`` (a failure
with ``--fail-on-time``). The exit status is 1 when a row fails.

    python -m qcollect.bench training                          # the full gate
    python -m qcollect.bench training --out examples/results   # ... and the new baseline
    python -m qcollect.bench training --quick                  # the test suite's preset
    python -m qcollect.bench training --help

The gate trains Flax models with optax, which `qcollect` itself never
imports: it lives in ``examples/training_gate.py`` of a repository checkout,
and this module only finds that folder beside the installed package and
runs it.
"""

from __future__ import annotations

import pathlib
import sys

GATE = "training_gate.py"


def examples_dir() -> pathlib.Path:
    """The ``examples/`` folder of the checkout this package runs from.

    Raises:
      FileNotFoundError: ``qcollect`` is not installed from a checkout (the
        folder or its ``training_gate.py`` is missing).

    Example:
      >>> (examples_dir() / GATE).is_file()  # doctest: +SKIP
      True
    """
    folder = pathlib.Path(__file__).resolve().parents[2] / "examples"
    if not (folder / GATE).is_file():
        raise FileNotFoundError(
            f"the training gate needs the repository's examples/ folder ({folder / GATE} is "
            "missing): run it from a repository checkout installed with "
            "`pip install -e \".[examples]\"`")
    return folder


def main(argv: list[str] | None = None) -> int:
    """Runs ``examples/training_gate.py`` with ``argv``; its exit status (2: no checkout)."""
    try:
        folder = examples_dir()
    except FileNotFoundError as err:
        print(f"python -m qcollect.bench training: {err}", file=sys.stderr)
        return 2
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    import training_gate  # sets the simulated CPU devices before JAX starts

    return training_gate.main(argv)


if __name__ == "__main__":
    sys.exit(main())
