"""Shared test helpers: meshes and shard_map wrappers over the leading axis."""

import functools

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@functools.cache
def mesh_of(n: int):
    return jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])


def per_device(fn, n: int):
    """``fn`` of one device's slice, run on ``n`` devices over the leading axis.

    Inputs are pytrees whose leaves have a leading axis of size ``n``; outputs
    get one back, so replicas can be compared.
    """
    mesh = mesh_of(n)

    def body(*args):
        args = jax.tree.map(lambda a: a[0], args)
        return jax.tree.map(lambda a: a[None], fn(*args))

    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    def run(*args):
        sharding = NamedSharding(mesh, P("d"))
        return mapped(*jax.device_put(args, sharding))

    run.mapped = mapped
    run.shard = lambda *args: jax.device_put(args, NamedSharding(mesh, P("d")))
    return run
