"""Fusing the leaves of a pytree into flat buffers per dtype, and back."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from qcollect._config import check_int

#: Default cap of a fused buffer: small leaves ride together up to 4 MiB; a
#: leaf of 4 MiB or more is reduced on its own, without a concatenation copy.
BUCKET_BYTES = 4 << 20


def _buckets(keys, bucket_bytes: int | None) -> dict[str, list[int]]:
    """Leaf indices per buffer name, leaves in tree order.

    Per dtype, leaves fill a bucket until the next one would take it past
    ``bucket_bytes``; a leaf of ``bucket_bytes`` or more gets a bucket of its
    own (with ``bucket_bytes=0`` every leaf does, empty ones included), and
    smaller leaves after it may still join the open bucket. None: one bucket
    per dtype.
    """
    groups: dict[str, list[int]] = {}
    open_bucket: dict[str, tuple[str, int]] = {}  # dtype -> (name, bytes so far)
    for i, leaf in enumerate(keys):
        dtype = jnp.dtype(leaf.dtype)
        if bucket_bytes is None:
            groups.setdefault(dtype.name, []).append(i)
            continue
        size = math.prod(leaf.shape) * dtype.itemsize
        if size >= bucket_bytes:  # alone: never copied into a concatenation
            groups[f"{dtype.name}/{i}"] = [i]
            continue
        name, used = open_bucket.get(dtype.name, (None, 0))
        if name is None or used + size > bucket_bytes:
            name, used = f"{dtype.name}/{i}", 0
            groups[name] = []
        groups[name].append(i)
        open_bucket[dtype.name] = (name, used + size)
    return groups


def fuse_by_dtype(tree, group_like=None, *, separate: bool = False,
                  bucket_bytes: int | None = None
                  ) -> tuple[dict[str, jax.Array], Callable[[dict], object]]:
    """Concatenates the flattened leaves of ``tree`` into 1-D buffers per dtype.

    Args:
      tree: pytree of arrays.
      group_like: optional pytree of the same structure whose leaves decide
        the grouping (dtype and bytes), so a float32 residual of a bfloat16
        tree fuses into buffers keyed and ordered like the tree's own.
      separate: one buffer per leaf instead (``bucket_bytes=0``).
      bucket_bytes: cap of one buffer (see `BUCKET_BYTES`); None: one buffer
        per dtype.

    Returns:
      ``(buffers, unfuse)``: ``buffers`` maps a name (the dtype, or the dtype
      and the first leaf's index) to its 1-D buffer, leaves in tree order;
      ``unfuse(buffers_like)`` splits buffers of the same sizes back into a
      tree of the original structure, shapes and dtypes.
    """
    bucket_bytes = check_int("bucket_bytes", bucket_bytes, low=0, allow_none=True)
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    keys = leaves if group_like is None else [jnp.asarray(k) for k in jax.tree.leaves(group_like)]
    groups = _buckets(keys, 0 if separate else bucket_bytes)
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
