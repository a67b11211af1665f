"""Shared test helpers: meshes, shard_map wrappers and the data-parallel train steps."""

import functools
import importlib.util
import pathlib

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def normal(seed, shape, dtype=None):
    """Standard normal values of ``shape`` (float32, then cast to ``dtype``) as
    a JAX array: NumPy's draws from ``seed`` (an int or a sequence of ints).
    ``jax.random.normal`` called outside a jitted function compiles a program
    for each shape it draws, a third of a second or more on 2 cores."""
    import jax.numpy as jnp
    import numpy as np

    x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    return jnp.asarray(x if dtype is None else x.astype(dtype))


def integers(seed, shape, low, high, dtype=None):
    """Integers in ``[low, high)`` of ``shape`` (cast to ``dtype``) as a JAX
    array: NumPy's draws, as `normal`."""
    import jax.numpy as jnp
    import numpy as np

    x = np.random.default_rng(seed).integers(low, high, shape, dtype=np.int32)
    return jnp.asarray(x if dtype is None else x.astype(dtype))


def device_grads(seed, shapes: dict, scales: dict, n: int) -> dict:
    """Each device's gradient of each named leaf: ``scales[k]`` times standard
    normals of shape ``(n, *shapes[k])`` (NumPy float32), device ``i``'s at ``[i]``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return {k: (scales[k] * rng.standard_normal((n,) + s)).astype(np.float32)
            for k, s in shapes.items()}


def least_squares(n: int):
    """``(params, loss, x, y)``: a 16 x 4 linear model and its squared error,
    32 examples per device of ``n`` along a leading device axis."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 32, 16)).astype(np.float32)
    y = x @ rng.standard_normal((16, 4)).astype(np.float32)

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    return {"w": jnp.zeros((16, 4)), "b": jnp.zeros(4)}, loss, x, y


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


def placed(tx, params, n: int):
    """Replicated params and ``tx``'s state placed on ``n`` devices (residuals ``P("d")``)."""
    import transforms

    mesh = mesh_of(n)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    return params, transforms.init_sharded(tx, params, mesh, "d")


def sharded_step(tx, loss_fn, n: int, state, grad_fn=None):
    """The modern data-parallel step on ``n`` devices, jitted.

    ``step(params, state, x, y) -> (params, state, mean loss, update)``:
    params and the update replicated ``P()``, the state by
    `transforms.state_specs`, ``x`` and ``y`` split ``P("d")`` along a
    leading device axis. Gradients are each device's own (taken at
    ``lax.pcast(params, to="varying")``); ``grad_fn(p, x, y) -> (loss, g)``
    replaces ``jax.value_and_grad(loss_fn)``.
    """
    import optax
    from jax import lax

    import transforms

    specs = transforms.state_specs(state, "d")
    grad_fn = grad_fn or jax.value_and_grad(loss_fn)

    def body(params, state, x, y):
        loss, g = grad_fn(lax.pcast(params, "d", to="varying"), x[0], y[0])
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state, lax.pmean(loss, "d"), u

    return jax.jit(jax.shard_map(body, mesh=mesh_of(n), in_specs=(P(), specs, P("d"), P("d")),
                                 out_specs=(P(), specs, P(), P())))


def train_sharded(tx, loss_fn, params, x, y, steps: int, n: int, grad_fn=None):
    """Trains with ``tx`` for ``steps`` steps on ``n`` devices under ``jax.shard_map``.

    The canonical data-parallel loop: params replicated ``P()``, the state
    from `transforms.init_sharded` with `transforms.state_specs` as its
    specs, ``x`` and ``y`` split ``P("d")`` along their leading device axis,
    gradients taken at ``lax.pcast(params, "d", to="varying")`` (see
    `sharded_step`). Every step is awaited (XLA:CPU collectives; see README).

    Returns:
      ``(params, state, losses)``: the replicated params, the placed state and
      the mean loss over devices of every step (before its update).
    """
    params, state = placed(tx, params, n)
    x, y = jax.device_put((x, y), NamedSharding(mesh_of(n), P("d")))
    step = sharded_step(tx, loss_fn, n, state, grad_fn)
    losses = []
    for _ in range(steps):
        params, state, loss, _ = jax.block_until_ready(step(params, state, x, y))
        losses.append(float(loss))
    return params, state, losses


def sharded_update(tx, n: int, state):
    """``run(grads, state) -> (updates, state)``: ``tx.update`` on ``n`` devices, jitted.

    ``grads`` have a leading device axis (device ``i`` gets ``grads[i]``); the
    updates come back replicated, the state placed by `transforms.state_specs`.
    ``run.mapped`` is the jitted function (for `qcollect.wire_bytes`).
    """
    import transforms

    specs = transforms.state_specs(state, "d")
    mesh = mesh_of(n)

    def body(grads, state):
        return tx.update(jax.tree.map(lambda g: g[0], grads), state)

    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), specs),
                                   out_specs=(P(), specs)))

    def run(grads, state):
        return jax.block_until_ready(mapped(jax.device_put(grads, NamedSharding(mesh, P("d"))),
                                            state))

    run.mapped = mapped
    return run


def stacked(tree, n: int):
    """``n`` copies of every leaf along a new leading axis (the ``jax.pmap`` layout)."""
    import jax.numpy as jnp

    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + jnp.shape(a)), tree)


def pmap_train(tx, loss_fn, params, x, y, steps: int, n: int):
    """Trains with ``tx`` under `jax.pmap` on ``n`` devices (leading axis of x, y).

    Returns the replicated params, state and the per-step mean loss. Every step
    is awaited (XLA:CPU collectives; see README).
    """
    import optax
    from jax import lax

    @functools.partial(jax.pmap, axis_name="i", devices=jax.devices()[:n])
    def step(p, s, x, y):
        g = jax.grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, lax.pmean(loss_fn(p, x, y), "i")

    ps = stacked(params, n)
    st = stacked(jax.jit(tx.init)(params), n)
    losses = []
    for _ in range(steps):
        ps, st, loss = jax.block_until_ready(step(ps, st, x, y))
        losses.append(float(loss[0]))
    return ps, st, losses


def block(tree):
    """Inside ``shard_map``: this device's block of ``P("d")`` leaves, without the
    leading axis of size 1 (for state that really is per device, e.g. local SGD)."""
    return jax.tree.map(lambda a: a[0], tree)


def unblock(tree):
    """Inverse of `block`: the leading axis back, for ``out_specs=P("d")``."""
    import jax.numpy as jnp

    return jax.tree.map(lambda a: jnp.asarray(a)[None], tree)


def stacked_on_mesh(tree, n: int):
    """`stacked` copies placed ``P("d")`` on ``n`` devices: one replica per device."""
    return jax.device_put(stacked(tree, n), NamedSharding(mesh_of(n), P("d")))


def count_primitives(jaxpr, name: str) -> int:
    """Equations of primitive ``name`` in ``jaxpr`` and all its sub-jaxprs
    (``jit``, ``shard_map``, ``cond`` branches, loops): how often the
    traced program holds an operation."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    count += count_primitives(sub, name)
    return count


def example_script(name: str):
    """``examples/<name>.py`` loaded as a module (the examples are scripts,
    not a package)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
