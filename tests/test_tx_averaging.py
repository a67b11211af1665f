"""transforms.compressed_model_averaging: local steps, compressed averages, wire, NaN."""

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
from tests.helpers import block, mesh_of, per_device, stacked, stacked_on_mesh, unblock

N = 8
EPS = np.finfo(np.float32).eps
ENTROPY = qc.entropy()  # one object, so compiled steps are shared
IDENTITY = qc.identity()


@functools.cache
def _update_step(every_k, compressor, min_size):
    """Jitted shard_map of one ``tx.update`` on N devices: (params, state, updates)."""
    tx = transforms.compressed_model_averaging("d", every_k=every_k, key=jax.random.key(3),
                                               compressor=compressor, min_size=min_size)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh_of(N), in_specs=P("d"), out_specs=P("d"))
    def step(params, state, updates):
        p, s, u = block((params, state, updates))
        u, s = tx.update(u, s, p)
        return unblock((u, s))

    return tx, step


def _shard(tree):
    return jax.device_put(tree, NamedSharding(mesh_of(N), P("d")))


def _tree(seed=0, big=2000, small=10):
    """Per-device weights that differ by replica, and per-device updates."""
    k = jax.random.split(jax.random.key(seed), 4)
    common = jax.random.normal(k[0], (big,))
    params = {"w": common + 0.3 * jax.random.normal(k[1], (N, big)),
              "b": jax.random.normal(k[2], (N, small))}
    updates = jax.tree.map(lambda a: 0.01 * jax.random.normal(k[3], a.shape), params)
    return params, updates


def _spec(tree):
    return jax.tree.structure(tree), jax.tree.map(lambda a: (a.shape, a.dtype), tree)


def _run(every_k, compressor, min_size, params, updates, steps):
    """``steps`` updates; checks that the state keeps its structure, shapes and dtypes."""
    tx, step = _update_step(every_k, compressor, min_size)
    state = stacked_on_mesh(tx.init(None), N)
    assert isinstance(state, transforms.ModelAveragingState)
    before, key0 = _spec(state), jax.random.key_data(state.key)
    params, updates = _shard((params, updates))
    outs = []
    for _ in range(steps):  # block every step (XLA:CPU collectives)
        out, state = jax.block_until_ready(step(params, state, updates))
        assert _spec(state) == before
        outs.append(jax.tree.map(np.asarray, out))
    np.testing.assert_array_equal(jax.random.key_data(state.key), key0)
    return outs, state


def _new_and_exact(params, updates, out):
    params, updates = jax.tree.map(np.asarray, (params, updates))
    new = jax.tree.map(lambda p, u: p + u, params, out)  # what optax.apply_updates does
    exact = jax.tree.map(lambda p, u: np.mean(p + u, axis=0), params, updates)
    return new, exact


def test_validation():
    make = functools.partial(transforms.compressed_model_averaging, "d", key=jax.random.key(0))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every_k"):
            make(every_k=bad)
    with pytest.raises(ValueError, match="min_size"):
        make(every_k=2, min_size=-1)
    with pytest.raises(ValueError, match="compressor"):
        make(every_k=2, compressor="entropy")
    tx = make(every_k=2)
    with pytest.raises(ValueError, match="params"):
        tx.update({"w": jnp.ones(3)}, tx.init({"w": jnp.ones(3)}))


def test_numpy_integers_are_settings_like_ints():
    tx = transforms.compressed_model_averaging("d", every_k=np.int64(2), key=jax.random.key(0),
                                               min_size=np.int64(16))
    assert int(tx.init({"w": jnp.ones(3)}).count) == 0


K = 3  # every_k of the shared steps: steps 0 and 1 local, step 2 averages


