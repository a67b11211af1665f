"""Collectives over the data axis of leaves that other mesh axes shard.

On a mesh with model axes (tensor parallelism: ``("data", "model")``) the
data-parallel step runs in ``jax.shard_map(..., axis_names={"data"})``: the
data axis is manual, the model axis stays with the compiler, and a gradient
leaf inside is the whole of its model-sharded array. A compressor that lays
the leaf out in buckets or columns would reshape across the model-sharded
dimension: with explicit axes JAX refuses the reshape, with automatic axes
the compiler gathers the leaf along the model axis first (traffic on the
model axis, and every model device encoding the whole leaf).

`over_blocks` runs a collective on each device's block instead: a nested
``jax.shard_map`` over the model axes that shard the leaves (manual for the
collective only), so each device encodes and sends its own block, packing
only along the dimensions the model axis does not shard, and the compiler
sees a result sharded as the input was. The blocks' specs come from the
leaves' types where the axes are explicit (``jax.sharding.AxisType.Explicit``)
or from the caller's ``block_specs``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeAlias

import jax
from jax.sharding import PartitionSpec as P

from qcollect._config import per_leaf

__all__ = ["BlockSpecs", "block_spec_tree", "over_blocks"]

#: How model axes shard each leaf: one ``PartitionSpec`` for every leaf, a
#: pytree of them shaped like the leaves, ``f(path, leaf) -> PartitionSpec``,
#: or None (read from the leaves' types).
BlockSpecs: TypeAlias = Any


def _axes_of(spec: P | None) -> set[Hashable]:
    axes: set[Hashable] = set()
    for entry in spec or ():
        if entry is None:
            continue
        axes |= set(entry) if isinstance(entry, tuple) else {entry}
    return axes


def _typed_spec(leaf: jax.Array) -> P | None:
    """The spec of ``leaf``'s explicit sharding (inside the jit), or None."""
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return spec if spec is not None and _axes_of(spec) else None


def block_spec_tree(x: Any, block_specs: BlockSpecs) -> Any:
    """Each leaf's block spec: ``block_specs`` (one ``PartitionSpec`` for every
    leaf, a pytree of them shaped like ``x``, or ``f(path, leaf) ->
    PartitionSpec``), or by default (None) the explicit sharding of each
    leaf's type; ``P()`` where nothing shards it.

    Given specs are checked against the mesh of the context (`check_block_specs`).

    Raises:
      ValueError: a spec that is not a ``PartitionSpec``, longer than its
        leaf's rank, or that `check_block_specs` refuses; the message names
        ``block_specs`` and the leaf."""
    leaves, treedef = jax.tree.flatten(x)
    if block_specs is None:
        specs = [_typed_spec(leaf) or P() for leaf in leaves]
    elif callable(block_specs):
        specs = [block_specs(path, leaf) for path, leaf in jax.tree.leaves_with_path(x)]
    else:
        specs = per_leaf(treedef, block_specs, lambda v: isinstance(v, P), "block_specs",
                         "a PartitionSpec")
    for leaf, spec in zip(leaves, specs, strict=True):
        if not isinstance(spec, P):
            raise ValueError(f"block_specs must hold PartitionSpecs, got {spec!r}")
        if len(spec) > jax.numpy.ndim(leaf):
            raise ValueError(f"block_specs: {spec} has more entries than a leaf of shape "
                             f"{jax.numpy.shape(leaf)} has dimensions")
    if block_specs is not None:
        check_block_specs(x, specs)
    return treedef.unflatten(specs)


