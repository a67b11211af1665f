"""Per-device state inside the step: each device's block, checked.

A per-device leaf is stored with a leading device axis and sharded
``P(axis_name)`` (`transforms.init_sharded`). Inside the mapped step it is
this device's block: ``(1, *shape)`` under ``shard_map``, ``(*shape)``
under ``jax.pmap`` (where the whole state is stacked, pmap-style). The
transformations accept both (`device_block`) and hand back the block shape
they received (`as_block`). A block that holds several devices' values
means the state was made for another device count; that raises, naming
both counts, instead of silently keeping one.

* `local_replica(tree, axis_name)`: each device's replica of a tree stacked
  one replica per device (model averaging, DiLoCo), checked against the
  device count.
* `leaves_like(tree, stored, what)`: a state field's entries at the leaves
  of the update's tree, or an error naming the first leaf where they part.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from transforms._axes import AxisName, mesh_axes, tracks_varying

__all__ = ["as_block", "device_block", "leaves_like", "local_replica"]


def device_block(stored: jax.Array, like: Any, axis_name: AxisName, what: str) -> jax.Array:
    """A per-device state leaf as this device's value, shaped like ``like``.

    ``stored`` is the block of a ``P(axis_name)`` leaf: ``(1, *shape)`` under
    ``shard_map``, ``(*shape)`` under ``jax.pmap`` or a plain ``tx.init``
    state. A block holding several devices' values means the state was made
    for another device count; that raises instead of silently keeping one.

    Raises:
      ValueError: ``stored`` holds another shape than ``like``'s (with or
        without a leading axis of 1); the message names ``what`` and says
        whether the state was made for another device count or not placed.
    """
    size = int(np.prod(jnp.shape(like), dtype=np.int64))
    stored_size = int(np.prod(jnp.shape(stored), dtype=np.int64))
    shape = tuple(jnp.shape(like))
    if stored_size != size or tuple(jnp.shape(stored)) not in (shape, (1,) + shape):
        if size and stored_size % size == 0 and stored_size > size:
            raise _another_device_count(what, stored_size // size, axis_name)
        stored_shape = tuple(jnp.shape(stored))
        if stored_shape[1:] == shape[1:] and stored_shape[:1] != shape[:1]:
            raise ValueError(
                f"{what} has shape {stored_shape} on this device, expected {shape} with a "
                f"leading device axis of 1: the state was not placed per device, so the "
                f"step cut the leaf itself across the devices. Make it with "
                f"transforms.init_sharded (or restore it with transforms.restore_sharded), "
                f"not tx.init")
        raise ValueError(f"{what} has shape {stored_shape}, expected "
                         f"{shape} (or with a leading device axis of 1): "
                         f"the update's leaf has another shape than the one init saw")
    return jnp.reshape(stored, jnp.shape(like))


def as_block(value: jax.Array, stored: jax.Array) -> jax.Array:
    """``value`` back in the block shape ``stored`` arrived in."""
    return jnp.reshape(value, jnp.shape(stored))


def _another_device_count(what: str, rows: int, axis_name: AxisName) -> ValueError:
    """The error for a per-device block of ``rows`` devices' values (not 1)."""
    n = math.prod(int(lax.axis_size(a)) for a in mesh_axes(axis_name))
    return ValueError(
        f"{what} was made for {n * rows} devices along {axis_name!r}, but this mesh has "
        f"{n}: each device's block holds {rows} devices' values. Place per-device values "
        f"with one row per device: transforms.init_sharded for a new state, "
        f"transforms.restore_sharded for a checkpoint (it checks the count).")


def local_replica(tree: Any, axis_name: AxisName) -> Any:
    """This device's replica of a tree stacked one replica per device.

    Where the replicas really differ (`transforms.compressed_model_averaging`,
    `transforms.diloco`), the parameters (and the inner optimizer's state)
    are stacked along a leading device axis and sharded ``P(axis_name)``;
    inside ``jax.shard_map`` each leaf arrives as a ``(1, *shape)`` block.
    This returns the blocks without that axis, and raises where a block
    holds several replicas (a tree stacked for another device count, which
    ``a[0]`` would silently cut down to one replica per device). Under
    ``jax.pmap`` leaves already are the device's own and come back as they are.

    Args:
      tree: the step's per-device arguments (parameters, optimizer state).
      axis_name: the data axis they are stacked along.

    Returns:
      ``tree`` with each leaf's leading axis of size 1 removed.

    Raises:
      ValueError: a leaf has no leading axis, or one of another size than 1;
        the message names the leaf and both device counts.

    Example:
      >>> import functools, jax, jax.numpy as jnp, transforms
      >>> n = jax.device_count()
      >>> mesh = jax.make_mesh((n,), ("data",))
      >>> @jax.jit
      ... @functools.partial(jax.shard_map, mesh=mesh, in_specs=jax.P("data"),
      ...                    out_specs=jax.P("data"))
      ... def norms(replicas):
      ...     w = transforms.local_replica(replicas, "data")["w"]  # (3, 4): this device's
      ...     return jnp.linalg.norm(w)[None]
      >>> replicas = jax.device_put({"w": jnp.ones((n, 3, 4))},
      ...                           jax.NamedSharding(mesh, jax.P("data")))
      >>> norms(replicas).shape == (n,)
      True
    """
    if not tracks_varying(axis_name):
        return tree

    def take(path: Any, leaf: jax.Array) -> jax.Array:
        rows = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
        if rows != 1:
            what = f"the per-device leaf {jax.tree_util.keystr(path) or 'the root'}"
            if not rows:
                raise ValueError(f"{what} of shape {tuple(jnp.shape(leaf))} has no leading "
                                 f"device axis: stack one replica per device along "
                                 f"{axis_name!r} (P({axis_name!r}))")
            raise _another_device_count(what, rows, axis_name)
        return leaf[0]

    return jax.tree_util.tree_map_with_path(take, tree)


def leaves_like(tree: Any, stored: Any, what: str, *, against: str = "the one init saw",
                where: str = "the state",
                hint: str = "Initialise the state with the same parameter tree.") -> list[Any]:
    """``stored``'s entries at the leaves of ``tree`` (``flatten_up_to``).

    Raises:
      ValueError: the two trees differ (the update's gradients are not the
        tree ``init`` saw), naming the first path where they part.
    """
    treedef = jax.tree.structure(tree)
    try:
        return treedef.flatten_up_to(stored)
    except (ValueError, TypeError):
        pass
    keystr = jax.tree_util.keystr
    got = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    saw = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        stored, is_leaf=lambda x: isinstance(x, optax.MaskedNode) or hasattr(x, "shape"))[0]]
    first = next((i for i, (a, b) in enumerate(zip(got, saw, strict=False)) if a != b),
                 min(len(got), len(saw)))
    here = got[first] if first < len(got) else "(no more leaves)"
    there = saw[first] if first < len(saw) else "(no more leaves)"
    raise ValueError(f"the update's tree is not {against} ({what}): first difference "
                     f"at leaf {first}: {here or 'the root'} in the update, {there or 'the root'} "
                     f"in {where} ({len(got)} leaves against {len(saw)}). {hint}")
