"""Sharded training (FSDP): qc.fsdp_gather and transforms.fsdp against replicated
data parallelism, the collectives in the compiled step, error feedback."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms
from tests.helpers import mesh_of

N = 4


def _params():
    k = jax.random.split(jax.random.key(0), 3)
    return {"w1": 0.3 * jax.random.normal(k[0], (12, 32)),   # sharded on 1 (32)
            "w2": 0.3 * jax.random.normal(k[1], (32, 8)),    # sharded on 0
            "b": jnp.zeros(32)}                               # replicated


DIMS = {"w1": 1, "w2": 0, "b": None}


def _loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


@functools.cache
def _batches(rows, seed):
    k = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(k[0], (60, N * rows, 12))
    return x, jnp.sin(x[..., :8])


def _data(steps, rows=8, seed=1):
    """The first ``steps`` batches of one 60-step draw (a draw compiles per shape)."""
    x, y = _batches(rows, seed)
    assert steps <= len(x)
    return x[:steps], y[:steps]


def _fsdp_trainer(fsdp, opt, n=N, clip=None):
    """``(shards, fsdp_state, opt_state, step)``: the FSDP step of the docs."""
    mesh = mesh_of(n)
    shards = transforms.shard_params(_params(), mesh, "d", DIMS)
    opt_state = transforms.init_on_shards(opt, shards, mesh)
    fstate = transforms.init_sharded(fsdp, _params(), mesh, "d")
    specs = (transforms.sharded_specs(shards), transforms.state_specs(fstate, "d"),
             transforms.sharded_specs(opt_state))

    def body(shards, fstate, opt_state, x, y):
        (loss, grads), fstate = fsdp.value_and_grad(_loss)(shards, fstate, x, y)
        updates, opt_state = opt.update(grads, opt_state, shards)
        return (optax.apply_updates(shards, updates), fstate, opt_state,
                lax.pmean(loss, "d"), grads)

    jitted = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs + (P("d"), P("d")),
                                   out_specs=specs + (P(), specs[0])))

    def step(shards, fstate, opt_state, x, y):
        return jitted(shards, fstate, opt_state,
                      *jax.device_put((x, y), NamedSharding(mesh, P("d"))))

    step.jitted = jitted
    return shards, fstate, opt_state, step


def _replicated_trainer(opt):
    """Plain data parallelism with an uncompressed mean all-reduce."""
    mesh = mesh_of(N)

    def body(params, opt_state, x, y):
        loss, g = jax.value_and_grad(_loss)(lax.pcast(params, "d", to="varying"), x, y)
        g = lax.pmean(g, "d")
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "d"), g

    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    opt_state = jax.device_put(opt.init(params), NamedSharding(mesh, P()))
    jitted = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")),
                                   out_specs=(P(), P(), P(), P())))

    def step(params, opt_state, x, y):
        return jitted(params, opt_state, *jax.device_put((x, y), NamedSharding(mesh, P("d"))))

    return params, opt_state, step


def test_identity_fsdp_trains_as_replicated_data_parallelism():
    """Identity compressors: same gradients and, after AdamW steps with the
    sharded global-norm clip, the same parameters as replicated training."""
    opt = optax.chain(transforms.clip_by_global_norm(0.5, "d"), optax.adamw(1e-2))
    ref_opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
    fsdp = transforms.fsdp("d", dimension=DIMS, key=jax.random.key(0))
    shards, fstate, opt_state, step = _fsdp_trainer(fsdp, opt)
    params, ref_state, ref_step = _replicated_trainer(ref_opt)
    x, y = _data(4)
    for t in range(4):
        shards, fstate, opt_state, loss, grads = step(shards, fstate, opt_state, x[t], y[t])
        params, ref_state, ref_loss, ref_grads = ref_step(params, ref_state, x[t], y[t])
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        for name in params:
            np.testing.assert_allclose(np.asarray(grads[name]), np.asarray(ref_grads[name]),
                                       rtol=1e-4, atol=1e-6)
    for name in params:
        np.testing.assert_allclose(np.asarray(shards[name]), np.asarray(params[name]),
                                   rtol=1e-4, atol=1e-5)
    assert all(float(jnp.abs(r).max()) == 0.0 for r in jax.tree.leaves(fstate.residual))
    # Each device holds a quarter of every sharded leaf and of its moments.
    for name, d in DIMS.items():
        block = shards[name].addressable_shards[0].data.shape
        want = list(_params()[name].shape)
        if d is not None:
            want[d] //= N
        assert block == tuple(want)
        assert opt_state[1][0].mu[name].addressable_shards[0].data.shape == tuple(want)


def test_compiled_step_gathers_and_scatters_compressed_only():
    """The step's collectives: one all-gather of the int8 weights, the 4-bit
    gradient blocks' shifts, the replicated bias's psum and a 4-byte flag;
    no all-reduce of a gradient-sized buffer."""
    int8 = qc.qsgd(bits=8, bucket_size=32, stochastic=False)
    qsgd4 = qc.qsgd(bits=4, bucket_size=32)
    fsdp = transforms.fsdp("d", dimension=DIMS, key=jax.random.key(0), weights=int8,
                           gradients=qsgd4)
    shards, fstate, opt_state, step = _fsdp_trainer(fsdp, optax.sgd(0.1))
    x, y = _data(1)
    batch = jax.device_put((x[0], y[0]), NamedSharding(mesh_of(N), P("d")))
    ops = qc.wire_report(step.jitted, shards, fstate, opt_state, *batch)
    by_kind = {}
    for op in ops:
        by_kind[op.op] = by_kind.get(op.op, 0) + op.bytes_per_call * op.multiplicity
    params = _params()
    blocks = {"w1": params["w1"][:, :32 // N], "w2": params["w2"][:32 // N]}
    weights = sum(qc.payload_bytes(int8.encode(b)) for b in blocks.values())
    grads = sum(qc.payload_bytes(qsgd4.encode(b, jax.random.key(0))) for b in blocks.values())
    assert by_kind["all-gather"] == (N - 1) * weights
    assert by_kind["collective-permute"] == (N - 1) * grads
    assert by_kind["all-reduce"] <= 2 * 32 * 4 + 4 * 4  # the bias (f32[32]) and the flag
    full = sum(params[k].size * 4 for k in blocks)
    assert weights + grads < full / 4


@pytest.mark.parametrize("error_feedback", [transforms.residual_feedback(), None])
def test_compressed_fsdp_trains_and_keeps_residuals(error_feedback):
    fsdp = transforms.fsdp("d", dimension=DIMS, key=jax.random.key(0),
                           weights=qc.qsgd(bits=8, bucket_size=32, stochastic=False),
                           gradients=qc.qsgd(bits=2, bucket_size=32),
                           error_feedback=error_feedback)
    shards, fstate, opt_state, step = _fsdp_trainer(fsdp, optax.adam(1e-2))
    x, y = _data(60)
    losses = []
    for t in range(60):
        shards, fstate, opt_state, loss, _ = step(shards, fstate, opt_state, x[t], y[t])
        losses.append(float(loss))
    assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:5])
    res = np.asarray(fstate.residual["w1"])
    assert res.shape == ((N, 12, 32) if error_feedback else (N,))  # no residual stored
    assert (np.abs(res).max() > 0) == (error_feedback is not None)
    assert int(fstate.count) == 60


def test_non_finite_gradient_on_one_device_keeps_every_residual():
    fsdp = transforms.fsdp("d", dimension=DIMS, key=jax.random.key(0),
                           gradients=qc.onebit(bucket_size=32))
    shards, fstate, opt_state, step = _fsdp_trainer(fsdp, optax.sgd(0.0))
    x, y = _data(2)
    shards, fstate, opt_state, _, _ = step(shards, fstate, opt_state, x[0], y[0])
    before = jax.tree.map(np.asarray, fstate.residual)
    bad = x[1].at[3].set(jnp.inf)  # a row of device 0's batch
    _, after, _, _, _ = step(shards, fstate, opt_state, bad, y[1])
    for name in before:
        np.testing.assert_array_equal(np.asarray(after.residual[name]), before[name])


def test_apply_if_finite_skips_a_non_finite_step_on_every_device():
    """One device's batch holds an Inf: `transforms.apply_if_finite` skips the
    step on all devices (every shard and AdamW moment unchanged), counts it,
    applies a step past ``max_consecutive_errors`` as optax's does, and a
    finite step resets the count."""
    fsdp = transforms.fsdp("d", dimension=DIMS, key=jax.random.key(0),
                           gradients=qc.onebit(bucket_size=32))
    opt = transforms.apply_if_finite(optax.adamw(1e-2), "d", max_consecutive_errors=1)
    shards, fstate, opt_state, step = _fsdp_trainer(fsdp, opt)
    x, y = _data(3)
    shards, fstate, opt_state, _, _ = step(shards, fstate, opt_state, x[0], y[0])
    bad = x[1].at[3].set(jnp.inf)  # a row of device 0's batch
    kept, kept_f, skipped, _, _ = step(shards, fstate, opt_state, bad, y[1])
    for new, old in zip(jax.tree.leaves((kept, skipped.inner_state)),
                        jax.tree.leaves((shards, opt_state.inner_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
    assert (int(skipped.notfinite_count), bool(skipped.last_finite),
            int(skipped.total_notfinite)) == (1, False, 1)
    applied, _, again, _, _ = step(kept, kept_f, skipped, bad, y[1])
    assert int(again.notfinite_count) == 2 and not np.isfinite(np.asarray(applied["w1"])).all()
    trained, _, reset, _, _ = step(kept, kept_f, skipped, x[2], y[2])
    assert int(reset.notfinite_count) == 0 and int(reset.total_notfinite) == 1
    assert not np.array_equal(np.asarray(trained["w1"]), np.asarray(kept["w1"]))
    for wrong in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_consecutive_errors"):
            transforms.apply_if_finite(optax.sgd(0.1), "d", max_consecutive_errors=wrong)


def test_optax_clip_by_global_norm_on_shards_is_refused_by_name():
    """optax.clip_by_global_norm on shards clips by one device's norm and makes
    the replicated bias's update vary (before: shard_map's out_specs error
    for each leaf); init_on_shards names the leaf and the sharded clip."""
    mesh = mesh_of(N)
    shards = transforms.shard_params(_params(), mesh, "d", DIMS)
    bad = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    with pytest.raises(ValueError, match=r"replicated leaf \['b'\] varies across 'd'.*"
                                         r"transforms.clip_by_global_norm\(max_norm, 'd'\)"):
        transforms.init_on_shards(bad, shards, mesh)
    good = optax.chain(transforms.clip_by_global_norm(1.0, "d"), optax.adamw(1e-3))
    assert transforms.init_on_shards(good, shards, mesh)[1][0].mu["w1"].shape == (12, 32)


def test_differentiable_gather_over_two_axes():
    """(node, local): the gradient of the identity gather equals the mean
    gradient; the shards are those of P(("node", "local"))."""
    mesh = jax.make_mesh((2, 4), ("node", "local"), devices=jax.devices()[:8])
    axes = ("node", "local")
    w = jax.random.normal(jax.random.key(5), (16, 3))
    x = jax.random.normal(jax.random.key(6), (8, 5, 16))

    def body(shard, residual, x):
        def loss(s, r):
            full = qc.fsdp_gather(s, r, jax.random.key(0), axes, dimension=0)
            return jnp.sum(jnp.tanh(x[0] @ full) ** 2)
        return jax.grad(loss, argnums=(0, 1))(shard, residual)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
    sharding = NamedSharding(mesh, P(axes))
    g, r = f(*jax.device_put((w, jnp.zeros((8 * 16, 3)), x), sharding))
    xs = np.asarray(x)
    want = jax.grad(lambda w: sum(jnp.sum(jnp.tanh(xs[i] @ w) ** 2) for i in range(8)) / 8)(w)
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(r).max()) == 0.0


def test_dimensions_and_bad_input():
    dims = qc.shard_dimensions({"w": jnp.zeros((784, 2048)), "e": jnp.zeros((300, 7)),
                                "b": jnp.zeros(2048)}, 8, min_size=1000)
    assert dims == {"w": 1, "e": None, "b": 0}
    with pytest.raises(ValueError, match="n must be"):
        qc.shard_dimensions({"w": jnp.zeros(8)}, 0)
    with pytest.raises(ValueError, match="gradients"):
        transforms.fsdp("d", dimension=DIMS, key=jax.random.key(0), gradients="qsgd")
    with pytest.raises(ValueError, match="max_norm"):
        transforms.clip_by_global_norm(0.0, "d")
    mesh = mesh_of(2)
    wrong = jax.shard_map(
        lambda s, r: qc.fsdp_gather(s, r, jax.random.key(0), "d", dimension=0),
        mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    placed = jax.device_put((jnp.zeros((8, 3)), jnp.zeros((8, 5))), NamedSharding(mesh, P("d")))
    with pytest.raises(ValueError, match="residuals"):
        wrong(*placed)


def test_checkpoint_round_trip_resumes_bit_identically(tmp_path):
    """Shards, FSDP state (residuals, key, count) and the sharded optimizer
    state through orbax: two steps, save, restore, two more steps equal four
    uninterrupted ones bit for bit."""
    import orbax.checkpoint as ocp

    fsdp = transforms.fsdp("d", dimension=DIMS, key=jax.random.key(3),
                           weights=qc.qsgd(bits=8, bucket_size=32, stochastic=False),
                           gradients=qc.qsgd(bits=4, bucket_size=32))
    x, y = _data(4)
    shards, fstate, opt_state, step = _fsdp_trainer(fsdp, optax.adam(1e-2))
    straight = (shards, fstate, opt_state)
    for t in range(4):
        straight = step(*straight, x[t], y[t])[:3]
    resumed = (shards, fstate, opt_state)
    for t in range(2):
        resumed = step(*resumed, x[t], y[t])[:3]
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", resumed)
    ckpt.wait_until_finished()
    resumed = transforms.restore_sharded(ckpt, tmp_path / "ckpt", resumed, "d")
    for t in range(2, 4):
        resumed = step(*resumed, x[t], y[t])[:3]
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert straight[0]["w1"].sharding.spec == resumed[0]["w1"].sharding.spec


@pytest.mark.parametrize("n", [1, 3])
def test_bf16_leaves_and_odd_meshes(n):
    """bfloat16 shards on 1 and 3 devices: gradients in bfloat16, equal (to
    bfloat16 rounding) to the mean of the devices' own; a leaf too small to
    shard stays whole."""
    params = {"w": (0.1 * jax.random.normal(jax.random.key(0), (6, 8 * n))).astype(jnp.bfloat16),
              "b": jnp.zeros((2,), jnp.bfloat16)}
    dims = qc.shard_dimensions(params, n, min_size=8)
    assert dims == {"w": 1, "b": None}
    mesh = mesh_of(n)
    shards = transforms.shard_params(params, mesh, "d", dims)
    residuals = jax.device_put(jax.tree.map(lambda r: jnp.stack([r] * n),
                                            qc.fsdp_residuals(params, dims)),
                               NamedSharding(mesh, P("d")))
    x = jax.random.normal(jax.random.key(1), (n, 5, 6)).astype(jnp.bfloat16)

    def loss(p, x):
        return jnp.sum((x @ p["w"]).astype(jnp.float32) ** 2) + jnp.sum(p["b"].astype(jnp.float32))

    def body(s, r, x):
        def of(s, r):
            return loss(qc.fsdp_gather(s, r, jax.random.key(0), "d", dimension=dims), x[0])
        g, r = jax.grad(of, argnums=(0, 1))(s, jax.tree.map(lambda a: a[0], r))
        return g, jax.tree.map(lambda a: a[None], r)

    specs = transforms.shard_specs(dims, "d")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("d"), P("d")),
                              out_specs=(specs, P("d"))))
    g, _ = f(shards, residuals, jax.device_put(x, NamedSharding(mesh, P("d"))))
    assert g["w"].dtype == jnp.bfloat16 and g["w"].shape == (6, 8 * n)
    want = sum(jax.grad(loss)(params, x[i])["w"].astype(jnp.float32) for i in range(n)) / n
    np.testing.assert_allclose(np.asarray(g["w"], np.float32), np.asarray(want), rtol=2e-2,
                               atol=2e-2)
    np.testing.assert_allclose(np.asarray(g["b"], np.float32), 1.0)
