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


def pmap_train(tx, loss_fn, params, x, y, steps: int, n: int):
    """Trains with ``tx`` under `jax.pmap` on ``n`` devices (leading axis of x, y).

    Returns the replicated params, state and the per-step mean loss. Every step
    is awaited (XLA:CPU collectives; see README).
    """
    import optax
    from jax import lax

    import transforms

    @functools.partial(jax.pmap, axis_name="i", devices=jax.devices()[:n])
    def step(p, s, x, y):
        g = jax.grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, lax.pmean(loss_fn(p, x, y), "i")

    ps = transforms.replicate(params, num_devices=n)
    st = transforms.replicate(jax.jit(tx.init)(params), num_devices=n)
    losses = []
    for _ in range(steps):
        ps, st, loss = jax.block_until_ready(step(ps, st, x, y))
        losses.append(float(loss[0]))
    return ps, st, losses
