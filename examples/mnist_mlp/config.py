"""Defaults of the MLP example: finish in a few minutes on a 2-core CPU."""

from __future__ import annotations

import dataclasses

from common.config import MNISTConfig, flag


@dataclasses.dataclass(frozen=True)
class Config(MNISTConfig):
    """`MNISTConfig` plus the network's width and depth.

    Dryden et al.: 3 x 4096 hidden units, AdaGrad at 0.005, 4 replicas x 10
    images, 20 epochs. Default here: 3 x 256 hidden units, AdaGrad at 0.03,
    8 devices x 16 images, one epoch (468 steps) per compressor.
    """

    width: int = flag(256, "hidden units per layer")
    depth: int = flag(3, "hidden layers")

    def __post_init__(self):
        super().__post_init__()
        if self.width < 1 or self.depth < 1:
            raise ValueError(f"width and depth must be >= 1, got {self.width}, {self.depth}")
