"""Accuracy parity: the shape of Dryden et al.'s Table 1 and GradiVeQ's comparison.

Dryden et al. (section 4.4, Table 1) train one MNIST MLP for 20 epochs with
normal, one-bit, threshold and adaptive all-reduce and compare test
accuracy. This script does the same on this machine, with the same model,
epochs, seed and data order for every compressor, plus QSGD and the entropy
quantizer (floor c = 4: one bit below the paper's c = 5, aiming at about
4 bits per value after Huffman coding); then GradiVeQ's comparison (section
4: uncompressed, 4-bit QSGD, GradiVeQ at 8x) on the small CNN. It prints and writes
``{output_dir}/parity.md`` (tables, targets, run length and time) and the
two examples' JSON records and plots.

    python examples/accuracy_parity.py                   # 3 + 3 epochs, ~30 min on 2 cores
    python examples/accuracy_parity.py --mlp-epochs 1 --cnn-epochs 1   # a quick look

Targets: onebit (buckets and columns), adaptive, qsgd-4 and qsgd-8 within 0.3
percentage points of uncompressed; gradiveq within 1 point of uncompressed on
the CNN at >= 8x compression on its kernels; threshold reported as it is
(Dryden: it lags); entropy at <= 4.5 bits per value on the wire within 0.3
points.
"""

import argparse
import dataclasses
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(default=4)  # Dryden et al.: four model replicas

from common import report  # noqa: E402
from common.experiment import run  # noqa: E402
from common.mnist import load_mnist  # noqa: E402
from mnist_cnn import config as cnn_config  # noqa: E402
from mnist_cnn import model as cnn_model  # noqa: E402
from mnist_mlp import config as mlp_config  # noqa: E402
from mnist_mlp import model as mlp_model  # noqa: E402

MLP_COMPRESSORS = ("none", "onebit", "onebit-column", "threshold", "adaptive", "qsgd-4", "qsgd-8",
                   "entropy-4")
ENTROPY_BITS, ENTROPY_PP = 4.5, 0.3
CNN_COMPRESSORS = ("none", "qsgd-4", "gradiveq")
WITHIN_PP = {"onebit": 0.3, "onebit-column": 0.3, "adaptive": 0.3, "qsgd-4": 0.3, "qsgd-8": 0.3}


def _row(r, base, base_bytes):
    x = report.ratio(r, base_bytes)
    delta = 100 * (r.final_accuracy - base.final_accuracy)
    return (f"| {r.name} | {100 * r.final_accuracy:.2f} | {delta:+.2f} | {r.wire_bytes:,} "
            f"| {x:.1f}x | {32 / x:.2f} |")


def _table(results):
    base = results[0]
    rows = ["| compressor | test accuracy (%) | vs none (pp) | wire bytes / step / device "
            "| vs pmean | bits / value |", "|---|---|---|---|---|---|"]
    rows += [_row(r, base, base.wire_bytes) for r in results]
    return "\n".join(rows)


def _checks(mlp, cnn):
    """(target, measured, met) lines."""
    out = []
    base = mlp[0].final_accuracy
    for r in mlp:
        if r.name in WITHIN_PP:
            gap = 100 * (base - r.final_accuracy)
            out.append((f"MLP {r.name} within {WITHIN_PP[r.name]} pp of none",
                        f"{-gap:+.2f} pp", gap <= WITHIN_PP[r.name]))
        if r.name.startswith("entropy"):
            bits = 32 / report.ratio(r, mlp[0].wire_bytes)
            gap = 100 * (base - r.final_accuracy)
            out.append((f"MLP {r.name} <= {ENTROPY_BITS} bits per value on the wire "
                        f"within {ENTROPY_PP} pp", f"{bits:.2f} bits, {-gap:+.2f} pp",
                        bits <= ENTROPY_BITS and gap <= ENTROPY_PP))
        if r.name == "threshold":
            out.append(("MLP threshold (reported, Dryden: lags)",
                        f"{100 * (r.final_accuracy - base):+.2f} pp", None))
    for r in cnn[1:]:
        if r.name == "gradiveq":
            gap = 100 * (cnn[0].final_accuracy - r.final_accuracy)
            x = report.ratio(r, cnn[0].wire_bytes)
            out.append(("CNN gradiveq within 1 pt of none at >= 8x on its kernels",
                        f"{-gap:+.2f} pp at {x:.1f}x of all bytes", gap <= 1.0))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mlp-epochs", type=float, default=3.0)
    parser.add_argument("--cnn-epochs", type=float, default=3.0)
    parser.add_argument("--mlp-width", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32, help="per device")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-examples", type=int, default=0)
    parser.add_argument("--output-dir", default="parity")
    parser.add_argument("--progress", default="true")
    args = parser.parse_args(argv)
    progress = args.progress.lower() in ("true", "1", "yes")
    common = dict(batch_size=args.batch_size, seed=args.seed, output_dir=args.output_dir,
                  train_examples=args.train_examples, progress=progress)
    data = load_mnist()
    start = time.perf_counter()
    mlp_cfg = mlp_config.Config(compressors=MLP_COMPRESSORS, epochs=args.mlp_epochs,
                                width=args.mlp_width, **common)
    mlp = run(mlp_cfg, mlp_model.build, (784,), "parity_mlp",
              f"MNIST MLP 3x{args.mlp_width}, {args.mlp_epochs:g} epochs", data=data)
    mlp_seconds = time.perf_counter() - start
    cnn_cfg = cnn_config.Config(compressors=CNN_COMPRESSORS, epochs=args.cnn_epochs, **common)
    cnn = run(cnn_cfg, cnn_model.build, (28, 28, 1), "parity_cnn",
              f"MNIST CNN, {args.cnn_epochs:g} epochs", data=data)
    total = time.perf_counter() - start

    import jax

    lines = [f"Devices: {jax.device_count()} ({jax.devices()[0].platform}), "
             f"{os.cpu_count()} CPU cores. Global batch {args.batch_size * jax.device_count()}.",
             "", f"MLP (3 x {args.mlp_width}, AdaGrad {mlp_cfg.learning_rate}), "
             f"{args.mlp_epochs:g} epochs = {len(mlp[0].losses)} steps per compressor, "
             f"{mlp_seconds / 60:.1f} min in all:", "", _table(mlp), "",
             f"CNN ({cnn_cfg.channels} channels, SGD momentum {cnn_cfg.learning_rate}), "
             f"{args.cnn_epochs:g} epochs = {len(cnn[0].losses)} steps per compressor, "
             f"{(total - mlp_seconds) / 60:.1f} min in all:", "", _table(cnn), "",
             "| target | measured | met |", "|---|---|---|"]
    for target, measured, met in _checks(mlp, cnn):
        verdict = "-" if met is None else "yes" if met else "NO"
        lines.append(f"| {target} | {measured} | {verdict} |")
    lines += ["", f"Total {total / 60:.1f} min. Settings: "
              + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(mlp_cfg).items()
                          if k not in ("compressors", "output_dir", "progress"))]
    text = "\n".join(lines)
    out = pathlib.Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parity.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
