"""User mistakes that JAX, orbax or a tree comparison would report without
naming the argument or the leaf: each raises a ValueError that names them
and says what to do."""

import functools
import os

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import mesh_of
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms


def _data_model_mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:8])


@pytest.mark.parametrize("spec, shape, match", [
    (P(None, "modle"), (8, 6),
     r"block_specs gives the leaf x\['w'\] .*names the axis 'modle', which the mesh does "
     r"not have \(its axes: 'data', 'model'\)"),
    (P(None, "data"), (8, 8),
     r"block_specs gives the leaf x\['w'\] .*names 'data', an axis the enclosing "
     r"jax.shard_map maps \(the data axis the collective reduces over\).*leave 'data' out"),
    (P(None, "model"), (8, 5),
     r"block_specs gives the leaf x\['w'\] of shape \(8, 5\) .*dimension 1 has size 5, "
     r"which 'model' \(2\) does not divide"),
])
def test_block_specs_naming_a_wrong_axis_name_the_leaf_and_the_axis(spec, shape, match):
    """An axis the mesh lacks, the data axis itself, or one whose size does
    not divide the leaf's dimension: raised before the nested shard_map
    (whose own errors name neither block_specs nor the leaf)."""
    mesh = _data_model_mesh()

    def per_data_device(w):
        g = {"w": lax.pcast(w, "data", to="varying"), "b": jnp.zeros(6)}
        return qc.compressed_all_reduce(g, "data", qc.qsgd(bits=4), jax.random.key(0),
                                        mean=True, block_specs={"w": spec, "b": P()}).value

    f = jax.jit(jax.shard_map(per_data_device, mesh=mesh, in_specs=P(), out_specs=P(),
                              axis_names={"data"}))
    with pytest.raises(ValueError, match=match):
        f(jnp.ones(shape))


def test_corrupted_checkpoint_metadata_names_the_checkpoint_and_the_file(tmp_path):
    """A truncated metadata JSON file: orbax raises a bare JSONDecodeError."""
    ocp = pytest.importorskip("orbax.checkpoint")
    mesh = mesh_of(4)
    tx = transforms.compressed_all_reduce("d", compressor=qc.onebit(), key=jax.random.key(0))
    state = transforms.init_sharded(tx, {"w": jnp.ones((8, 8))}, mesh, "d")
    path = str(tmp_path / "ckpt")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()
    metadata = os.path.join(path, "_METADATA")
    with open(metadata, "rb") as f:
        text = f.read()
    with open(metadata, "wb") as f:
        f.write(text[: len(text) // 2])
    with pytest.raises(ValueError, match=rf"checkpoint at {path} is corrupted: its metadata "
                                         rf"file {metadata} is not valid JSON"):
        transforms.restore_sharded(checkpointer, path, state, "d")


def test_nnx_gradients_missing_a_leaf_name_the_missing_leaf():
    """flax.nnx State: the gradient's paths end in ``.value`` where the state
    stops at the ``Param``; the message names the leaf that is missing, not
    the first leaf of both trees."""
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 8, rngs=rngs)
            self.b = nnx.Linear(8, 2, rngs=rngs)

    _, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
    mesh = mesh_of(2)
    tx = transforms.compressed_all_reduce("d", compressor=qc.qsgd(bits=4), min_size=0,
                                          key=jax.random.key(0))
    state = transforms.init_sharded(tx, params, mesh, "d")
    specs = transforms.state_specs(state, "d")
    grads = jax.tree.map(jnp.ones_like, params)
    del grads["a"]["bias"]

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs))
    def step(g, s):
        return tx.update(lax.pcast(g, "d", to="varying"), s)

    with pytest.raises(ValueError, match=r"not the one init saw \(error-feedback residuals\): "
                                         r"the leaf \['a'\]\['bias'\] is in the state but "
                                         r"missing from the update"):
        jax.eval_shape(step, grads, state)


def _diloco_step(tx, mesh, specs, replica_spec):
    def loss(p, x):
        return jnp.mean((x @ p["w"] + p["b"]) ** 2)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(replica_spec, specs, P("data")),
                       out_specs=(P("data"), specs))
    def step(replicas, state, x):
        p = transforms.local_replica(replicas, "data")
        updates, state = tx.update(jax.grad(loss)(p, x), state, p)
        return jax.tree.map(lambda a: a[None], optax.apply_updates(p, updates)), state

    return step


def test_diloco_replicas_not_stacked_are_told_apart_from_another_device_count():
    """One copy of the parameters where one replica per device belongs used to
    read as state "made for 64 devices" (the bias's width); a state made on
    another mesh keeps the device-count message."""
    n = 8
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
    tx = transforms.diloco("data", inner=optax.adamw(1e-3), every=4)
    params = {"w": jnp.zeros((32, 64)), "b": jnp.zeros((64,))}
    state = transforms.init_sharded(tx, params, mesh, "data")
    specs = transforms.state_specs(state, "data")
    x = jnp.ones((4 * n, 32))
    for replica_spec, how in ((P("data"), r"split over the 8 devices"),
                              (P(), r"the same on every device, spec P\(\)")):
        with pytest.raises(ValueError, match=rf"the per-device leaf \['b'\] is not stacked one "
                                             rf"replica per device: .*leading axis of size 8.*"
                                             rf"got shape \(64,\) \({how}.*jnp.stack"):
            jax.eval_shape(_diloco_step(tx, mesh, specs, replica_spec), params, state, x)
    half = jax.make_mesh((n // 2,), ("data",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[: n // 2])
    replicas = jax.tree.map(lambda a: jnp.stack([a] * (n // 2)), params)
    moved = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(half, s), specs))
    with pytest.raises(ValueError, match=r"inner optimizer state was made for 8 devices along "
                                         r"'data', but this mesh has 4"):
        jax.eval_shape(_diloco_step(tx, half, specs, P("data")), replicas, moved, x)
