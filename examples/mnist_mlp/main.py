"""Train Dryden et al.'s MNIST MLP data-parallel with compressed gradient all-reduce.

    python examples/mnist_mlp/main.py                       # defaults: a few minutes on CPU
    python examples/mnist_mlp/main.py --compressors all --epochs 3
    python examples/mnist_mlp/main.py --checkpoint-dir ckpt  # orbax, once per epoch
    python examples/mnist_mlp/main.py --checkpoint-dir ckpt --resume true  # continue
    python examples/mnist_mlp/main.py --mesh node,local     # 2 nodes: hierarchical
    python examples/mnist_mlp/main.py --help

On a CPU machine the devices are simulated (8 by default; set
``QCOLLECT_DEVICES`` to change). Prints a table per compressor (test
accuracy, wire bytes per step, ratio to ``lax.pmean``, median step time) and
writes ``mnist_mlp.{md,json,png}`` to ``--output-dir``.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices()

from common.config import parse_config  # noqa: E402
from common.experiment import run  # noqa: E402

from mnist_mlp.config import Config  # noqa: E402
from mnist_mlp.model import build  # noqa: E402


def main(argv=None):
    cfg = parse_config(Config, argv, description=__doc__.splitlines()[0])
    return run(cfg, build, (784,), "mnist_mlp", f"MNIST MLP {cfg.depth}x{cfg.width}")


if __name__ == "__main__":
    main()
