"""Validation of encoder inputs and per-leaf settings.

The checks of static settings (`check_choice`, `check_float`, `check_int`)
are `qcollect.checks`'s, imported from there; this module holds the checks of
what ``encode`` receives and the per-leaf spreading of a setting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["check_floating_input", "per_leaf", "require_key"]


def check_floating_input(x: jax.Array) -> None:
    """Raises TypeError unless ``x`` is a floating-point array.

    Encoders take float16, bfloat16, float32 and float64 only (the
    compressors quantize values relative to a floating-point scale).
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating-point array, got dtype {x.dtype}")


def require_key(key: jax.Array | None, compressor: str) -> jax.Array:
    """``key``, or a ValueError naming ``compressor`` when it is None."""
    if key is None:
        raise ValueError(
            f"{compressor} is stochastic: encode(x, key) needs a PRNG key, got key=None")
    return key


def per_leaf(treedef: Any, value: Any, single: Callable[[Any], bool], name: str,
             what: str) -> list[Any]:
    """``value`` for each leaf of ``treedef``: ``value`` itself for every leaf
    when ``single(value)``, else ``value`` flattened up to ``treedef`` (a
    pytree shaped like the leaves' tree).

    Raises:
      ValueError: ``value`` is neither (the message names ``name`` and ``what``).
    """
    if single(value):
        return [value] * treedef.num_leaves
    try:
        return treedef.flatten_up_to(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} must be {what} or a pytree of them shaped like x, "
                         f"got {value!r}") from e
