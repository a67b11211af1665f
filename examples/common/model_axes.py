"""Compressed data parallelism on a ``(data, model)`` mesh for the examples' training loop.

`DataModelParallel` is a `common.train.DataParallel` whose mesh adds a
``"model"`` axis that the compiler shards (tensor parallelism, Megatron-LM's
layout: Shoeybi et al. 2019, section 3): a *column* layer's kernel is split
along its outputs and its bias with it, a *row* layer's kernel along its
inputs (bias replicated); everything else is replicated. Each model says
which of its layers are which (``model.tensor_parallel(names)``: the
layer's path names to ``"column"``, ``"row"`` or None).

The step is ``jax.shard_map(..., axis_names={"data"})`` inside ``jax.jit``:
the data axis is manual (each device's gradients, the compressed
all-reduce), the model axis automatic (the compiler shards the matmuls and
inserts the model axis's own collectives). The gradient all-reduce gets the
layers' specs as ``block_specs``, so every device compresses and sends its
own block of each leaf and nothing is gathered along the model axis for it
(`qcollect.block_spec_tree`). The optimizer moments and the error-feedback
residuals are sharded as the parameters they follow
(`transforms.init_sharded`).

The global batch is ``batch_size`` times the data axis (each model pair of
devices shares a data shard), so ``--model-parallel 2`` on 8 devices trains
on the same batches as 8 data-parallel devices with twice the batch size.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from common.compressors import Communication, communication
from common.train import DataParallel, on_every_device

DATA, MODEL = "data", "model"
LAYOUTS = {"column": {"kernel": P(None, MODEL), "bias": P(MODEL)},
           "row": {"kernel": P(MODEL, None), "bias": P()}}


def model_mesh(model_devices: int):
    """A ``(data, model)`` mesh of every device: ``model_devices`` per model group.

    Example:
      >>> mesh = model_mesh(2)
      >>> dict(mesh.shape) == {"data": jax.device_count() // 2, "model": 2}
      True
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if model_devices < 1 or len(devices) % model_devices:
        raise ValueError(f"model_parallel: {len(devices)} devices cannot form groups of "
                         f"{model_devices}")
    return jax.sharding.Mesh(np.asarray(devices).reshape(-1, model_devices), (DATA, MODEL))


def path_names(path) -> tuple:
    """The readable names of a parameter's key path (NNX state paths end in ``.value``).

    Example:
      >>> path = (jax.tree_util.DictKey("blocks"), jax.tree_util.DictKey(0),
      ...         jax.tree_util.DictKey("up"), jax.tree_util.GetAttrKey("value"))
      >>> path_names(path)
      ('blocks', 0, 'up')
    """
    names = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path)
    return names[:-1] if names and names[-1] == "value" else names


class DataModelParallel(DataParallel):
    """Data parallelism over ``"data"`` of a model sharded over ``"model"`` (module docstring).

    Args:
      model: an ``nnx.Module`` with a ``tensor_parallel(names)`` method.
      mesh: a `model_mesh`.
    """

    def __init__(self, model, mesh):
        if not hasattr(model, "tensor_parallel"):
            raise ValueError(f"model_parallel: {type(model).__name__} has no tensor_parallel "
                             "layout (the MLP and the GPT have)")
        self.role = model.tensor_parallel
        super().__init__(model, mesh)
        self.axis = DATA
        self.num_devices = mesh.shape[DATA]  # data replicas: the batch scales with them
        self.model_devices = mesh.shape[MODEL]

    def block_spec(self, path, leaf) -> P:
        """The spec of one parameter (module docstring); ``P()`` where the
        split dimension does not divide by the model axis."""
        names = path_names(path)
        layout = LAYOUTS.get(self.role(names[:-1]) if names else None, {})
        spec = layout.get(names[-1] if names else None, P())
        dims = [d for d, entry in enumerate(spec) if entry is not None]
        if any(d >= np.ndim(leaf) or np.shape(leaf)[d] % self.model_devices for d in dims):
            return P()
        return spec

    def specs(self, tree):
        return jax.tree_util.tree_map_with_path(self.block_spec, tree)

    def communication(self, name: str, cfg, key) -> Communication:
        """The all-reduce of ``name`` on each device's model blocks."""
        return communication(name, cfg, self.axis, key, block_specs=self.block_spec)

    def place(self, params):
        """``params`` (or a subtree with the same paths) on the mesh, model-sharded."""
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: jax.device_put(leaf, NamedSharding(self.mesh,
                                                                  self.block_spec(path, leaf))),
            params)

    def full(self, params):
        """The whole parameters, replicated on every device (for evaluation)."""
        return on_every_device(params, self.mesh)

    def manual(self, body, in_specs, out_specs, *, replicated: bool = True):
        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                                     out_specs=out_specs, check_vma=replicated,
                                     axis_names={self.axis}))
