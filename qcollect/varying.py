"""Varying manual axes: shard_map's type check (``check_vma``) of which values
differ across devices.

Outside `jax.shard_map` (under `jax.pmap` or no map at all) there are no
manual axes and everything here is a no-op.
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset | None:
    """The manual axes along which ``x`` varies, or None where JAX does not say."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)


def cast_varying(x, axes):
    """``x`` (any pytree) marked as varying along every axis in ``axes``."""

    def cast(leaf):
        have = varying_axes(leaf)
        missing = tuple(a for a in axes if have is not None and a not in have)
        if not missing:
            return leaf
        try:
            return lax.pcast(leaf, missing, to="varying")
        except (NameError, ValueError):  # no manual axis to cast along (pmap)
            return leaf

    return jax.tree.map(cast, x)


def varying_like(x, like):
    """``x`` (any pytree) marked as varying along every axis a leaf of ``like``
    varies along.

    A value that enters a `lax.cond` branch as a closure or an invariant
    operand is cast inside the branch when it meets a varying one; under
    `jax.vmap` the batched cond then casts a value that already varies and
    fails. Operands cast before the cond need no cast inside it.
    """
    axes = set()
    for leaf in jax.tree.leaves(like):
        axes |= set(varying_axes(leaf) or ())
    return cast_varying(x, tuple(sorted(axes)))