def _chunk_bound(w, floor):
    """Per value: half a bin of its origin chunks (mean over devices) + half an owner bin."""
    n, size = w.shape
    rows = -(-size // n)
    bound = np.zeros(size)
    for j in range(n):
        part = w[:, j * rows:(j + 1) * rows]
        origin = np.mean(part.max(axis=1) - part.min(axis=1))
        mean = part.mean(axis=0)
        bound[j * rows:(j + 1) * rows] = (origin + mean.max() - mean.min()) / 2 ** (floor + 1)
    return bound


def test_local_steps_pass_through_then_identity_is_exact_average():
    params, updates = _tree(1)
    outs, state = _run(K, IDENTITY, 100, params, updates, K)
    for out in outs[:-1]:  # bit for bit, no communication
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(updates), strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))
    new, exact = _new_and_exact(params, updates, outs[-1])
    ref = jax.jit(jax.shard_map(lambda p, u: lax.pmean(jax.tree.map(jnp.add, p, u), "d"),
                                mesh=mesh_of(N), in_specs=P("d"), out_specs=P()))(
        *_shard((params, updates)))
    for k in new:
        np.testing.assert_allclose(new[k], np.broadcast_to(exact[k], new[k].shape),
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(exact[k], np.asarray(ref[k])[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state.count), np.full(N, K))


def test_entropy_average_identical_and_within_bins():
    """Two quantizations (origin, owner), each at most half a bin, ``N >= floor = 6``.

    `_run` also checks that local and averaging steps keep the state's structure.
    """
    params, updates = _tree(3)
    outs, _ = _run(K, ENTROPY, 100, params, updates, K)
    for out in outs[:-1]:
        np.testing.assert_array_equal(out["w"], np.asarray(updates["w"]))
    new, exact = _new_and_exact(params, updates, outs[-1])
    w_all = np.asarray(params["w"]) + np.asarray(updates["w"])
    err = np.abs(new["w"] - exact["w"])
    bound = _chunk_bound(w_all, 6)
    assert (err <= bound + 1e-6).all(), (err - bound).max()
    assert 0 < err.max() < 0.1 * np.abs(exact["w"]).max()
    # The same decoded average everywhere; only params + (avg - params) rounds.
    spread = np.abs(new["w"] - new["w"][0]).max()
    assert spread <= 2 * EPS * np.abs(new["w"]).max(), spread
    # The small leaf (10 < min_size) is averaged exactly with pmean.
    np.testing.assert_allclose(new["b"], np.broadcast_to(exact["b"], new["b"].shape),
                               rtol=1e-6, atol=1e-6)


def test_entropy_bits_on_the_wire():
    """wire_bytes of a step == pairwise payloads + pmean; report bits per parameter."""
    big, small = 2**15, 10
    params, updates = _tree(4, big=big, small=small)
    c = ENTROPY
    tx, step = _update_step(K, c, 100)
    state = stacked_on_mesh(tx.init(None), N)
    wire = qc.wire_bytes(step, *_shard((params, state, updates)))
    chunk = -(-big // N)
    payload = qc.payload_bytes(jax.eval_shape(c.encode, jnp.zeros(chunk), jax.random.key(0)))
    pmean = 2 * (N - 1) / N * 4 * small
    # N - 1 chunk payloads to their owners + N - 1 hops of the owner's payload.
    assert wire == pytest.approx(2 * (N - 1) * payload + pmean, abs=1)
    w = (np.asarray(params["w"]) + np.asarray(updates["w"])).reshape(N * N, chunk)
    plans = jax.jit(jax.vmap(c.plan))(w, jax.random.split(jax.random.key(0), N * N))
    planned = [qc.payload_bytes(jax.eval_shape(c.with_plan((b, n)).encode, jnp.zeros(chunk)))
               for b, n in zip(np.asarray(plans.bits).tolist(), np.asarray(plans.words).tolist(),
                               strict=True)]
    needed, on_wire = 8 * np.mean(planned) / chunk, 8 * payload / chunk
    print(f"\nentropy(c=6, M=4, F=0.03, ceiling 10), {big} + {small} values, N={N}: "
          f"bit-widths {sorted(set(np.asarray(plans.bits).tolist()))}, planned payload "
          f"{needed:.2f} bits/value, unplanned payload {on_wire:.2f} bits/value; wire_bytes "
          f"{wire} per device = {8 * wire / (big + small):.2f} bits/parameter "
          f"(pmean of float32: {8 * 2 * (N - 1) / N * 4:.0f})")
    table = 8 * (12 + 4 * 2**10 / 8 + 4 * -(-chunk // 1024) + 4) / chunk
    assert needed < on_wire <= 10 + table
    assert 8 * wire / (big + small) < 0.5 * 8 * 2 * (N - 1) / N * 4


def _least_squares(every_k, steps, lr=0.3, dim=32, rows=64):
    """Local SGD on per-device least squares: entropy-averaged (JAX) and exact (numpy)."""
    k = jax.random.split(jax.random.key(5), 3)
    a = np.asarray(jax.random.normal(k[0], (N, rows, dim))) / np.sqrt(dim)
    x_true = np.asarray(jax.random.normal(k[1], (dim,)))
    b = a @ x_true + 0.3 * np.asarray(jax.random.normal(k[2], (N, rows)))  # replicas disagree
    x_star = np.linalg.lstsq(a.reshape(-1, dim), b.reshape(-1), rcond=None)[0]
    tx = optax.chain(optax.sgd(lr), transforms.compressed_model_averaging(
        "d", every_k=every_k, key=jax.random.key(6), compressor=ENTROPY, min_size=0))
    loss = lambda x, a, b: 0.5 * jnp.sum((a @ x - b) ** 2)  # noqa: E731

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh_of(N), in_specs=P("d"), out_specs=P("d"))
    def step(x, s, a, b):
        x, s, a, b = block((x, s, a, b))
        u, s = tx.update(jax.grad(loss)(x, a, b), s, x)
        return unblock((optax.apply_updates(x, u), s))

    x = stacked_on_mesh(jnp.zeros(dim), N)
    s = stacked_on_mesh(tx.init(jnp.zeros(dim)), N)
    a_d, b_d = _shard((jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)))
    for _ in range(steps):  # block every step (XLA:CPU collectives)
        x, s = jax.block_until_ready(step(x, s, a_d, b_d))

    def exact(k):
        x = np.zeros((N, dim))
        for t in range(steps):
            x = x - lr * np.einsum("nrd,nr->nd", a, np.einsum("nrd,nd->nr", a, x) - b)
            if (t + 1) % k == 0:
                x[:] = x.mean(axis=0)
        return x

    dist = lambda x: np.linalg.norm(x - x_star, axis=1) / np.linalg.norm(x_star)  # noqa: E731
    return np.asarray(x), dist(np.asarray(x)), dist(exact(every_k)), dist(exact(steps + 1)), \
        np.asarray(s[1].count)


@pytest.mark.slow  # a training run
def test_local_sgd_least_squares_converges():
    x, ours, exact, alone, count = _least_squares(5, 60)
    print(f"\nlocal SGD on 8 devices, every_k=5, 60 steps: relative distance to the global "
          f"least-squares solution {ours.max():.4f} (exact averaging {exact.max():.4f}, "
          f"no averaging {alone.min():.4f})")
    assert ours.max() <= exact.max() + 0.02
    assert ours.max() < 0.25 * alone.min()
    # Step 60 averages: every replica holds the same weights.
    assert np.abs(x - x[0]).max() <= 4 * EPS * np.abs(x).max()
    np.testing.assert_array_equal(count, np.full(N, 60))


@pytest.mark.parametrize("compressor", [ENTROPY, IDENTITY], ids=["entropy", "identity"])
def test_nan_replica_poisons_the_average_everywhere(compressor):
    params, updates = _tree(7)
    params = jax.tree.map(np.array, params)
    params["w"][3, 5] = np.nan
    params["b"][3, 0] = np.inf
    outs, state = _run(K, compressor, 100, params, updates, K)
    # Local steps: only replica 3's own update sees it (nothing is communicated).
    new = params["w"] + outs[0]["w"]
    assert np.isnan(new[3]).any() and np.isfinite(np.delete(new, 3, axis=0)).all()
    # Averaging step: no replica gets a silently finite average.
    for k in ("w", "b"):
        new = params[k] + outs[-1][k]
        assert all(not np.isfinite(new[d]).all() for d in range(N)), k
    np.testing.assert_array_equal(np.asarray(state.count), np.full(N, K))


def test_plan_too_small_gives_non_finite_average():
    """A per-leaf planned compressor whose stream overflows never averages silently."""
    params, updates = _tree(9)
    small_plan = ENTROPY.with_plan((6, 4))  # 128 bits for a 250-value chunk
    outs, _ = _run(1, lambda path, leaf: small_plan, 100, params, updates, 1)
    new = np.asarray(params["w"]) + outs[0]["w"]
    assert np.isnan(new).all()
    assert np.isfinite(np.asarray(params["b"]) + outs[0]["b"]).all()  # pmean leaf


def test_device_invariant_updates_under_shard_map():
    """Updates that do not depend on the device (zeros) still type-check in both phases."""
    tx = transforms.compressed_model_averaging("d", every_k=2, key=jax.random.key(0),
                                               compressor=IDENTITY, min_size=0)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh_of(N), in_specs=P("d"), out_specs=P("d"))
    def step(p, s):
        p, s = block((p, s))
        u, s = tx.update({"w": jnp.zeros(4)}, s, p)
        return unblock((u, s))

    p = _shard({"w": jnp.arange(4.0 * N).reshape(N, 4)})
    s = stacked_on_mesh(tx.init(None), N)
    u, s = jax.block_until_ready(step(p, s))
    np.testing.assert_array_equal(np.asarray(u["w"]), 0.0)
    u, s = jax.block_until_ready(step(p, s))
    np.testing.assert_allclose(np.asarray(p["w"]) + np.asarray(u["w"]),
                               np.broadcast_to(np.asarray(p["w"]).mean(axis=0), (N, 4)))


def _replica_step(tx, n):
    """The documented step: each device's replica by `transforms.local_replica`."""

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh_of(n), in_specs=P("d"), out_specs=P("d"))
    def step(params, opt_state):
        p, s = transforms.local_replica((params, opt_state), "d")
        u, s = tx.update(jax.tree.map(jnp.zeros_like, p), s, p)
        return unblock((optax.apply_updates(p, u), s))

    return step


