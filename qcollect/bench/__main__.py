"""``python -m qcollect.bench BENCHMARK [options]``."""

import sys

BENCHMARKS = {
    "quantizers": "qcollect.bench.quantizers",
    "collectives": "qcollect.bench.collectives",
    "network": "qcollect.bench.network",
    "structure": "qcollect.bench.structure",
    "compile": "qcollect.bench.compile",
    "training": "qcollect.bench.training",
    "passes": "qcollect.bench.passes",
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m qcollect.bench {{{','.join(BENCHMARKS)}}} [options]",
              file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
