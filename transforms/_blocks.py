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

from transforms._axes import AxisName, mesh_axes, tracks_varying, varies_along

__all__ = ["as_block", "device_block", "leaves_like", "local_replica"]


def device_block(stored: jax.Array, like: Any, axis_name: AxisName, what: str, *,
                 replicated: bool = False) -> jax.Array:
    """A per-device state leaf as this device's value, shaped like ``like``.

    ``stored`` is the block of a ``P(axis_name)`` leaf: ``(1, *shape)`` under
    ``shard_map``, ``(*shape)`` under ``jax.pmap`` or a plain ``tx.init``
    state. A block holding several devices' values means the state was made
    for another device count; that raises instead of silently keeping one.
    Inside ``shard_map`` a per-device leaf must arrive varying along
    ``axis_name`` (its spec ``P(axis_name)``); ``replicated=True`` marks a
    field kept the same on every device (EF21's estimate), which may not.

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
    if size and not replicated and _arrived_replicated(stored, axis_name):
        raise ValueError(
            f"{what} arrived the same on every device along {axis_name!r} (its shard_map "
            f"spec is P()), but it holds each device's own value: pass "
            f"transforms.state_specs(state, {axis_name!r}) as the state's in_specs and "
            f"out_specs, and make the state with transforms.init_sharded, not tx.init")
    return jnp.reshape(stored, jnp.shape(like))


def _arrived_replicated(stored: jax.Array, axis_name: AxisName) -> bool:
    """``stored`` is typed the same on every device inside ``shard_map`` over
    ``axis_name``; False under ``jax.pmap`` and outside any map over it (an
    update called on plain arrays), where there is nothing to check."""
    try:
        tracking = tracks_varying(axis_name)
    except ValueError:  # axis_name is not bound here
        return False
    return tracking and not varies_along(stored, axis_name)


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
    # Replicas stacked for another device count hold the same number of
    # replicas in every block; one copy of the tree, not stacked, is cut by
    # its leaves' own first dimensions (or arrives whole, the same everywhere).
    counts = {jnp.shape(leaf)[0] for leaf in jax.tree.leaves(tree) if jnp.ndim(leaf)}

    def take(path: Any, leaf: jax.Array) -> jax.Array:
        rows = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
        if rows != 1:
            what = f"the per-device leaf {jax.tree_util.keystr(path) or 'the root'}"
            if not rows:
                raise ValueError(f"{what} of shape {tuple(jnp.shape(leaf))} has no leading "
                                 f"device axis: stack one replica per device along "
                                 f"{axis_name!r} (P({axis_name!r}))")
            if len(counts) > 1 or not varies_along(leaf, axis_name):
                raise _not_stacked(what, leaf, axis_name)
            raise _another_device_count(what, rows, axis_name)
        return leaf[0]

    return jax.tree_util.tree_map_with_path(take, tree)


def _not_stacked(what: str, block: jax.Array, axis_name: AxisName) -> ValueError:
    """The error for a leaf of one copy of the parameters where a stack of
    one replica per device belongs."""
    n = math.prod(int(lax.axis_size(a)) for a in mesh_axes(axis_name))
    shape = tuple(jnp.shape(block))
    split = varies_along(block, axis_name)
    whole = (shape[0] * n, *shape[1:]) if split else shape
    how = (f"split over the {n} devices as ({shape[0]}, ...) blocks" if split
           else "the same on every device, spec P()")
    return ValueError(
        f"{what} is not stacked one replica per device: along {axis_name!r} ({n} devices) it "
        f"needs a leading axis of size {n}, ({n}, *shape), but got shape {whole} ({how}). "
        f"Stack the replicas, jax.tree.map(lambda a: jnp.stack([a] * {n}), params), place "
        f"them with P({axis_name!r}) and pass them to the step with in_specs P({axis_name!r}); "
        f"transforms.local_replica then gives each device its own.")


def leaves_like(tree: Any, stored: Any, what: str, *, against: str = "the one init saw",
                where: str = "the state",
                hint: str = "Initialise the state with the same parameter tree.") -> list[Any]:
    """``stored``'s entries at the leaves of ``tree`` (``flatten_up_to``).

    Raises:
      ValueError: the two trees differ (the update's gradients are not the
        tree ``init`` saw), naming the leaf missing from one of them, or the
        first path where they part.
    """
    treedef = jax.tree.structure(tree)
    try:
        return treedef.flatten_up_to(stored)
    except (ValueError, TypeError):
        pass
    got = [tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    saw = [tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        stored, is_leaf=lambda x: isinstance(x, optax.MaskedNode) or hasattr(x, "shape"))[0]]
    raise ValueError(f"the update's tree is not {against} ({what}): "
                     f"{_tree_difference(got, saw, where)} ({len(got)} leaves against "
                     f"{len(saw)}). {hint}")


def _unmatched(paths: list[tuple[Any, ...]], others: list[tuple[Any, ...]]) -> list[int]:
    """The indices of ``paths`` that no path of ``others`` leads to or through.

    A state stores an entry where the update has a leaf, but its flattening
    may stop above the update's leaf (a ``flax.nnx`` ``Param`` holds its
    array under ``.value``): a path matches when one of the two is a prefix
    of the other."""
    whole = set(others)
    prefixes = {o[:k] for o in others for k in range(len(o) + 1)}
    return [i for i, p in enumerate(paths)
            if p not in prefixes and not any(p[:k] in whole for k in range(len(p)))]


def _tree_difference(got: list[tuple[Any, ...]], saw: list[tuple[Any, ...]],
                     where: str) -> str:
    """Where the update's leaf paths ``got`` part from those of ``where``, ``saw``."""
    keystr = jax.tree_util.keystr

    def name(path: tuple[Any, ...]) -> str:
        return keystr(path) or "the root"

    def more(count: int) -> str:
        return f" (and {count - 1} more)" if count > 1 else ""

    extra, missing = _unmatched(got, saw), _unmatched(saw, got)
    if extra and missing:
        return (f"first difference at leaf {extra[0]}: {name(got[extra[0]])} in the update, "
                f"{name(saw[missing[0]])} in {where}")
    if missing:
        return (f"the leaf {name(saw[missing[0]])} is in {where} but missing from the "
                f"update{more(len(missing))}")
    if extra:
        return (f"the leaf {name(got[extra[0]])} is in the update but not in "
                f"{where}{more(len(extra))}")
    first = next((i for i, (a, b) in enumerate(zip(got, saw, strict=False)) if a != b),
                 min(len(got), len(saw)))
    here = name(got[first]) if first < len(got) else "(no more leaves)"
    there = name(saw[first]) if first < len(saw) else "(no more leaves)"
    return f"first difference at leaf {first}: {here} in the update, {there} in {where}"
