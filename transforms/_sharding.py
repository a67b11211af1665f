"""Per-device state and replicas for `jax.shard_map` and `jax.pmap`.

Compressed collectives return values that agree on every device but that
``shard_map``'s type check sees as varying along the data axis (only
``lax.psum`` yields values it knows to be replicated). Error-feedback
residuals really do differ per device. So parameters and optimizer state
travel the pmap way: every leaf has a leading device axis of size N, sharded
``P(axis_name)``; inside the mapped step each device sees its own block.

* `replicate(tree, mesh, axis_name)`: N copies along a new leading axis,
  placed ``P(axis_name)`` on ``mesh`` (or, with ``mesh=None``, stacked for
  `jax.pmap` over ``jax.local_device_count()`` devices).
* `local(tree)` / `unlocal(tree)`: inside ``shard_map``, drop / restore the
  leading block axis of size 1.
* `first(tree)`: the replica of device 0, e.g. for evaluation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["first", "local", "replicate", "unlocal"]


def replicate(tree, mesh=None, axis_name: str | None = None, *, num_devices: int | None = None):
    """Stacks ``num_devices`` copies of every leaf along a new leading axis.

    Args:
      tree: pytree of arrays (parameters, ``tx.init(params)``...).
      mesh: a `jax.sharding.Mesh`; the result is placed ``P(axis_name)``.
        None: plain stacked arrays for `jax.pmap`.
      axis_name: the data axis of ``mesh`` (required with a mesh).
      num_devices: copies; defaults to the mesh axis size, or to
        ``jax.local_device_count()`` without a mesh.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> params = replicate({"w": jnp.zeros(3)}, mesh, "data")
      >>> params["w"].shape == (jax.device_count(), 3)
      True
    """
    if mesh is not None:
        if axis_name is None:
            raise ValueError("axis_name is required with a mesh")
        n = mesh.shape[axis_name] if num_devices is None else num_devices
    else:
        n = jax.local_device_count() if num_devices is None else num_devices
    stacked = jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a), (n,) + jnp.shape(a)), tree)
    if mesh is None:
        return stacked
    sharding = NamedSharding(mesh, P(axis_name))
    if jax.process_count() == 1:
        return jax.device_put(stacked, sharding)
    return jax.tree.map(lambda a: _global_copies(a, sharding), stacked)


def _global_copies(stacked, sharding):
    """A ``P(axis)`` array over all processes' devices from this process's copy.

    ``device_put`` onto devices of other processes is not allowed, so each
    process fills its own shards (every process holds the same values).
    PRNG key arrays travel as their key data.
    """
    is_key = jax.dtypes.issubdtype(stacked.dtype, jax.dtypes.prng_key)
    host = np.asarray(jax.random.key_data(stacked) if is_key else stacked)
    out = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.random.wrap_key_data(out, impl=jax.random.key_impl(stacked)) if is_key else out


def local(tree):
    """Inside ``shard_map``: this device's block without its leading axis of size 1."""
    return jax.tree.map(lambda a: a[0], tree)


def unlocal(tree):
    """Inverse of `local`: adds the leading block axis back for ``out_specs=P(axis)``."""
    return jax.tree.map(lambda a: jnp.asarray(a)[None], tree)


def first(tree):
    """One replica of a replicated tree (on the host side, e.g. for evaluation).

    Reads the first addressable shard, so it works for arrays sharded
    ``P(axis_name)`` (where indexing outside jit is not allowed) and across
    processes.
    """

    def take(a):
        shards = getattr(a, "addressable_shards", None)
        return shards[0].data[0] if shards else a[0]

    return jax.tree.map(take, tree)
