"""Executes the notebooks with nbclient and writes them back with their outputs.

Usage::

    python notebooks/run.py            # every notebook, full mode, in place
    python notebooks/run.py --quick    # small sizes (QCOLLECT_NOTEBOOK_QUICK=1)
    python notebooks/run.py quantizers ring_allreduce.ipynb

Full mode is how the committed outputs are produced. The kernel is
``python3``, started in this folder, with ``QCOLLECT_NOTEBOOK_QUICK`` set to
``1`` in quick mode and removed otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
QUICK_ENV = "QCOLLECT_NOTEBOOK_QUICK"
CELL_TIMEOUT_S = 1800


def notebooks() -> list[Path]:
    """Every notebook in this folder, sorted by name."""
    return sorted(HERE.glob("*.ipynb"))


def execute(path, quick: bool, write_to=None) -> nbformat.NotebookNode:
    """Runs the notebook at ``path`` top to bottom and returns it with outputs.

    Args:
      path: the ``.ipynb`` file.
      quick: set ``QCOLLECT_NOTEBOOK_QUICK=1`` for the kernel (small sizes).
      write_to: where to write the executed notebook; None leaves every file
        untouched (pass ``path`` to update it in place).

    Returns:
      The executed notebook.

    Raises:
      nbclient.exceptions.CellExecutionError: a cell raised.
    """
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    saved = os.environ.get(QUICK_ENV)
    if quick:
        os.environ[QUICK_ENV] = "1"
    else:
        os.environ.pop(QUICK_ENV, None)
    try:
        client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                resources={"metadata": {"path": str(HERE)}})
        client.execute()
    finally:
        if saved is None:
            os.environ.pop(QUICK_ENV, None)
        else:
            os.environ[QUICK_ENV] = saved
    if write_to is not None:
        nbformat.write(nb, write_to)
    return nb


def _resolve(name: str) -> Path:
    path = HERE / (name if name.endswith(".ipynb") else name + ".ipynb")
    if not path.exists():
        raise SystemExit(f"no notebook {path.name} in {HERE}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes ({QUICK_ENV}=1); not for committed outputs")
    parser.add_argument("names", nargs="*", help="notebooks to run (default: all)")
    args = parser.parse_args(argv)
    paths = [_resolve(n) for n in args.names] if args.names else notebooks()
    for path in paths:
        start = time.perf_counter()
        execute(path, args.quick, write_to=path)
        print(f"{path.name}: {time.perf_counter() - start:.1f} s "
              f"({'quick' if args.quick else 'full'} mode)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
