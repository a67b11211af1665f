"""Varying manual axes: which values differ across the devices of a mesh axis.

Inside `jax.shard_map` (with its default ``check_vma=True``) every value's
type records the manual mesh axes along which it may differ between
devices: an input split with ``P("data")`` varies along ``"data"``, a
constant or a ``P()`` input does not, and ``lax.axis_index("data")`` does.
JAX checks these types: the two branches of a `jax.lax.cond`, the carry of
a `jax.lax.scan` and what `jax.lax.ppermute` moves must agree, and an
output spec ``P()`` needs a value that does not vary. Code that builds a
buffer from constants and then fills it with per-device data (a ring's
accumulator, an error-feedback residual) has to mark the buffer as varying
first; these helpers read and set the marks on whole pytrees.

Outside `jax.shard_map` (under `jax.pmap` or no map at all) there are no
manual axes: `varying_axes` reports none and the casts return their input.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> from qcollect.varying import cast_varying, varying_axes
  >>> mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
  >>> def f(x):
  ...     print(sorted(varying_axes(x)), sorted(varying_axes(cast_varying(x, ("d",)))))
  ...     return x
  >>> _ = jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P())(jnp.zeros(4))
  [] ['d']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax import lax

__all__ = ["cast_varying", "varying_axes", "varying_like"]


def varying_axes(x: Any) -> frozenset[str] | None:
    """The manual mesh axes along which the array ``x`` varies.

    Reads the type JAX gives ``x`` (`jax.typeof`), so it works on tracers
    inside `jax.shard_map` and on concrete arrays alike.

    Args:
      x: an array or tracer (one leaf, not a pytree).

    Returns:
      A frozenset of axis names: empty outside `jax.shard_map` and for
      values that are the same on every device; None where this version of
      JAX does not record the axes.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from qcollect.varying import varying_axes
      >>> mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
      >>> def f(x):
      ...     print(sorted(varying_axes(x)), sorted(varying_axes(jax.lax.axis_index("d"))))
      ...     return x
      >>> _ = jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P())(jnp.zeros(4))
      [] ['d']
      >>> varying_axes(jnp.zeros(3))
      frozenset()
    """
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)


def cast_varying(x: Any, axes: Sequence[str]) -> Any:
    """``x`` (any pytree) marked as varying along every axis in ``axes``.

    Each leaf is cast (`jax.lax.pcast` with ``to="varying"``) along the axes
    of ``axes`` it does not vary along yet; a leaf that already varies along
    all of them is returned as it is. The values do not change, only their
    type, so that they may meet per-device values in a ``cond``, a loop
    carry or a ``ppermute``. Outside `jax.shard_map` it returns ``x``.

    Args:
      x: a pytree of arrays.
      axes: names of manual mesh axes bound by the enclosing
        `jax.shard_map`.

    Returns:
      ``x`` with every leaf varying along ``axes`` (as well as along the axes
      it varied along before).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from qcollect.varying import cast_varying, varying_axes
      >>> mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
      >>> def f(x):
      ...     acc = cast_varying({"sum": jnp.zeros(4)}, ("d",))   # a per-device buffer
      ...     print(sorted(varying_axes(acc["sum"])))
      ...     return x
      >>> _ = jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P())(jnp.zeros(4))
      ['d']
    """

    def cast(leaf: Any) -> Any:
        have = varying_axes(leaf)
        missing = tuple(a for a in axes if have is not None and a not in have)
        if not missing:
            return leaf
        try:
            return lax.pcast(leaf, missing, to="varying")
        except (NameError, ValueError):  # no manual axis to cast along (pmap)
            return leaf

    return jax.tree.map(cast, x)


def varying_like(x: Any, like: Any) -> Any:
    """``x`` (any pytree) marked as varying along every axis a leaf of ``like``
    varies along.

    Use it on the operands of a `jax.lax.cond` whose other operands vary. A
    value that enters a branch as a closure or an invariant operand is cast
    inside the branch when it meets a varying one; under `jax.vmap` the
    batched cond then casts a value that already varies and fails. Operands
    cast before the cond need no cast inside it.

    Args:
      x: a pytree of arrays to cast.
      like: a pytree of arrays whose varying axes, all leaves together, ``x``
        takes on.

    Returns:
      ``x`` varying along the union of the axes the leaves of ``like`` vary
      along (`cast_varying`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from qcollect.varying import varying_axes, varying_like
      >>> mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
      >>> def f(x):
      ...     i = jax.lax.axis_index("d")
      ...     print(sorted(varying_axes(varying_like(x, (x, i)))))
      ...     return x
      >>> _ = jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P())(jnp.zeros(4))
      ['d']
    """
    axes: set[str] = set()
    for leaf in jax.tree.leaves(like):
        axes |= set(varying_axes(leaf) or ())
    return cast_varying(x, tuple(sorted(axes)))