def test_replicas_stacked_for_another_device_count_are_refused():
    """Four replicas placed by hand on two devices: ``a[0]`` kept two of them and
    averaged those (1.0 where the four average 1.5); `transforms.local_replica`
    refuses the blocks of two, naming both counts, and takes one replica each
    where the count is right."""
    tx = optax.chain(optax.sgd(0.1), transforms.compressed_model_averaging(
        "d", every_k=1, key=jax.random.key(0), compressor=IDENTITY))
    four = {"w": jnp.arange(4.0)[:, None] * jnp.ones((4, 8))}
    state = stacked(tx.init({"w": jnp.zeros(8)}), 4)
    placed = jax.device_put((four, state), NamedSharding(mesh_of(2), P("d")))
    with pytest.raises(ValueError, match=r"(?s)made for 4 devices along 'd', but this mesh "
                                         r"has 2.*init_sharded.*restore_sharded"):
        _replica_step(tx, 2)(*placed)
    placed = jax.device_put((four, state), NamedSharding(mesh_of(4), P("d")))
    params, _ = _replica_step(tx, 4)(*placed)
    np.testing.assert_allclose(np.asarray(params["w"]), 1.5)


def test_local_replica_needs_a_device_axis():
    @functools.partial(jax.shard_map, mesh=mesh_of(2), in_specs=P(), out_specs=P())
    def step(scalar):
        return transforms.local_replica({"count": scalar}, "d")["count"]

    with pytest.raises(ValueError, match=r"\['count'\] of shape \(\) has no leading device"):
        step(jnp.zeros([], jnp.int32))


