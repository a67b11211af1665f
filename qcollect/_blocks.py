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

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from qcollect._config import per_leaf

__all__ = ["block_spec_tree", "over_blocks"]


def _axes_of(spec) -> set:
    axes = set()
    for entry in spec or ():
        if entry is None:
            continue
        axes |= set(entry) if isinstance(entry, tuple) else {entry}
    return axes


def _typed_spec(leaf):
    """The spec of ``leaf``'s explicit sharding (inside the jit), or None."""
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return spec if spec is not None and _axes_of(spec) else None


def block_spec_tree(x, block_specs):
    """Each leaf's block spec: ``block_specs`` (one ``PartitionSpec`` for every
    leaf, or a pytree of them shaped like ``x``), or by default (None) the
    explicit sharding of each leaf's type; ``P()`` where nothing shards it."""
    leaves, treedef = jax.tree.flatten(x)
    if block_specs is None:
        specs = [_typed_spec(leaf) or P() for leaf in leaves]
    else:
        specs = per_leaf(treedef, block_specs, lambda v: isinstance(v, P), "block_specs",
                         "a PartitionSpec")
    for leaf, spec in zip(leaves, specs, strict=True):
        if not isinstance(spec, P):
            raise ValueError(f"block_specs must hold PartitionSpecs, got {spec!r}")
        if len(spec) > jax.numpy.ndim(leaf):
            raise ValueError(f"block_specs: {spec} has more entries than a leaf of shape "
                             f"{jax.numpy.shape(leaf)} has dimensions")
    return treedef.unflatten(specs)


def over_blocks(run: Callable, x, block_specs, *shared, like_x=(), out_specs: Callable):
    """``run(x, *like_x, *shared)`` on each device's block of ``x`` along the
    mesh axes its block specs name (`block_spec_tree`), or as it is when none
    do.

    Args:
      run: the collective.
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
    axes = set()
    for spec in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)):
        axes |= _axes_of(spec)
    if not axes:
        return run(x, *like_x, *shared)
    in_specs = (specs, *[None if a is None else specs for a in like_x], *[P()] * len(shared))
    return jax.shard_map(run, in_specs=in_specs, out_specs=out_specs(specs),
                         axis_names=frozenset(axes))(x, *like_x, *shared)
