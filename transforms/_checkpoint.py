"""Restoring checkpointed training state onto a mesh, with a device-count check.

Transform states save as they are with orbax (``ocp.StandardCheckpointer``):
their leaves are arrays, ``optax.MaskedNode()`` stands where a leaf has no
state. Per-device leaves carry a leading axis of the device count, so a
checkpoint is tied to the number of devices along the data axis: restoring it
onto another count raises ValueError naming both (orbax alone reports only a
shape mismatch).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

from transforms._axes import AxisName

__all__ = ["restore_sharded"]


def restore_sharded(checkpointer: Any, path: str | os.PathLike[str], target: Any,
                    axis_name: AxisName) -> Any:
    """Restores ``path`` into the shapes and shardings of ``target``.

    Args:
      checkpointer: an orbax checkpointer with ``restore(path, target)`` and
        ``metadata(path)`` (e.g. ``ocp.StandardCheckpointer()``); qcollect
        does not import orbax itself.
      path: the checkpoint directory.
      target: a pytree like the one saved, already placed on the mesh (e.g.
        ``{"params": params, "opt_state": transforms.init_sharded(tx,
        params, mesh, axis_name)}``); only shapes, dtypes and shardings are
        read.
      axis_name: the data axis; per-device leaves are sharded along it.

    Returns:
      The restored pytree, placed like ``target``.

    Raises:
      ValueError: the checkpoint's per-device leaves were saved for another
        number of devices along ``axis_name`` (the message names both), or
        one of its JSON metadata files does not parse (a corrupted or
        truncated checkpoint; the message names the path and the file).
        orbax's own errors (a damaged array store names its file) pass
        through as they are.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, optax, qcollect as qc, transforms
      >>> import orbax.checkpoint as ocp
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = transforms.compressed_all_reduce("data", compressor=qc.onebit(),
      ...                                       key=jax.random.key(0))
      >>> state = transforms.init_sharded(tx, {"w": jnp.ones((8, 8))}, mesh, "data")
      >>> path = tempfile.mkdtemp() + "/ckpt"
      >>> ckpt = ocp.StandardCheckpointer()
      >>> ckpt.save(path, state); ckpt.wait_until_finished()
      >>> restored = transforms.restore_sharded(ckpt, path, state, "data")
      >>> bool((restored.feedback.residual["w"] == state.feedback.residual["w"]).all())
      True
    """
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), target)
    expected = _devices_along(target, axis_name)
    saved = _saved_devices_along(checkpointer, path, axis_name)
    if expected is not None and saved is not None and saved != expected:
        raise ValueError(
            f"the checkpoint at {path} holds per-device state for {saved} devices along "
            f"{axis_name!r}, but this mesh has {expected}: error-feedback residuals cannot "
            f"be re-split across another device count. Restore on {saved} devices, or "
            f"start the per-device state afresh (transforms.init_sharded).")
    try:
        return checkpointer.restore(path, abstract)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _corrupted(path, e) from e


def _corrupted(path: str | os.PathLike[str],
               error: json.JSONDecodeError | UnicodeDecodeError) -> ValueError:
    """The error for a checkpoint whose metadata JSON does not parse (or is
    not text), naming the file that holds what the parser read (where
    ``path`` is a local directory that has it)."""
    if isinstance(error, json.JSONDecodeError):
        found = _file_holding(path, error.doc.encode())
        what = f"is not valid JSON: {error.msg}, line {error.lineno} column {error.colno}"
    else:
        found = _file_holding(path, bytes(error.object))
        what = f"is not UTF-8 text ({error.reason} at byte {error.start})"
    return ValueError(
        f"the checkpoint at {path} is corrupted: its metadata file "
        f"{found or '(one of its JSON files)'} {what}. The checkpoint was cut short or "
        f"overwritten; restore an earlier one, or save it again.")


def _file_holding(path: str | os.PathLike[str], data: bytes) -> str | None:
    """The file under the local directory ``path`` whose bytes are ``data``, or None."""
    if not os.path.isdir(path):
        return None
    for root, _, files in os.walk(path):
        for name in sorted(files):
            file = os.path.join(root, name)
            if os.path.getsize(file) == len(data):
                with open(file, "rb") as f:
                    if f.read() == data:
                        return file
    return None


def _spec_axis(spec: Any) -> object:
    return spec[0] if spec is not None and len(spec) else None


def _devices_along(target: Any, axis_name: AxisName) -> int | None:
    """The leading size of the first leaf of ``target`` sharded along ``axis_name``."""
    for leaf in jax.tree.leaves(target):
        spec = getattr(getattr(leaf, "sharding", None), "spec", None)
        if _spec_axis(spec) == axis_name:
            return leaf.shape[0]
    return None


def _saved_devices_along(checkpointer: Any, path: str | os.PathLike[str],
                         axis_name: AxisName) -> int | None:
    """The same, read from the checkpoint's metadata (None if it cannot tell)."""
    try:
        meta = checkpointer.metadata(path)
    except Exception:  # noqa: BLE001 -- a checkpointer without metadata: no check
        return None
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "partition_spec", None)
        if _spec_axis(spec) == axis_name and getattr(leaf, "shape", None):
            return leaf.shape[0]
    return None