def test_pmap():
    params, updates = _tree(8, big=64)
    tx = transforms.compressed_model_averaging("i", every_k=1, key=jax.random.key(0),
                                               compressor=qc.identity(), min_size=0)
    n = jax.local_device_count()
    params, updates = jax.tree.map(lambda a: a[:n], (params, updates))
    state = stacked(tx.init(None), n)
    out, _ = jax.pmap(lambda p, s, u: tx.update(u, s, p), axis_name="i")(params, state, updates)
    new, exact = _new_and_exact(params, updates, jax.tree.map(np.asarray, out))
    for k in new:
        np.testing.assert_allclose(new[k], np.broadcast_to(exact[k], new[k].shape),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shapes, match", [
    ({"w": (8,), "b": (3,), "z": (2,)}, r"not the tree of params.*\['z'\]"),  # extra leaf
    ({"w": (8,), "c": (3,)}, r"not the tree of params.*\['c'\] in the update, \['b'\]"),
    ({"w": (8,), "b": (4,)}, r"update of \['b'\] has shape \(4,\), but its params have shape "
                             r"\(3,\)"),
])
def test_updates_on_another_tree_than_params_name_the_leaf(shapes, match):
    """Updates whose tree or leaf shapes differ from params raise at trace time."""
    tx = transforms.compressed_model_averaging("d", every_k=1, key=jax.random.key(0),
                                               compressor=IDENTITY, min_size=0)
    split = NamedSharding(mesh_of(2), P("d"))

    def on_2(shape, dtype=jnp.float32):  # abstract, one replica per device: nothing compiles
        return jax.ShapeDtypeStruct((2,) + shape, dtype, sharding=split)

    state = jax.tree.map(lambda a: on_2(a.shape, a.dtype), jax.eval_shape(tx.init, None))
    params = {"w": on_2((8,)), "b": on_2((3,))}
    run = per_device(lambda u, s, p: tx.update(u, s, p)[0], 2)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(run.mapped, {k: on_2(s) for k, s in shapes.items()}, state, params)
