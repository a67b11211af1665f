"""Compressed data parallelism on a (data, model) mesh: the collectives inside
``shard_map(axis_names={"data"})`` with the model axis left to the compiler."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms

SPECS = {"w": P(None, "model"), "v": P("model", None)}


def _mesh(kind):
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind, kind),
                         devices=jax.devices()[:8])


def _grads(mesh):
    """Per data device ``(4, ...)`` gradients, model-sharded as `SPECS` say."""
    k = jax.random.split(jax.random.key(0), 2)
    g = {"w": jax.random.randint(k[0], (4, 48, 64), -8, 9).astype(jnp.float32),
         "v": jax.random.randint(k[1], (4, 64, 24), -8, 9).astype(jnp.float32)}
    return {name: jax.device_put(leaf, NamedSharding(mesh, P("data", *SPECS[name])))
            for name, leaf in g.items()}


def _reduce(mesh, compressor, block_specs):
    def body(g):
        g = jax.tree.map(lambda a: a[0], g)
        out = qc.compressed_all_reduce(g, "data", compressor, jax.random.key(1), mean=True,
                                       block_specs=block_specs)
        return out.value

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(),
                                 axis_names={"data"}))


def _pmean(mesh):
    return jax.jit(jax.shard_map(lambda g: lax.pmean(jax.tree.map(lambda a: a[0], g), "data"),
                                 mesh=mesh, in_specs=P("data"), out_specs=P(),
                                 axis_names={"data"}))


def _normal(spec):
    """``spec`` without trailing Nones (``P("model")`` is ``P("model", None)``)."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_each_device_reduces_its_model_block(kind):
    """Identity: the mean over the data axis, sharded as the input; no byte
    crosses the model axis, and the data axis carries what a data-only mesh
    carries for each device's blocks."""
    mesh = _mesh(kind)
    g = _grads(mesh)
    block_specs = SPECS if kind == AxisType.Auto else None  # explicit: read from the types
    with jax.set_mesh(mesh):
        f = _reduce(mesh, qc.identity(), block_specs)
        out = f(g)
        by_axis = qc.wire_bytes_by_axis(f, g, mesh=mesh)
        # What the program spends beside the all-reduce (the explicit mesh's
        # output placement), measured with lax.pmean in its place.
        beside = qc.wire_bytes_by_axis(_pmean(mesh), g, mesh=mesh)
    for name, leaf in g.items():
        np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(leaf).mean(0))
        assert _normal(out[name].sharding.spec) == _normal(SPECS[name])
    assert {a: b for a, b in by_axis.items() if a != "data"} == {
        a: b for a, b in beside.items() if a != "data"}
    # The same all-reduce on 4 devices of a data-only mesh, of one model block of each leaf.
    data_only = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    blocks = {"w": np.asarray(g["w"])[:, :, :32], "v": np.asarray(g["v"])[:, :32]}
    one_axis = jax.jit(jax.shard_map(
        lambda b: qc.compressed_all_reduce(jax.tree.map(lambda a: a[0], b), "data",
                                           qc.identity(), mean=True).value,
        mesh=data_only, in_specs=P("data"), out_specs=P()))
    placed = jax.device_put(blocks, NamedSharding(data_only, P("data")))
    assert by_axis["data"] == qc.wire_bytes(one_axis, placed)


def test_compressed_blocks_send_the_payload_bytes_on_the_data_axis_only():
    mesh = _mesh(AxisType.Auto)
    g = _grads(mesh)
    qsgd = qc.qsgd(bits=4, bucket_size=64)
    with jax.set_mesh(mesh):
        exact = qc.wire_bytes_by_axis(_reduce(mesh, qc.identity(), SPECS), g, mesh=mesh)
        packed = qc.wire_bytes_by_axis(_reduce(mesh, qsgd, SPECS), g, mesh=mesh)
        whole = qc.wire_bytes_by_axis(_reduce(mesh, qsgd, None), g, mesh=mesh)
    assert set(packed) == {"data"} and packed["data"] < exact["data"] / 5
    # Without block specs the compiler gathers the leaves along the model axis.
    assert whole.get("model", 0) > 0


