"""Non-finite steps: one flag for a whole tree, and state kept on a bad step.

Every transformation here leaves its state as it was on a step whose
reduced update is non-finite. Compressors and sums propagate NaN and Inf,
so one device's non-finite gradient makes the reduced update non-finite on
every device alike: the flag agrees across devices without a collective,
and all devices keep or advance their state together. Sharded updates
(`transforms.fsdp`'s shards) differ from device to device, so their flag
takes one 4-byte psum (`finite_everywhere`, `apply_if_finite`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from transforms._axes import AxisName

__all__ = ["all_finite", "apply_if_finite", "finite_everywhere", "keep_if_finite"]


def keep_if_finite(finite: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``finite`` (a scalar bool), else ``old``, leaf by leaf.

    Example:
      >>> import jax.numpy as jnp
      >>> keep_if_finite(jnp.array(False), {"r": jnp.ones(2)}, {"r": jnp.zeros(2)})["r"]
      Array([0., 0.], dtype=float32)
    """
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def all_finite(tree: Any) -> jax.Array:
    """Scalar bool: every value of every leaf of ``tree`` is finite.

    Example:
      >>> import jax.numpy as jnp
      >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
      False
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.array(True)
    flags = jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves])
    # Behind an identity gather the flags are reduced once: the backend
    # register's STACKED_FLAGS_COPIED (docs/collectives.md#backend-workarounds).
    flags = flags.at[jnp.arange(len(leaves))].get(
        mode="promise_in_bounds", indices_are_sorted=True, unique_indices=True)
    return jnp.all(flags)


def finite_everywhere(tree: Any, axis_name: AxisName) -> jax.Array:
    """Scalar bool, the same on every device of ``axis_name``: every device's
    leaves of ``tree`` are finite (one 4-byte psum)."""
    leaves = jax.tree.leaves(tree)
    bad = sum((~jnp.isfinite(leaf)).sum(dtype=jnp.int32) for leaf in leaves) if leaves else 0
    return lax.psum(jnp.asarray(bad, jnp.int32), axis_name) == 0


def apply_if_finite(inner: optax.GradientTransformation, axis_name: AxisName, *,
                    max_consecutive_errors: int) -> optax.GradientTransformation:
    """`optax.apply_if_finite` for updates sharded over ``axis_name``.

    A step whose updates are non-finite on any device is skipped on every
    device: zero updates and ``inner``'s state unchanged, until more than
    ``max_consecutive_errors`` such steps in a row, which are applied (as
    optax's). optax's own decides on each device's shards alone, so under
    `transforms.fsdp` devices would disagree on whether to step (and its
    counters would vary by device); here one 4-byte psum decides for all.
    The state is optax's ``ApplyIfFiniteState``, replicated (``P()``)
    except for ``inner``'s own. With replicated updates (after
    `transforms.compressed_all_reduce`) optax's works as well.

    Args:
      inner: the optimizer to guard, run on this device's shards.
      axis_name: the mesh axis the updates are sharded over.
      max_consecutive_errors: non-finite steps in a row that are skipped, >= 0.

    Returns:
      An optax ``GradientTransformation`` to use inside ``jax.shard_map``.

    Raises:
      ValueError: ``max_consecutive_errors`` is not an int >= 0.

    Example:
      >>> import optax, transforms
      >>> tx = transforms.apply_if_finite(optax.adamw(1e-3), "data", max_consecutive_errors=5)
    """
    if isinstance(max_consecutive_errors, bool) or not isinstance(max_consecutive_errors, int) \
            or max_consecutive_errors < 0:
        raise ValueError("max_consecutive_errors must be an int >= 0, got "
                         f"{max_consecutive_errors!r}")

    def init(params: Any) -> optax.ApplyIfFiniteState:
        zero = jnp.zeros([], jnp.int32)
        return optax.ApplyIfFiniteState(notfinite_count=zero, last_finite=jnp.array(True),
                                        total_notfinite=zero, inner_state=inner.init(params))

    def update(updates: Any, state: optax.ApplyIfFiniteState, params: Any = None,
               **extra: Any) -> tuple[Any, optax.ApplyIfFiniteState]:
        finite = finite_everywhere(updates, axis_name)
        count = jnp.where(finite, 0, state.notfinite_count + 1).astype(jnp.int32)
        total = (state.total_notfinite + jnp.where(finite, 0, 1)).astype(jnp.int32)
        step = finite | (count > max_consecutive_errors)
        new, inner_state = optax.with_extra_args_support(inner).update(
            updates, state.inner_state, params, **extra)
        new = jax.tree.map(lambda u: jnp.where(step, u, jnp.zeros((), u.dtype)), new)
        return new, optax.ApplyIfFiniteState(
            notfinite_count=count, last_finite=finite, total_notfinite=total,
            inner_state=keep_if_finite(step, inner_state, state.inner_state))

    return optax.GradientTransformationExtraArgs(init, update)
