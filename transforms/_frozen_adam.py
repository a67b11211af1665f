"""Adam(W) whose second moment stops updating at a step: 1-bit Adam's stage 2.

Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
Adam's Convergence Speed" (ICML 2021, arXiv:2102.02888), section 3: with a
compressed all-reduce, Adam's variance ``v`` sees the compressor's error
rather than the gradients' own scale, and error feedback cannot repair that,
because ``v`` is not linear in the gradient. Their recipe runs plain Adam
with an uncompressed all-reduce for a warm-up (15-25% of the steps), then
freezes ``v`` and compresses from then on: Adam becomes momentum SGD with a
fixed per-coordinate preconditioner, which error feedback does suit.

Here it is the gradients that are compressed (by the transformations of
this package, before the optimizer), not Adam's momentum as in 1-bit Adam;
the warm-up is `transforms.compressed_all_reduce`'s ``compress_after``::

    optax.chain(
        transforms.compressed_all_reduce("data", compressor=qc.onebit(), key=key,
                                         compress_after=K),
        transforms.frozen_adamw(learning_rate, freeze_after=K))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qcollect.checks import check_int

__all__ = ["FrozenAdamState", "frozen_adamw", "scale_by_frozen_adam"]


class FrozenAdamState(NamedTuple):
    """State of `scale_by_frozen_adam`.

    Attributes:
      count: int32 steps taken.
      mu: Adam's first moment (``mu_dtype``, default the updates' dtypes).
      nu: Adam's second moment, unchanged from step ``freeze_after`` on.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def scale_by_frozen_adam(freeze_after: int, b1: float = 0.9, b2: float = 0.999,
                         eps: float = 1e-8, eps_root: float = 0.0,
                         mu_dtype: Any = None) -> optax.GradientTransformation:
    """`optax.scale_by_adam` whose ``nu`` stops updating after ``freeze_after``
    steps, keeping the bias correction of that step.

    For the first ``freeze_after`` steps it computes what
    ``optax.scale_by_adam`` computes, with the same formula; from then on
    ``nu`` and its bias correction stay as they were after step
    ``freeze_after``, while ``mu`` goes on.

    Args:
      freeze_after: steps whose gradients enter ``nu``, >= 1 (1-bit Adam
        freezes it where compression starts: ``compress_after``).
      b1, b2, eps, eps_root, mu_dtype: as in ``optax.scale_by_adam``.

    Returns:
      An ``optax.GradientTransformation`` with `FrozenAdamState`.

    Raises:
      ValueError: ``freeze_after`` is not an integer >= 1.

    References:
      Tang et al., 1-bit Adam, ICML 2021 <https://arxiv.org/abs/2102.02888>,
      section 3 and Algorithm 1.

    Example:
      >>> import jax.numpy as jnp, transforms
      >>> tx = transforms.scale_by_frozen_adam(2)
      >>> state = tx.init({"w": jnp.zeros(1)})
      >>> for g in (1.0, 1.0, 100.0):
      ...     _, state = tx.update({"w": jnp.full(1, g)}, state)
      >>> round(float(state.nu["w"][0]), 6)   # 1 - 0.999 ** 2: the 100 never entered
      0.001999
    """
    freeze_after = check_int("freeze_after", freeze_after, low=1)
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

    def init(params: optax.Params) -> FrozenAdamState:
        mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype), params)
        nu = jax.tree.map(jnp.zeros_like, params)
        return FrozenAdamState(jnp.zeros([], jnp.int32), mu, nu)

    def update(updates: optax.Updates, state: FrozenAdamState,
               params: optax.Params | None = None) -> tuple[optax.Updates, FrozenAdamState]:
        del params
        count = optax.safe_int32_increment(state.count)
        learning = state.count < freeze_after
        mu = jax.tree.map(lambda m, g: (1 - b1) * g + b1 * m, state.mu, updates)
        nu = jax.tree.map(
            lambda v, g: jnp.where(learning, (1 - b2) * g ** 2 + b2 * v, v).astype(v.dtype),
            state.nu, updates)
        seen = jnp.minimum(count, freeze_after)
        out = jax.tree.map(
            lambda m, v: (m / (1 - b1 ** count).astype(m.dtype))
            / (jnp.sqrt(v / (1 - b2 ** seen).astype(v.dtype) + eps_root) + eps),
            mu, nu)
        mu = jax.tree.map(lambda m: m if mu_dtype is None else m.astype(mu_dtype), mu)
        return out, FrozenAdamState(count, mu, nu)

    return optax.GradientTransformation(init, update)


def frozen_adamw(learning_rate: optax.ScalarOrSchedule, freeze_after: int, *,
                 b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                 mu_dtype: Any = None, weight_decay: float = 1e-4,
                 mask: Any = None) -> optax.GradientTransformation:
    """``optax.adamw`` (same settings and defaults) whose second moment stops
    updating after ``freeze_after`` steps (`scale_by_frozen_adam`): with
    `transforms.compressed_all_reduce`'s ``compress_after`` at the same step,
    the whole of 1-bit Adam's recipe. ``weight_decay=0`` gives Adam.

    References:
      Tang et al., 1-bit Adam, ICML 2021 <https://arxiv.org/abs/2102.02888>;
      Loshchilov and Hutter, decoupled weight decay, ICLR 2019.

    Example:
      >>> import jax, jax.numpy as jnp, optax, qcollect as qc, transforms
      >>> tx = optax.chain(
      ...     transforms.compressed_all_reduce("data", compressor=qc.onebit(),
      ...                                      key=jax.random.key(0), compress_after=100),
      ...     transforms.frozen_adamw(1e-3, freeze_after=100))
      >>> state = tx.init({"w": jnp.zeros((4, 4))})
      >>> int(state[1][0].count)
      0
    """
    return optax.chain(
        scale_by_frozen_adam(freeze_after, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                             mu_dtype=mu_dtype),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate))
