"""A transformation's per-leaf state, read back in ``update`` and checked.

``init`` makes one state entry per leaf, or ``optax.MaskedNode()`` where a
leaf keeps none. ``update`` reads the entries at the gradients' leaves
(`leaves_like`), takes this device's block of the per-device ones
(`read_per_device`), and raises a ValueError naming the leaf when an entry
is not the one ``init`` made for a leaf of that shape (`check_entries`).
After the step, `kept_per_device` stores the new values in the blocks they
arrived in, or keeps the old ones on a non-finite step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from transforms._axes import AxisName
from transforms._blocks import as_block, device_block, leaves_like
from transforms._finite import keep_if_finite

_ANOTHER_SHAPE = "the update's leaf has another shape than the one init saw"


def leaf_paths(tree: Any) -> list[str]:
    """The key path of every leaf of ``tree`` (flatten order), ``"the root"`` for a bare leaf."""
    return [jax.tree_util.keystr(path) or "the root"
            for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def zeros_or_masked(leaf: jax.Array, keep: bool) -> jax.Array | optax.MaskedNode:
    """float32 zeros like ``leaf`` (its sharding too, under explicit axes) where
    ``keep``, else ``optax.MaskedNode()``."""
    return jnp.zeros_like(leaf, jnp.float32) if keep else optax.MaskedNode()


def read_per_device(grads: optax.Updates, field: Any, axis_name: AxisName, what: str, *,
                    field_name: str, replicated: bool = False
                    ) -> tuple[list[Any], list[jax.Array | None]]:
    """A per-device state field at the leaves of ``grads``: ``(stored, values)``.

    ``stored`` are the entries as they arrived (blocks, or
    ``optax.MaskedNode()``); ``values`` this device's value of each, shaped
    like its leaf (`device_block`), None where masked.

    Args:
      grads: the update's gradients.
      field: the state field, a tree like the gradients made by ``init``.
      axis_name: the data axis.
      what: names one entry in errors: ``f"{what} of {path}"``.
      field_name: names the field in errors about the tree.
      replicated: the field is the same on every device (`device_block`).
    """
    stored = leaves_like(grads, field, field_name)
    values = [None if isinstance(entry, optax.MaskedNode)
              else device_block(entry, leaf, axis_name, f"{what} of {path}",
                                replicated=replicated)
              for entry, leaf, path in zip(stored, jax.tree.leaves(grads), leaf_paths(grads),
                                           strict=True)]
    return stored, values


def kept_per_device(new: list[Any], old: list[Any], stored: list[Any],
                    finite: jax.Array) -> list[Any]:
    """The new per-device entries in the block shapes ``stored`` arrived in;
    the old ones where ``finite`` is False; masked entries (``old`` None) stay
    as stored."""
    return [block if previous is None else as_block(keep_if_finite(finite, value, previous), block)
            for value, previous, block in zip(new, old, stored, strict=True)]


def _kept(entry: Any) -> bool:
    return entry is not None and not isinstance(entry, optax.MaskedNode)


def check_entries(path: str, leaf: jax.Array, compressed: bool, entries: dict[str, Any],
                  expected: dict[str, Any], owner: str) -> None:
    """Raises unless ``entries`` are what ``init`` made for a leaf like ``leaf``.

    Args:
      path: the leaf's key path, for the messages.
      leaf: the update's leaf.
      compressed: whether the update compresses the leaf.
      entries: name -> the leaf's entry of that state field (None or
        ``optax.MaskedNode()`` where there is none). The first is the
        residual, whose shape the message about compression reports.
      expected: name -> shape of the entries ``init`` keeps for such a leaf
        (None: not checked here); the others must be masked.
      owner: the transformation, for the messages (``"GradiVeQ"``).

    Raises:
      ValueError: an entry is kept where ``init`` keeps none or the other way
        round (the leaf is compressed now but was not, or the reverse), or a
        kept entry has another shape; the message names the leaf.
    """
    shape = tuple(jnp.shape(leaf))
    for name, entry in entries.items():
        if _kept(entry) != (name in expected):
            first, residual = next(iter(entries.items()))
            was = (f" (its {first} has shape {tuple(jnp.shape(residual))})"
                   if _kept(residual) else "")
            raise ValueError(f"the leaf {path} of shape {shape} is "
                             f"{'' if compressed else 'not '}compressed, but init saw it "
                             f"{'un' if compressed else ''}compressed{was}: {_ANOTHER_SHAPE}")
    for name, want in expected.items():
        got = tuple(jnp.shape(entries[name]))
        if want is not None and got != tuple(want):
            raise ValueError(f"the {owner} {name} of {path} has shape {got}, expected "
                             f"{tuple(want)} for the leaf of shape {shape}: {_ANOTHER_SHAPE}")