def check_block_specs(x: Any, specs: Sequence[P]) -> None:
    """Raises unless each leaf's block spec names model axes of the current
    mesh that divide the dimensions they shard.

    Without this check a wrong spec fails in the nested ``jax.shard_map``, with
    a message about its arguments that names neither ``block_specs`` nor the
    leaf. Outside any mesh (no abstract mesh in the context) nothing is checked.

    Args:
      x: the leaves (their key paths name them, as ``x['w']``).
      specs: each leaf's ``PartitionSpec``, in flatten order.

    Raises:
      ValueError: a spec names an axis the mesh does not have, an axis that is
        manual here (the data axis the collective reduces over, or one an
        enclosing ``shard_map`` maps), or an axis (or axes) whose size does
        not divide the leaf's dimension; the message names ``block_specs``,
        the leaf, the axis and what to do.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return
    sizes = dict(mesh.shape)
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(x), specs, strict=True):
        shape = tuple(jax.numpy.shape(leaf))
        for dim, entry in enumerate(spec):
            names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            problem = _axis_problem(names, shape[dim], sizes, set(mesh.manual_axes))
            if problem:
                raise ValueError(f"block_specs gives the leaf x{jax.tree_util.keystr(path)} "
                                 f"of shape {shape} the spec {spec}, whose dimension {dim} "
                                 f"{problem}")


def _axis_problem(names: tuple[Hashable, ...], size: int, sizes: dict[Hashable, int],
                  manual: set[Hashable]) -> str | None:
    """What is wrong with the axes ``names`` sharding a dimension of ``size``
    (and what to do), or None."""
    for axis in names:
        if axis not in sizes:
            return (f"names the axis {axis!r}, which the mesh does not have (its axes: "
                    f"{', '.join(map(repr, sizes))}): name only the model axes that shard "
                    f"the leaf, as in P(None, 'model'), or give it P() (reduced whole)")
        if axis in manual:
            return (f"names {axis!r}, an axis the enclosing jax.shard_map maps (the data axis "
                    f"the collective reduces over): block_specs says how the model axes (those "
                    f"left to the compiler, outside shard_map's axis_names) cut each leaf, "
                    f"never the data axis; leave {axis!r} out of it (P() for a leaf no "
                    f"model axis shards)")
    count = math.prod(sizes[a] for a in names)
    if size % count:
        axes = " x ".join(f"{a!r} ({sizes[a]})" for a in names)
        return (f"has size {size}, which {axes} does not divide: shard the leaf along a "
                f"dimension that the axis size divides, or give it P() (reduced whole)")
    return None


def over_blocks(run: Callable[..., Any], x: Any, block_specs: BlockSpecs, *shared: Any,
                like_x: Sequence[Any] = (), out_specs: Callable[[Any], Any]) -> Any:
    """``run(x, *like_x, *shared)`` on each device's block of ``x`` along the
    mesh axes its block specs name (`block_spec_tree`), or as it is when none
    do.

    Leaves that no model axis shards run apart from the sharded ones, whole
    (as without model axes): in one buffer with blocks, which differ
    between the model devices, their encoding would differ too (buckets,
    scales) and so would their "replicated" result.

    Args:
      run: the collective, of a list of leaves (or of ``x``).
      x: the leaves, model-sharded as ``block_specs`` say.
      block_specs: see `block_spec_tree`.
      shared: arguments every block sees whole (a PRNG key).
      like_x: arguments shaped and sharded like ``x`` (None allowed).
      out_specs: ``out_specs(specs)``: the specs of ``run``'s result, given
        the spec tree of ``x`` (an `AllReduceResult` of it, say).

    Returns:
      ``run``'s result, sharded by ``out_specs``.
    """
    specs = block_spec_tree(x, block_specs)
    leaves, treedef = jax.tree.flatten(x)
    spec_list = treedef.flatten_up_to(specs)
    axes = set().union(*[_axes_of(s) for s in spec_list])
    if not axes:
        return run(x, *like_x, *shared)
    others = [None if a is None else treedef.flatten_up_to(a) for a in like_x]

    def pick(indices: list[int]) -> tuple[Any, ...]:
        return ([leaves[i] for i in indices],
                *[None if a is None else [a[i] for i in indices] for a in others])

    whole = [i for i, s in enumerate(spec_list) if not _axes_of(s)]
    blocked = [i for i, s in enumerate(spec_list) if _axes_of(s)]
    found: dict[tuple[int, int], Any] = {}
    if whole:
        found |= _by_slot(run(*pick(whole), *shared), whole, out_specs)
    sharded = [spec_list[i] for i in blocked]
    in_specs = (sharded, *[None if a is None else sharded for a in others],
                *[P()] * len(shared))
    result = jax.shard_map(run, in_specs=in_specs, out_specs=out_specs(sharded),
                           axis_names=frozenset(axes))(*pick(blocked), *shared)
    found |= _by_slot(result, blocked, out_specs)
    slots, layout = jax.tree.flatten(out_specs(treedef.unflatten(
        [_Slot(i) for i in range(len(leaves))])))
    return layout.unflatten([found[key] for key in _slot_keys(slots)])


class _Slot:
    """A marker for leaf ``index`` of ``x`` in the structure ``out_specs`` builds."""

    def __init__(self, index: int) -> None:
        self.index = index


def _slot_keys(slots: Sequence[_Slot]) -> list[tuple[int, int]]:
    """``(leaf index, occurrence)`` of each marker: ``out_specs`` may place a
    leaf's spec several times (the fields of an `AllReduceResult`)."""
    seen: dict[int, int] = {}
    keys: list[tuple[int, int]] = []
    for slot in slots:
        keys.append((slot.index, seen.get(slot.index, 0)))
        seen[slot.index] = keys[-1][1] + 1
    return keys


def _by_slot(result: Any, indices: list[int],
             out_specs: Callable[[Any], Any]) -> dict[tuple[int, int], Any]:
    """``result`` of ``run`` on the leaves ``indices``, keyed as `_slot_keys`."""
    slots, layout = jax.tree.flatten(out_specs([_Slot(i) for i in indices]))
    return dict(zip(_slot_keys(slots), layout.flatten_up_to(result), strict=True))
