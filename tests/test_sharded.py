"""compressed_reduce_scatter and compressed_all_gather: against psum_scatter and
all_gather, error feedback, the bytes in the compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
from tests.helpers import integers, normal, per_device


def _integer_valued(seed, shape, dtype=jnp.float32):
    """Small integers: every sum is exact, so any summation order agrees."""
    return integers(seed, shape, -8, 9, dtype)


def _tree(n, blocks, seed=0):
    """Leaves of different shapes, scales, dtypes and sharded dimensions."""
    tree = {"w": _integer_valued((seed, 0), (n, n * blocks, 3)),
            "v": 100.0 * _integer_valued((seed, 1), (n, 5, n * blocks)),
            "b": _integer_valued((seed, 2), (n, n * blocks), jnp.bfloat16),
            "e": jnp.zeros((n, 0, n * blocks))}
    dims = {"w": 0, "v": 1, "b": 0, "e": 1}
    return tree, dims


def _keys(n):
    return jnp.stack([jax.random.key(0)] * n)


def _float64(a):
    return np.asarray(a).astype(np.float64)


@settings(max_examples=6, deadline=None)  # two compiles per example
@given(n=st.sampled_from([1, 2, 3, 4, 8]), blocks=st.integers(1, 5),
       exchange=st.sampled_from(qc.EXCHANGES), seed=st.integers(0, 99))
def test_identity_equals_psum_scatter_and_all_gather(n, blocks, exchange, seed):
    """Against ``lax.psum_scatter(tiled=True)`` and ``lax.all_gather(tiled=True)``
    written in numpy (`test_identity_scatter_and_gather_are_the_lax_collectives`
    runs the two lax collectives): device ``i`` holds block ``i`` of the sum
    along the scattered dimension; gathered, every device holds the blocks
    of all, in device order. Small integers: every sum is exact."""
    tree, dims = _tree(n, blocks, seed)
    scatter = per_device(lambda t, key: qc.compressed_reduce_scatter(
        t, "d", qc.identity(), key, scatter_dimension=dims, exchange=exchange), n)
    out = scatter(tree, _keys(n))
    for name in tree:
        assert out.value[name].dtype == tree[name].dtype
        total = _float64(tree[name]).sum(0)
        want = np.stack(np.split(total, n, axis=dims[name]))
        np.testing.assert_array_equal(_float64(out.value[name]), want)
        np.testing.assert_array_equal(np.asarray(out.contributed[name]),
                                      np.asarray(tree[name]))
    gather = per_device(lambda t: qc.compressed_all_gather(
        t, "d", qc.identity(), gather_dimension=dims).value, n)
    got = gather(out.value)
    for name in tree:
        whole = np.concatenate(list(_float64(out.value[name])), axis=dims[name])
        assert got[name].dtype == tree[name].dtype
        np.testing.assert_array_equal(_float64(got[name]), np.stack([whole] * n))


def test_identity_scatter_and_gather_are_the_lax_collectives():
    """The numpy references of the property above are ``lax.psum_scatter``
    and ``lax.all_gather`` (tiled) on the same tree."""
    n = 3
    tree, dims = _tree(n, 2, seed=1)

    def both(t):
        scattered = {k: lax.psum_scatter(a, "d", scatter_dimension=dims[k], tiled=True)
                     for k, a in t.items()}
        return scattered, {k: lax.all_gather(a, "d", axis=dims[k], tiled=True)
                           for k, a in scattered.items()}
    scattered, gathered = per_device(both, n)(tree)
    for name in tree:
        total = _float64(tree[name]).sum(0)
        np.testing.assert_array_equal(_float64(scattered[name]),
                                      np.stack(np.split(total, n, axis=dims[name])))
        np.testing.assert_array_equal(_float64(gathered[name]), np.stack([total] * n))


@pytest.mark.parametrize("compressor", [qc.qsgd(bits=4, bucket_size=8), qc.onebit(),
                                        qc.cast(jnp.bfloat16)], ids=lambda c: c.name)
def test_owner_sums_what_every_device_contributed(compressor):
    """The shard is the sum of the devices' decoded blocks: error feedback's
    ``x - contributed`` accounts for all the error (nothing is re-encoded)."""
    n = 4
    x = normal(1, (n, n * 6, 8)) * jnp.arange(1, n * 6 + 1)[:, None]
    out = per_device(lambda v, key: qc.compressed_reduce_scatter(v, "d", compressor, key), n)(
        x, _keys(n))
    contributed = np.asarray(out.contributed).reshape(n, n, 6, 8)  # (device, block, ...)
    np.testing.assert_allclose(np.asarray(out.value), contributed.sum(0), rtol=1e-5, atol=1e-4)
    assert not np.array_equal(np.asarray(out.contributed), np.asarray(x))


def test_stochastic_compressor_is_unbiased_through_the_reduce_scatter():
    n, trials = 4, 300
    scales = jnp.array([1.0, 10.0, 0.1, 3.0])[:, None]
    x = normal(2, (n, n * 16)) * scales
    scatter = per_device(lambda v, key: qc.compressed_reduce_scatter(
        v, "d", qc.qsgd(bits=2, bucket_size=16), key, mean=True).value, n)
    outs = np.stack([np.asarray(scatter(x, jnp.stack([jax.random.key(t)] * n)))
                     for t in range(trials)])
    want = np.asarray(x).mean(0).reshape(n, 16)
    spread = outs.std(0) / np.sqrt(trials)
    assert np.all(np.abs(outs.mean(0) - want) < 5 * spread + 1e-6)


def test_error_feedback_telescopes_through_the_reduce_scatter():
    """Sum of the shards sent over steps plus the final residuals equals the
    sum of the inputs."""
    n, steps = 4, 5
    compressor = qc.onebit(bucket_size=8)

    def step(g, residual, key):
        out = qc.compressed_reduce_scatter(g + residual, "d", compressor, key)
        return out.value, g + residual - out.contributed

    run = per_device(step, n)
    residual = jnp.zeros((n, n * 8))
    sent, total = 0.0, 0.0
    for t in range(steps):
        g = normal(t, (n, n * 8))
        shard, residual = run(g, residual, jnp.stack([jax.random.key(t)] * n))
        sent = sent + np.asarray(shard, np.float64).reshape(-1)
        total = total + np.asarray(g, np.float64).sum(0)
    np.testing.assert_allclose(sent + np.asarray(residual, np.float64).sum(0), total,
                               rtol=1e-4, atol=1e-4)


def test_bytes_in_the_compiled_program_match_the_payloads():
    n, rows = 4, 64
    qsgd, int8 = qc.qsgd(bits=4, bucket_size=64), qc.qsgd(bits=8, bucket_size=64,
                                                          stochastic=False)
    tree = {"w": jnp.ones((n, n * rows, 32)), "b": jnp.ones((n, n * 32))}
    block = {"w": jnp.ones((rows, 32)), "b": jnp.ones((32,))}
    for exchange in qc.EXCHANGES:
        scatter = per_device(lambda t, key, exchange=exchange: qc.compressed_reduce_scatter(
            t, "d", qsgd, key, exchange=exchange).value, n)
        payload = sum(qc.payload_bytes(qsgd.encode(b, jax.random.key(0))) for b in block.values())
        assert qc.wire_bytes(scatter.mapped, *scatter.shard(tree, _keys(n))) == (n - 1) * payload
    gather = per_device(lambda t: qc.compressed_all_gather(t, "d", int8).value, n)
    payload = sum(qc.payload_bytes(int8.encode(b)) for b in block.values())
    shards = {k: v[:, :v.shape[1] // n] for k, v in tree.items()}
    assert qc.wire_bytes(gather.mapped, *gather.shard(shards)) == (n - 1) * payload
    raw = sum(b.size * 4 for b in block.values())
    assert (n - 1) * payload < raw * (n - 1) / 3.5


def test_int8_weight_gather_rounds_to_nearest_per_block():
    """qsgd(bits=8, stochastic=False) is ZeRO++'s block-wise int8 weight
    quantizer: every value within half a level (max |block| / 254) of the
    weight, the same on every device."""
    n = 4
    w = normal(3, (n, 256)) * jnp.linspace(0.01, 10, n)[:, None]
    int8 = qc.qsgd(bits=8, bucket_size=64, stochastic=False)
    gather = per_device(lambda s: qc.compressed_all_gather(s, "d", int8).value, n)
    got = np.asarray(gather(w))
    assert all(np.array_equal(got[0], g) for g in got)
    blocks = np.asarray(w).reshape(-1, 64)
    half_level = np.abs(blocks).max(1, keepdims=True) / 254
    assert np.all(np.abs(got[0].reshape(-1, 64) - blocks) <= half_level * (1 + 1e-6))


def test_two_axes_scatter_compressed_across_nodes_only():
    """Over (node, local) the shards are those of P(("node", "local")), and
    only the compressed payloads cross the node axis."""
    mesh = jax.make_mesh((2, 4), ("node", "local"), devices=jax.devices()[:8])
    axes = ("node", "local")
    x = _integer_valued(4, (8, 8 * 3, 4))
    sharding = NamedSharding(mesh, P(axes))

    def run(compressor):
        fn = jax.jit(jax.shard_map(
            lambda v: qc.compressed_reduce_scatter(v[0], axes, compressor)[:2],
            mesh=mesh, in_specs=P(axes), out_specs=(P(axes), P(axes))))
        return fn, jax.device_put(x, sharding)

    fn, arg = run(qc.identity())
    value, contributed = fn(arg)
    np.testing.assert_array_equal(np.asarray(value), np.asarray(x).sum(0))
    int8 = qc.qsgd(bits=8, bucket_size=12, stochastic=False)
    fn, arg = run(int8)
    value, contributed = fn(arg)
    by_axis = qc.wire_bytes_by_axis(fn, arg, mesh=mesh)
    block = qc.payload_bytes(int8.encode(jnp.ones((3, 4))))
    assert by_axis["node"] == (2 - 1) * block
    # What every device contributed adds up to the shards it was summed into.
    np.testing.assert_allclose(np.asarray(value),
                               np.asarray(contributed).reshape(8, 8, 3, 4).sum(0)
                               .reshape(24, 4), rtol=1e-5, atol=1e-4)


def test_bad_arguments_name_themselves():
    n = 2
    x = jnp.ones((n, 3))
    with pytest.raises(ValueError, match="scatter_dimension"):
        per_device(lambda v: qc.compressed_reduce_scatter(v, "d", qc.identity()).value, n)(x)
    with pytest.raises(ValueError, match="scatter_dimension=2"):
        per_device(lambda v: qc.compressed_reduce_scatter(
            v, "d", qc.identity(), scatter_dimension=2).value, n)(jnp.ones((n, 4)))
    with pytest.raises(ValueError, match="gather_dimension"):
        per_device(lambda v: qc.compressed_all_gather(
            v, "d", qc.identity(), gather_dimension={"x": 0}).value, n)(jnp.ones((n, 4)))
    with pytest.raises(ValueError, match="pass key"):
        per_device(lambda v: qc.compressed_reduce_scatter(v, "d", qc.qsgd()).value, n)(
            jnp.ones((n, 4)))
    with pytest.raises(ValueError, match="exchange"):
        per_device(lambda v: qc.compressed_reduce_scatter(
            v, "d", qc.identity(), exchange="ring").value, n)(jnp.ones((n, 4)))
