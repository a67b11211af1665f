"""Fusing the leaves of a pytree into one flat buffer per dtype, and back."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp


def fuse_by_dtype(tree, group_like=None, *, separate: bool = False
                  ) -> tuple[dict[str, jax.Array], Callable[[dict], object]]:
    """Concatenates the flattened leaves of ``tree`` into one 1-D buffer per dtype.

    Args:
      tree: pytree of arrays.
      group_like: optional pytree of the same structure whose leaf dtypes
        decide the grouping (so a float32 residual of a bfloat16 tree fuses
        into buffers keyed and ordered like the tree's own).
      separate: one buffer per leaf instead (keys ``"<dtype>/<leaf index>"``).

    Returns:
      ``(buffers, unfuse)``: ``buffers`` maps a dtype name to its 1-D buffer
      (leaves in tree order); ``unfuse(buffers_like)`` splits buffers of the
      same sizes back into a tree of the original structure, shapes and dtypes.
    """
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    keys = leaves if group_like is None else jax.tree.leaves(group_like)
    groups: dict[str, list[int]] = {}
    for i, leaf in enumerate(keys):
        name = jnp.dtype(leaf.dtype).name
        groups.setdefault(f"{name}/{i}" if separate else name, []).append(i)
    buffers = {}
    for name, members in groups.items():
        parts = [leaves[i].reshape(-1) for i in members]
        buffers[name] = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    shapes = [leaf.shape for leaf in leaves]

    def unfuse(fused: dict[str, jax.Array]):
        out = [None] * len(leaves)
        for name, members in groups.items():
            offset = 0
            for i in members:
                size = math.prod(shapes[i])
                out[i] = fused[name][offset:offset + size].reshape(shapes[i])
                offset += size
        return jax.tree.unflatten(treedef, out)

    return buffers, unfuse
