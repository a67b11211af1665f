"""Defaults of the language-model example: five compressors in about 20 minutes on 2 cores."""

from __future__ import annotations

import dataclasses
import math

from common.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """`TrainConfig` plus the transformer's shape, AdamW's schedule and the evaluation.

    Default: a 4 x 128 GPT (4 heads, 128-byte context, tied embeddings,
    842,496 parameters), 8 windows per device, 600 steps of AdamW at
    3e-3 (30 warm-up steps, cosine decay to a tenth, weight decay 0.1 on the
    matrices, gradients clipped at global norm 1 after the all-reduce),
    evaluated every 30 steps on 256 validation windows. On 4 simulated
    devices of a 2-core CPU a step takes about 0.32 s with any of the five
    default compressors, a run about 4 minutes.

    Attributes:
      width / depth / heads / context: the model (`lm.model.GPT`).
      tie_embeddings: the output head is the token embedding (transposed).
      warmup_steps: linear warm-up of the learning rate from 0.
      weight_decay: AdamW's decoupled weight decay (matrices only).
      clip_norm: the averaged gradient's global norm is clipped to this.
      val_windows: validation windows of ``context + 1`` bytes.
      corpus_dir: ``.py`` files to train on instead of this Python's
        standard library ("" : the standard library).
      link_mbit: the rate of each process's link in Mbit/s, for the table's
        wire floor (``8 * wire bytes / rate``: no step's all-reduce is
        faster on that link); 0: no such column.
      diloco_every: H > 0 adds a DiLoCo run (`common.diloco`,
        `transforms.diloco`) per name of ``outer_compressor``, after the
        synchronous runs of ``compressors`` (which may then be empty): H
        inner AdamW steps per worker, then an outer step.
      outer_compressor: the outer gradients' all-reduce of each DiLoCo run
        (`common.diloco.OUTER_COMPRESSORS`; ``none``: exact float32).
      fragments: Streaming DiLoCo's fragments F, synchronised in turn.
      diloco_delay: inner steps between a fragment's exchange and its
        application (tau, mixed half and half with the local values).
      outer_lr / outer_momentum: the outer SGD's step and Nesterov momentum
        (the paper's 0.7 and 0.9; momentum 0: plain SGD).
      diloco_sync_first: synchronous data-parallel steps (exact mean, a
        full all-reduce each) before the first round: the papers start
        DiLoCo from a synchronously pretrained model.
    """

    compressors: tuple[str, ...] = ("none", "qsgd-4", "onebit", "powersgd", "gradiveq")
    optimizer: str = "adamw"
    learning_rate: float = 3e-3
    batch_size: int = 8
    steps: int = 600
    eval_every: int = 30
    width: int = 128
    depth: int = 4
    heads: int = 4
    context: int = 128
    tie_embeddings: bool = True
    warmup_steps: int = 30
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    val_windows: int = 256
    corpus_dir: str = ""
    link_mbit: float = 0.0
    diloco_every: int = 0
    outer_compressor: tuple[str, ...] = ("none",)
    fragments: int = 1
    diloco_delay: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    diloco_sync_first: int = 0

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
        for name in ("train_examples", "test_examples", "data_dir"):
            if getattr(self, name):
                raise ValueError(f"{name} is an MNIST setting; the language model trains on "
                                 "windows of its corpus (--corpus-dir, --val-windows)")

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