def test_transform_trains_on_a_data_model_mesh_as_on_the_data_axis():
    """transforms.compressed_all_reduce with block_specs on (data=4, model=2),
    the model axis compiler-sharded: identity compression gives the same
    parameters as pmean data parallelism after three AdamW steps."""
    mesh = _mesh(AxisType.Auto)
    k = jax.random.split(jax.random.key(2), 2)
    params = {"w": 0.2 * jax.random.normal(k[0], (48, 64)),
              "v": 0.2 * jax.random.normal(k[1], (64, 24))}
    params = {n: jax.device_put(p, NamedSharding(mesh, SPECS[n])) for n, p in params.items()}
    x = jax.random.normal(jax.random.key(3), (3, 4 * 8, 48))

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"]) @ p["v"]) ** 2

    def trainer(comm):
        tx = optax.chain(comm, optax.adam(1e-2))
        with jax.set_mesh(mesh):
            state = transforms.init_sharded(tx, params, mesh, "data")
        specs = transforms.state_specs(state, "data")

        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                           out_specs=(P(), specs), axis_names={"data"})
        def step(p, s, x):
            g = jax.grad(loss)(lax.pcast(p, "data", to="varying"), x)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return step, state

    def pmean_tx():
        return optax.GradientTransformation(
            lambda p: optax.EmptyState(), lambda g, s, p=None: (lax.pmean(g, "data"), s))

    compressed, c_state = trainer(transforms.compressed_all_reduce(
        "data", compressor=qc.identity(), key=jax.random.key(0), block_specs=SPECS))
    reference, r_state = trainer(pmean_tx())
    p_c = p_r = params
    with jax.set_mesh(mesh):
        batches = [jax.device_put(x[t], NamedSharding(mesh, P("data"))) for t in range(3)]
        for batch in batches:
            p_c, c_state = compressed(p_c, c_state, batch)
            p_r, r_state = reference(p_r, r_state, batch)
        exact = qc.wire_bytes_by_axis(reference, p_r, r_state, batches[0], mesh=mesh)
        packed_step, packed_state = trainer(transforms.compressed_all_reduce(
            "data", compressor=qc.qsgd(bits=4, bucket_size=64), key=jax.random.key(0),
            block_specs=SPECS))
        packed = qc.wire_bytes_by_axis(packed_step, params, packed_state, batches[0], mesh=mesh)
    # The model axis carries the model's own reductions (the loss's mean over
    # sharded activations) and the finiteness flag of the blocks, no gradient.
    assert packed["model"] <= exact["model"] + 8
    assert packed["data"] < exact["data"] / 5
    for name in params:
        np.testing.assert_allclose(np.asarray(p_c[name]), np.asarray(p_r[name]),
                                   rtol=1e-5, atol=1e-6)


def test_bad_block_specs_name_themselves():
    mesh = _mesh(AxisType.Auto)
    g = _grads(mesh)
    for bad, match in (({"w": P(None, "model")}, "block_specs"),
                       ({"w": "model", "v": P()}, "PartitionSpecs"),
                       (P(None, None, "model"), "more entries")):
        with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
            _reduce(mesh, qc.identity(), bad)(g)


def test_fused_psum_sums_each_devices_blocks():
    """qc.fused_psum with block_specs: lax.pmean's values, no bucket gathered
    across the model axis (without them the concatenation of model-sharded
    leaves pulls them along it)."""
    mesh = _mesh(AxisType.Auto)
    g = _grads(mesh)

    def fused(block_specs):
        def body(g):
            return qc.fused_psum(jax.tree.map(lambda a: a[0], g), "data", mean=True,
                                 block_specs=block_specs)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(),
                                     axis_names={"data"}))

    with jax.set_mesh(mesh):
        out = fused(SPECS)(g)
        blocks = qc.wire_bytes_by_axis(fused(SPECS), g, mesh=mesh)
        whole = qc.wire_bytes_by_axis(fused(None), g, mesh=mesh)
        exact = qc.wire_bytes_by_axis(_pmean(mesh), g, mesh=mesh)
    for name, leaf in g.items():
        np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(leaf).mean(0))
        assert _normal(out[name].sharding.spec) == _normal(SPECS[name])
    assert blocks == exact and "model" not in blocks
    assert whole.get("model", 0) > 0


