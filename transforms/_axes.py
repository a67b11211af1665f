"""The data axis inside a step: its mesh axes, whether it is bound, and which
values vary along it.

Under ``jax.shard_map`` with its type check (``check_vma``), every value is
typed with the manual axes it varies along (`qcollect.varying`). The
transformations read those types to tell this device's own gradients from
gradients already summed by ``jax.grad`` of replicated parameters
(`check_local_gradients`), to find the shards of a sharded gradient, and to
return values typed as their callers expect (`to_varying`,
`cond_matching_types`). Under ``jax.pmap`` there are no such types and every
check here passes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from qcollect.checks import check_floating_leaves
from qcollect.varying import cast_varying, varying_axes

__all__ = ["AxisName", "ReducingOptimizer", "check_axis", "check_local_gradients",
           "cond_matching_types", "mesh_axes", "to_varying", "tracks_varying", "varies_along"]

#: A data axis: one mesh axis name, or a tuple of them such as the pair
#: ``(outer, inner)`` of a hierarchical all-reduce.
AxisName = Hashable


class ReducingOptimizer(optax.GradientTransformation):
    """An optimizer that all-reduces each device's own gradients inside
    (`transforms.onebit_adam`, `transforms.decoupled_momentum`): an
    ``optax.GradientTransformation`` by type, which sharded training
    (`transforms.init_on_shards`) refuses, its gradients being reduced
    shards already."""


def mesh_axes(axis_name: AxisName) -> tuple[Any, ...]:
    """The mesh axes of a data axis: ``"data"`` -> ``("data",)``, a tuple as is.

    Example:
      >>> mesh_axes("data"), mesh_axes(("node", "local"))
      (('data',), ('node', 'local'))
    """
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def varies_along(leaf: Any, axis_name: AxisName) -> bool:
    """Whether ``leaf`` is typed as varying along every mesh axis of ``axis_name``."""
    return set(mesh_axes(axis_name)) <= frozenset(varying_axes(leaf) or ())


def check_axis(axis_name: AxisName) -> None:
    """Raises unless every axis of ``axis_name`` is bound here.

    A transformation's update runs inside ``jax.shard_map`` (or ``jax.pmap``)
    over its data axis; a name that is not one of the mapped axes would
    otherwise fail deep inside a collective (a ``NameError``, or an
    ``AssertionError`` without a message from ``lax.pmean``).

    Raises:
      ValueError: naming ``axis_name``, the axis that is not bound, and the
        axes that are (the mapped axes of the current mesh).
    """
    for axis in mesh_axes(axis_name):
        try:
            lax.axis_index(axis)
        except NameError:
            mesh = jax.sharding.get_abstract_mesh()
            mapped = tuple(getattr(mesh, "manual_axes", ()) or ())
            others = tuple(a for a in getattr(mesh, "axis_names", ()) if a not in mapped)
            bound = (f"the mapped axes here are {', '.join(map(repr, mapped))}" if mapped
                     else "no mesh axis is mapped here")
            if others:
                bound += f" (the mesh's other axes, {', '.join(map(repr, others))}, are not)"
            raise ValueError(
                f"axis_name {axis_name!r}: {axis!r} is not a bound axis: {bound}. Run the "
                f"update inside jax.shard_map (or jax.pmap) over {axis!r}, or make the "
                f"transformation with the data axis the step maps over.") from None


def tracks_varying(axis_name: AxisName) -> bool:
    """True inside ``shard_map`` over ``axis_name`` with its type check (not pmap).

    Raises:
      ValueError: ``axis_name`` is not bound here (`check_axis`).
    """
    check_axis(axis_name)
    return varies_along(lax.axis_index(axis_name), axis_name)


def check_local_gradients(grads: Any, axis_name: AxisName) -> None:
    """Raises when gradients are already summed over ``axis_name``.

    Under ``shard_map``, ``jax.grad`` with respect to replicated (``P()``)
    parameters transposes their implicit broadcast into an uncompressed
    ``psum``: such gradients are invariant along the axis and the compressed
    all-reduce would sum them a second time. Differentiate with respect to
    ``lax.pcast(params, axis_name, to="varying")`` to get this device's own
    gradients. Under ``jax.pmap`` (no such types) only the dtypes are
    checked: every leaf must be floating point (`qcollect.checks.check_floating_leaves`).
    """
    check_floating_leaves(grads, "grads")
    if not tracks_varying(axis_name):
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        if not varies_along(leaf, axis_name) and int(np.prod(jnp.shape(leaf))) > 0:
            raise ValueError(
                f"the gradient {jax.tree_util.keystr(path) or 'leaf'} is invariant along "
                f"{axis_name!r}, but the update needs each device's own gradients. Either "
                f"jax.grad was taken with respect to replicated parameters, which sums "
                f"the gradients with an uncompressed psum: differentiate with respect to "
                f"jax.lax.pcast(params, {axis_name!r}, to='varying'). Or the gradients come "
                f"from state placed replicated (P()), such as gradient accumulators: place "
                f"the state with transforms.init_sharded and transforms.state_specs, which "
                f"put the accumulators of transforms.accumulate per device.")


def to_varying(tree: Any, axis_name: AxisName) -> Any:
    """Every leaf typed varying along ``axis_name`` (a no-op under ``jax.pmap``)."""
    if not tracks_varying(axis_name):
        return tree
    return cast_varying(tree, mesh_axes(axis_name))


def cond_matching_types(pred: jax.Array, true_fun: Callable[..., Any],
                        false_fun: Callable[..., Any], *operands: Any) -> Any:
    """``lax.cond`` whose branches may differ in which mesh axes an output
    varies along (under ``shard_map``): each output is cast to vary along
    the axes either branch's output varies along (``lax.pcast``)."""
    true_out = jax.tree.leaves(jax.eval_shape(true_fun, *operands))
    false_out = jax.tree.leaves(jax.eval_shape(false_fun, *operands))
    wanted = [frozenset(varying_axes(a) or ()) | frozenset(varying_axes(b) or ())
              for a, b in zip(true_out, false_out, strict=True)]

    def matched(fun: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            leaves, treedef = jax.tree.flatten(fun(*args))
            cast = [cast_varying(x, tuple(sorted(want)))
                    for x, want in zip(leaves, wanted, strict=True)]
            return treedef.unflatten(cast)
        return run

    return lax.cond(pred, matched(true_fun), matched(false_fun), *operands)
