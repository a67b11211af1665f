"""Three 3x3 conv layers, average pooling, a small dense head.

The conv kernels hold 98% of the parameters, so the all-reduce is mostly
conv gradients: the setting of GradiVeQ (Yu et al., section 2), where the
``F`` gradients at one kernel position are linearly correlated.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


class CNN(nnx.Module):
    """``28x28x1 -> conv(c) -> pool -> conv(2c) -> pool -> conv(2c) -> mean -> 10``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> CNN(channels=8, rngs=nnx.Rngs(0))(jnp.zeros((2, 28, 28, 1))).shape
      (2, 10)
    """

    def __init__(self, *, channels: int = 32, classes: int = 10, rngs: nnx.Rngs):
        c = channels
        self.conv1 = nnx.Conv(1, c, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(c, 2 * c, (3, 3), rngs=rngs)
        self.conv3 = nnx.Conv(2 * c, 2 * c, (3, 3), rngs=rngs)
        self.head = nnx.Linear(2 * c, classes, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(nnx.relu(self.conv1(x)), (2, 2), (2, 2))
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), (2, 2), (2, 2))
        x = nnx.relu(self.conv3(x))
        return self.head(jnp.mean(x, axis=(1, 2)))


def build(cfg) -> CNN:
    """The model of ``cfg`` (same initialisation for every compressor: ``cfg.seed``)."""
    return CNN(channels=cfg.channels, rngs=nnx.Rngs(cfg.seed))