def test_transform_state_is_sharded_like_the_parameters():
    """init_sharded on model-sharded parameters: residuals P("data", *spec),
    moments as their parameters; the step keeps every placement, sends no
    gradient byte along the model axis (a model-sharded bias under min_size
    included, given by a callable block spec) and matches pmean."""
    mesh = _mesh(AxisType.Auto)
    specs = {"w": P(None, "model"), "b": P("model")}
    params = {"w": jnp.linspace(-1, 1, 48 * 64).reshape(48, 64), "b": jnp.linspace(0, 1, 64)}
    params = {n: jax.device_put(p, NamedSharding(mesh, specs[n])) for n, p in params.items()}
    x = jax.random.normal(jax.random.key(4), (4 * 8, 48))

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2)

    rule = lambda path, leaf: specs[path[-1].key]  # noqa: E731

    def trainer(comm):
        tx = optax.chain(comm, optax.adam(1e-2))
        state = transforms.init_sharded(tx, params, mesh, "data")
        sspecs = transforms.state_specs(state, "data")
        step = jax.jit(jax.shard_map(
            lambda p, s, x: (lambda g: tx.update(g, s, p))(
                jax.grad(loss)(lax.pcast(p, "data", to="varying"), x)),
            mesh=mesh, in_specs=(P(), sspecs, P("data")), out_specs=(P(), sspecs),
            axis_names={"data"}))
        return step, state

    packed, state = trainer(transforms.compressed_all_reduce(
        "data", compressor=qc.qsgd(bits=4, bucket_size=64), key=jax.random.key(0),
        min_size=100, block_specs=rule))
    assert _normal(state[0].feedback.residual["w"].sharding.spec) == ("data", None, "model")
    assert _normal(state[1][0].mu["w"].sharding.spec) == (None, "model")
    assert _normal(state[1][0].nu["b"].sharding.spec) == ("model",)
    exact, exact_state = trainer(transforms.compressed_all_reduce(
        "data", compressor=qc.identity(), key=jax.random.key(0), min_size=100,
        block_specs=rule))
    reference, ref_state = trainer(optax.GradientTransformation(
        lambda p: optax.EmptyState(), lambda g, s, p=None: (lax.pmean(g, "data"), s)))
    with jax.set_mesh(mesh):
        batch = jax.device_put(x, NamedSharding(mesh, P("data")))
        updates, new_state = packed(params, state, batch)
        by_axis = qc.wire_bytes_by_axis(packed, params, state, batch, mesh=mesh)
        mine, _ = exact(params, exact_state, batch)
        theirs, _ = reference(params, ref_state, batch)
        model_only = qc.wire_bytes_by_axis(reference, params, ref_state, batch, mesh=mesh)
    assert (_normal(new_state[0].feedback.residual["w"].sharding.spec)
            == _normal(state[0].feedback.residual["w"].sharding.spec))
    assert by_axis.get("model", 0) <= model_only.get("model", 0) + 8
    for name in params:
        np.testing.assert_allclose(np.asarray(mine[name]), np.asarray(theirs[name]),
                                   rtol=1e-6, atol=1e-7)


def test_replicated_leaves_reduce_apart_from_the_blocks():
    """A compressor group of model-sharded and replicated leaves: the
    replicated leaf is reduced whole, as without model axes (the same
    result on both model devices, which ``out_specs=P()`` checks, and the
    values of its own all-reduce), the blocks as blocks."""
    mesh = _mesh(AxisType.Auto)
    g = _grads(mesh)
    r = jax.device_put(jnp.linspace(-3, 3, 4 * 40).reshape(4, 40), NamedSharding(mesh, P("data")))
    qsgd = qc.qsgd(bits=4, bucket_size=64)
    specs = dict(SPECS, r=P())

    def body(g, r):
        g = dict(jax.tree.map(lambda a: a[0], g), r=r[0])
        key = jax.random.key(1)
        mixed = qc.compressed_all_reduce(g, "data", qsgd, key, mean=True, block_specs=specs)
        alone = qc.compressed_all_reduce([g["r"]], "data", qsgd, key, mean=True)
        return mixed.value, alone.value[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(),
                              axis_names={"data"}))
    with jax.set_mesh(mesh):
        mixed, alone = f(g, r)
    np.testing.assert_array_equal(np.asarray(mixed["r"]), np.asarray(alone))
    for name in SPECS:
        assert _normal(mixed[name].sharding.spec) == _normal(SPECS[name])
