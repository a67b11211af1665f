"""Train a small CNN on MNIST data-parallel; GradiVeQ, QSGD and PowerSGD on the conv kernels.

    python examples/mnist_cnn/main.py                        # defaults
    python examples/mnist_cnn/main.py --compressors none,gradiveq --epochs 2
    python examples/mnist_cnn/main.py --checkpoint-dir ckpt --checkpoint-every 100
    python examples/mnist_cnn/main.py --checkpoint-dir ckpt --resume true  # continue
    python examples/mnist_cnn/main.py --help

Same output as the MLP example: a progress bar per run, the table, and
``mnist_cnn.{md,json,png}`` in ``--output-dir``.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices()

from common.config import parse_config  # noqa: E402
from common.experiment import run  # noqa: E402

from mnist_cnn.config import Config  # noqa: E402
from mnist_cnn.model import build  # noqa: E402


def main(argv=None):
    cfg = parse_config(Config, argv, description=__doc__.splitlines()[0])
    return run(cfg, build, (28, 28, 1), "mnist_cnn", f"MNIST CNN ({cfg.channels} channels)")


if __name__ == "__main__":
    main()
