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
the exact steps first are `transforms.compressed_all_reduce`'s
``compress_after``, and one `transforms.CompressAfter` value given to both
keeps the freeze and the compression in step::

    warm = transforms.CompressAfter(K)
    optax.chain(
        transforms.compressed_all_reduce("data", compressor=qc.onebit(), key=key,
                                         compress_after=warm),
        transforms.frozen_adamw(learning_rate, freeze_after=warm))
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from transforms._phases import CompressAfter, as_schedule

__all__ = ["FrozenAdamState", "freeze_schedule", "frozen_adamw", "scale_by_frozen_adam"]


class FrozenAdamState(NamedTuple):
    """State of `scale_by_frozen_adam`.

    The first three fields are those of ``optax.ScaleByAdamState``.

    Attributes:
      count: int32 steps taken.
      mu: Adam's first moment (``mu_dtype``, default the updates' dtypes).
      nu: Adam's second moment, unchanged from step ``freeze_after`` on.
      nu_count: int32 steps whose gradients entered ``nu``: the count of
        ``nu``'s bias correction (``count`` until the freeze, then fixed).
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    nu_count: jax.Array


def scale_by_frozen_adam(freeze_after: int | CompressAfter, b1: float = 0.9, b2: float = 0.999,
                         eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: Any = None, *,
                         nesterov: bool = False) -> optax.GradientTransformation:
    """`optax.scale_by_adam` whose ``nu`` stops updating after ``freeze_after``
    steps, keeping the bias correction of that step.

    For the first ``freeze_after`` steps it computes what
    ``optax.scale_by_adam`` computes, with optax's own moment updates and
    bias corrections (``optax.tree``), bit for bit; from then on ``nu`` and
    its bias correction stay as they were after step ``freeze_after``, while
    ``mu`` goes on. ``None`` leaves stay ``None``, as in optax.

    Args:
      freeze_after: steps whose gradients enter ``nu``, an int >= 1 or the
        `transforms.CompressAfter` given to the all-reduce's
        ``compress_after`` (1-bit Adam freezes ``nu`` where compression
        starts: one value keeps the two in step).
      b1, b2, eps, eps_root, mu_dtype, nesterov: as in ``optax.scale_by_adam``.

    Returns:
      An ``optax.GradientTransformation`` with `FrozenAdamState`.

    Raises:
      ValueError: ``freeze_after`` is neither an integer >= 1 nor a
        `transforms.CompressAfter` of at least one step.

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
      >>> int(state.count), int(state.nu_count)
      (3, 2)
    """
    schedule = freeze_schedule(freeze_after)
    mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(mu_dtype)
    adam = optax.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov)

    def init(params: optax.Params) -> FrozenAdamState:
        first = cast(optax.ScaleByAdamState, adam.init(params))
        return FrozenAdamState(first.count, first.mu, first.nu, jnp.zeros([], jnp.int32))

    def update(updates: optax.Updates, state: FrozenAdamState,
               params: optax.Params | None = None) -> tuple[optax.Updates, FrozenAdamState]:
        del params
        learning = _learning(state.count, schedule)
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        nu = jax.tree.map(lambda new, old: None if new is None else jnp.where(learning, new, old),
                          optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2),
                          state.nu, is_leaf=lambda x: x is None)
        count = optax.safe_increment(state.count)
        nu_count = jnp.where(learning, optax.safe_increment(state.nu_count), state.nu_count)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g,
                                  optax.tree.bias_correction(mu, b1, optax.safe_increment(count)),
                                  optax.tree.bias_correction(updates, b1, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, b1, count)
        nu_hat = optax.tree.bias_correction(nu, b2, nu_count)
        updates = jax.tree.map(
            lambda m, v: None if m is None else m / (jnp.sqrt(v + eps_root) + eps),
            mu_hat, nu_hat, is_leaf=lambda x: x is None)
        return updates, FrozenAdamState(count, optax.tree.cast(mu, mu_dtype),
                                        optax.tree.cast_like(nu, state.nu), nu_count)

    return optax.GradientTransformation(init, update)


def freeze_schedule(freeze_after: int | CompressAfter,
                    name: str = "freeze_after") -> CompressAfter:
    """``freeze_after`` as the schedule whose exact steps update ``nu``.

    Raises:
      ValueError: not an integer >= 1 nor a `CompressAfter` of >= 1 step,
        naming ``name``.
    """
    schedule = as_schedule(freeze_after, name)
    if schedule.steps < 1:
        raise ValueError(f"{name} must be at least 1 step (Adam's variance needs one "
                         f"gradient), got {freeze_after!r}")
    return schedule


def _learning(count: jax.Array, schedule: CompressAfter) -> jax.Array:
    """Whether the step taken after ``count`` steps still updates ``nu``: the
    schedule's exact steps do (counts ``0 .. K - 1``).

    Example:
      >>> import jax.numpy as jnp
      >>> [bool(_learning(jnp.int32(c), CompressAfter(2))) for c in range(4)]
      [True, True, False, False]
    """
    return schedule.at(count)


def frozen_adamw(learning_rate: optax.ScalarOrSchedule, freeze_after: int | CompressAfter, *,
                 b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                 mu_dtype: Any = None, weight_decay: optax.ScalarOrSchedule = 1e-4,
                 mask: Any = None, nesterov: bool = False) -> optax.GradientTransformation:
    """``optax.adamw`` (same settings, defaults and order) whose second moment
    stops updating after ``freeze_after`` steps (`scale_by_frozen_adam`):
    with `transforms.compressed_all_reduce`'s ``compress_after`` at the same
    step, the whole of 1-bit Adam's recipe. ``weight_decay=0`` gives Adam,
    ``nesterov=True`` NAdamW.

    Args:
      learning_rate: a step size or an optax schedule.
      freeze_after: steps whose gradients enter Adam's second moment: an
        int >= 1, or the `transforms.CompressAfter` the all-reduce takes.
      b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov: as in
        ``optax.adamw`` (``mask``: a pytree of bools or a function of the
        parameters, such as `transforms.matrices`).

    Returns:
      ``scale_by_frozen_adam``, decoupled weight decay and the learning
      rate, chained as ``optax.adamw`` chains them.

    Raises:
      ValueError: ``freeze_after`` is not an integer >= 1 or a
        `transforms.CompressAfter` of at least one step.

    References:
      Tang et al., 1-bit Adam, ICML 2021 <https://arxiv.org/abs/2102.02888>;
      Loshchilov and Hutter, decoupled weight decay, ICLR 2019.

    Example:
      >>> import jax, jax.numpy as jnp, optax, qcollect as qc, transforms
      >>> warm = transforms.CompressAfter(100)   # one value for the pair
      >>> tx = optax.chain(
      ...     transforms.compressed_all_reduce("data", compressor=qc.onebit(),
      ...                                      key=jax.random.key(0), compress_after=warm),
      ...     transforms.frozen_adamw(1e-3, freeze_after=warm))
      >>> state = tx.init({"w": jnp.zeros((4, 4))})
      >>> int(state[1][0].count)
      0
    """
    return optax.chain(
        scale_by_frozen_adam(freeze_after, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                             mu_dtype=mu_dtype, nesterov=nesterov),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate))
