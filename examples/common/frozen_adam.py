"""AdamW whose second moment stops at a step: the optimizer half of 1-bit Adam.

Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
Adam's Convergence Speed" (ICML 2021, arXiv:2102.02888), section 3: with a
compressed all-reduce, Adam's variance ``v`` sees the compressor's error
rather than the gradients' own scale, and error feedback cannot repair it,
because ``v`` is not linear in the gradient. Their recipe runs plain Adam
with an uncompressed all-reduce for a warm-up, then freezes ``v`` and
compresses from then on, so that Adam becomes momentum SGD with a fixed
per-coordinate preconditioner, which error feedback does suit.

Here the gradients stay what is compressed (the transforms of `qcollect`
compress gradients, not Adam's momentum, as 1-bit Adam does); the warm-up
is the examples' ``compress_after`` (`common.compressors.uncompressed_first`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class FrozenAdamState(NamedTuple):
    """``count`` steps taken; ``mu``, ``nu`` Adam's first and second moments."""

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def scale_by_frozen_adam(freeze_after: int, b1: float = 0.9, b2: float = 0.999,
                         eps: float = 1e-8) -> optax.GradientTransformation:
    """`optax.scale_by_adam` whose ``nu`` stops updating after ``freeze_after``
    steps (and keeps its bias correction of that step).

    Example:
      >>> tx = scale_by_frozen_adam(2)
      >>> state = tx.init({"w": jnp.zeros(1)})
      >>> for g in (1.0, 1.0, 100.0):
      ...     _, state = tx.update({"w": jnp.full(1, g)}, state)
      >>> round(float(state.nu["w"][0]), 6)   # 1 - 0.999 ** 2: the 100 never entered
      0.001999
    """
    if freeze_after < 1:
        raise ValueError(f"freeze_after must be >= 1, got {freeze_after!r}")

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return FrozenAdamState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update(updates, state, params=None):
        del params
        count = optax.safe_int32_increment(state.count)
        learning = state.count < freeze_after
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: jnp.where(learning, b2 * v + (1 - b2) * g * g, v),
                          state.nu, updates)
        seen = jnp.minimum(count, freeze_after).astype(jnp.float32)
        mu_hat_scale = 1 / (1 - b1 ** count.astype(jnp.float32))
        nu_hat_scale = 1 / (1 - b2 ** seen)
        out = jax.tree.map(lambda m, v: m * mu_hat_scale / (jnp.sqrt(v * nu_hat_scale) + eps),
                           mu, nu)
        return out, FrozenAdamState(count, mu, nu)

    return optax.GradientTransformation(init, update)


def frozen_adamw(learning_rate, freeze_after: int, *, weight_decay: float,
                 mask=None) -> optax.GradientTransformation:
    """`optax.adamw` (same defaults) with `scale_by_frozen_adam`."""
    return optax.chain(scale_by_frozen_adam(freeze_after),
                       optax.add_decayed_weights(weight_decay, mask),
                       optax.scale_by_learning_rate(learning_rate))
