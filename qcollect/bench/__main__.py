"""``python -m qcollect.bench BENCHMARK [options]``: runs one benchmark module's ``main``."""

from __future__ import annotations

import importlib
import sys

#: Benchmark name -> the module whose ``main(argv)`` runs it.
BENCHMARKS = {
    "quantizers": "qcollect.bench.quantizers",
    "collectives": "qcollect.bench.collectives",
    "network": "qcollect.bench.network",
    "structure": "qcollect.bench.structure",
    "compile": "qcollect.bench.compile",
    "training": "qcollect.bench.training",
    "passes": "qcollect.bench.passes",
    "device": "qcollect.bench.device",
}


def main(argv: list[str] | None = None) -> int:
    """Runs ``argv[0]``'s benchmark with the rest of ``argv``; 2 for an unknown name."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m qcollect.bench {{{','.join(BENCHMARKS)}}} [options]",
              file=sys.stderr)
        return 2
    status: int = importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])
    return status


if __name__ == "__main__":
    sys.exit(main())
