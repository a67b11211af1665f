"""Defaults of the CNN example: GradiVeQ, QSGD-4 and PowerSGD against pmean."""

from __future__ import annotations

import dataclasses

from common.config import MNISTConfig, flag


@dataclasses.dataclass(frozen=True)
class Config(MNISTConfig):
    """`MNISTConfig` with the CNN's width and the compressors of GradiVeQ's comparison.

    GradiVeQ (section 4) compares uncompressed ring all-reduce, 4-bit QSGD
    and GradiVeQ at 8x; PowerSGD is the low-rank alternative. SGD with
    momentum, as for their ResNet.
    """

    compressors: tuple[str, ...] = ("none", "qsgd-4", "gradiveq", "powersgd")
    optimizer: str = "momentum"
    learning_rate: float = 0.05
    channels: int = flag(
        32, "output channels of the first conv layer (the second and third have twice as "
            "many)")

    def __post_init__(self):
        super().__post_init__()
        if self.channels < 1:
            raise ValueError(f"channels must be >= 1, got {self.channels!r}")
