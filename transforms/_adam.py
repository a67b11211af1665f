"""Adam's hyperparameters, checked once, for the optimizers that compress inside."""

from __future__ import annotations

import dataclasses
from typing import Any

from qcollect.checks import check_float

__all__ = ["AdamSettings"]


@dataclasses.dataclass(frozen=True)
class AdamSettings:
    """``optax.adamw``'s ``b1``, ``b2``, ``eps``, ``weight_decay`` and ``mask``,
    validated (`transforms.onebit_adam`, `transforms.zero_one_adam`).

    Raises:
      ValueError: a value out of its range, naming it.

    Example:
      >>> AdamSettings(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, mask=None).b2
      0.999
    """

    b1: float
    b2: float
    eps: float
    weight_decay: float
    mask: Any

    def __post_init__(self) -> None:
        for name in ("b1", "b2"):
            check_float(name, getattr(self, name), low=0.0, low_inclusive=True, high=1.0,
                        high_inclusive=False)
        for name in ("eps", "weight_decay"):
            check_float(name, getattr(self, name), low=0.0, low_inclusive=True)
