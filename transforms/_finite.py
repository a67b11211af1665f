"""Non-finite steps: one flag for a whole tree, and state kept on a bad step.

Every transformation here leaves its state as it was on a step whose
reduced update is non-finite. Compressors and sums propagate NaN and Inf,
so one device's non-finite gradient makes the reduced update non-finite on
every device alike: the flag agrees across devices without a collective,
and all devices keep or advance their state together.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["all_finite", "keep_if_finite"]


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
