"""`mean_all_reduce`: the uncompressed mean over the data axis.

The plain data-parallel all-reduce as a transformation, for the leaves a
leaf policy leaves uncompressed when ``optax.partition`` sends them to
another transformation than the compressed one (docs/transforms.md, "Leaf
policy"), and as the exact reference a compressed run is compared with.
"""

from __future__ import annotations

import functools

import optax

import qcollect as qc
from transforms._axes import AxisName, check_local_gradients
from transforms._policy import BlockSpecs

__all__ = ["mean_all_reduce"]


def mean_all_reduce(axis_name: AxisName, *,
                    block_specs: BlockSpecs = None) -> optax.GradientTransformation:
    """The exact mean of each device's gradients over ``axis_name``.

    The leaves are concatenated per dtype into 4 MiB buckets and each bucket
    is summed in one ``lax.psum`` (`qcollect.fused_psum`), in the gradients'
    own dtypes. Like the compressed transformations it takes this device's
    own gradients (differentiate at ``lax.pcast(params, axis_name,
    to="varying")``) and returns updates replicated along the axis. No state.

    Args:
      axis_name: the data axis (``shard_map`` or ``pmap``), or a tuple of axes.
      block_specs: with model-sharded parameters, each leaf's
        ``PartitionSpec`` (a tree like the gradients, or ``f(path, leaf)``),
        as for `compressed_all_reduce`.

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, transforms
      >>> tx = transforms.mean_all_reduce("data")
      >>> mean = jax.pmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data")
      >>> n = jax.device_count()
      >>> out = mean({"w": jnp.arange(n, dtype=jnp.float32)})   # device d holds d
      >>> bool((out["w"] == (n - 1) / 2).all())
      True
    """
    return optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        functools.partial(_update, axis_name=axis_name, block_specs=block_specs))


def _update(grads: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None,
            *, axis_name: AxisName,
            block_specs: BlockSpecs) -> tuple[optax.Updates, optax.EmptyState]:
    del params
    check_local_gradients(grads, axis_name)
    return qc.fused_psum(grads, axis_name, mean=True, block_specs=block_specs), state
