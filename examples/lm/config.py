"""Defaults of the language-model example: five compressors in about 20 minutes on 2 cores."""

from __future__ import annotations

import dataclasses
import math

from common.config import TrainConfig, flag


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """`TrainConfig` plus the transformer's shape, AdamW's schedule, the corpus and DiLoCo.

    Default: a 4 x 128 GPT (4 heads, 128-byte context, tied embeddings,
    842,496 parameters), 8 windows per device, 600 steps of AdamW at
    3e-3 (30 warm-up steps, cosine decay to a tenth, weight decay 0.1 on the
    matrices, gradients clipped at global norm 1 after the all-reduce),
    evaluated every 30 steps on 256 validation windows. On 4 simulated
    devices of a 2-core CPU a step takes about 0.32 s with any of the five
    default compressors, a run about 4 minutes.

    The model is `lm.model.GPT`; the link rate only adds the table's wire
    floor (``8 * wire bytes / rate``: no step's all-reduce is faster on that
    link). ``diloco_every`` H > 0 adds a DiLoCo run (`common.diloco`,
    `transforms.diloco`) per name of ``outer_compressor`` after the
    synchronous runs of ``compressors`` (which may then be empty).
    """

    compressors: tuple[str, ...] = ("none", "qsgd-4", "onebit", "powersgd", "gradiveq")
    optimizer: str = "adamw"
    learning_rate: float = flag(
        3e-3, "the optimizer's peak step size: linear warm-up from 0, cosine decay to a tenth "
              "at the last step (finite, > 0)")
    batch_size: int = flag(
        8, "text windows (context + 1 bytes each) per device per step; the global batch is "
           "this times the data-parallel devices")
    steps: int = flag(
        600, "training steps per run (0: one pass over the training text, in windows of "
             "context bytes)")
    eval_every: int = 30
    width: int = flag(128, "the model's width: values per byte's embedding")
    depth: int = flag(4, "transformer blocks")
    heads: int = flag(4, "attention heads per block (a divisor of --width)")
    context: int = flag(128, "bytes per training window (the model's context)")
    tie_embeddings: bool = flag(
        True, "true: the output head is the token embedding, transposed; false: a separate "
              "head")
    warmup_steps: int = flag(30, "steps of linear learning-rate warm-up from 0")
    weight_decay: float = flag(
        0.1, "AdamW's decoupled weight decay, on the matrices only (a factor per unit "
             "learning rate, >= 0)")
    clip_norm: float = flag(
        1.0, "the averaged gradient is clipped to this global L2 norm (> 0)")
    val_windows: int = flag(
        256, "validation windows of context + 1 bytes, evenly spaced over the validation "
             "text")
    corpus_dir: str = flag(
        "", "folder whose .py files are the corpus (empty: this Python's standard library)")
    link_mbit: float = flag(
        0.0, "each process's link rate in Mbit/s, for the table's wire floor (8 x wire bytes "
             "/ rate, in seconds per step); 0: no such column")
    diloco_every: int = flag(
        0, "DiLoCo's H: inner steps per worker between outer steps; above 0 adds a DiLoCo run "
           "per --outer-compressor after the synchronous runs (0: none)")
    outer_compressor: tuple[str, ...] = flag(
        ("none",), "the outer gradients' all-reduce of each DiLoCo run, comma-separated: "
                   "none (exact float32), bf16, onebit, qsgd-2, qsgd-4, qsgd-8, threshold, "
                   "adaptive")
    fragments: int = flag(
        1, "Streaming DiLoCo's fragments F, synchronised in turn (one every H / F steps)")
    diloco_delay: int = flag(
        0, "Streaming DiLoCo's tau: inner steps between a fragment's exchange and its "
           "application (mixed half and half with the local values)")
    outer_lr: float = flag(0.7, "the outer SGD's step size (the paper's 0.7)")
    outer_momentum: float = flag(
        0.9, "the outer SGD's Nesterov momentum, in [0, 1) (the paper's 0.9; 0: plain SGD)")
    diloco_sync_first: int = flag(
        0, "synchronous data-parallel steps (an exact all-reduce each) before DiLoCo's first "
           "round, as the papers start from a pretrained model")

    @property
    def extra_runs(self) -> tuple[str, ...]:
        """The DiLoCo runs' outer compressors (none without ``diloco_every``)."""
        return self.outer_compressor if self.diloco_every else ()

    def __post_init__(self):
        super().__post_init__()
        self._check_diloco()
        if self.link_mbit < 0:
            raise ValueError(f"link_mbit must be >= 0, got {self.link_mbit!r}")
        for name in ("width", "depth", "heads", "context", "val_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.width % self.heads:
            raise ValueError(f"width must be a multiple of heads, got {self.width} and "
                             f"{self.heads}")
        if (self.warmup_steps < 0 or not 0 <= self.weight_decay < math.inf
                or not 0 < self.clip_norm < math.inf):
            raise ValueError(f"warmup_steps and weight_decay must be >= 0 and clip_norm > 0 "
                             f"(finite), "
                             f"got {self.warmup_steps}, {self.weight_decay}, {self.clip_norm}")

    def _check_diloco(self) -> None:
        if self.diloco_every < 0:
            raise ValueError(f"diloco_every must be >= 0, got {self.diloco_every!r}")
        if not self.diloco_every:
            return
        from common.diloco import OUTER_COMPRESSORS

        unknown = [n for n in self.outer_compressor if n not in OUTER_COMPRESSORS]
        if unknown or not self.outer_compressor:
            raise ValueError(f"outer_compressor must be names from {', '.join(OUTER_COMPRESSORS)}"
                             f", got {unknown or self.outer_compressor}")
        if not 1 <= self.fragments <= self.diloco_every:
            raise ValueError(f"fragments must be in [1, diloco_every], got {self.fragments}")
        if self.diloco_delay and not 0 < self.diloco_delay < self.diloco_every // self.fragments:
            raise ValueError(f"diloco_delay must be in [0, diloco_every // fragments), got "
                             f"{self.diloco_delay}")
        if not 0 <= self.diloco_sync_first < self.steps:
            raise ValueError(f"diloco_sync_first must be in [0, steps), got "
                             f"{self.diloco_sync_first}")
        if not 0 < self.outer_lr < math.inf or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_lr must be finite and > 0 and outer_momentum in [0, 1), got "
                             f"{self.outer_lr} and {self.outer_momentum}")
        if (tuple(self.mesh) != ("data",) or self.parallel != "replicated"
                or self.model_parallel > 1 or self.checkpoint_dir or self.compress_after):
            raise ValueError("diloco_every needs mesh 'data', parallel 'replicated' and "
                             "model_parallel 1, and does not take checkpoint_dir or "
                             "compress_after")
