"""Per-layer semantics survive the collective: a leaf's statistics never depend
on the other leaves of the tree, and column groups arrive whole.

Every compressor computes its statistics over groups of one leaf (buckets,
columns, the whole leaf). These tests reduce pytrees whose leaves differ in
shape and in scale by orders of magnitude through `compressed_all_reduce`
and the transforms, and compare each leaf with the same leaf reduced alone
and with encoding each device's leaf directly.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qcollect as qc
import transforms
from qcollect.collectives._layout import plan_segments
from tests.helpers import block, mesh_of, per_device, sharded_update, stacked_on_mesh, unblock

SHAPES = [(), (1,), (7,), (64,), (33, 5), (16, 48), (3, 3, 4, 8), (2, 5, 6, 3)]
SCALES = [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]


PCA_MEAN_SCALE = 0.01


def _pca(n):
    k = 16
    basis, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(7), (k, 6)))
    return qc.pca(basis, PCA_MEAN_SCALE * jax.random.normal(jax.random.key(8), (k,)),
                  num_workers=n)


# Deterministic settings of every compressor family: alone and in a tree,
# a leaf's groups and statistics are the same, so its result is too.
DETERMINISTIC = {
    "identity": lambda n: qc.identity(),
    "cast_bf16": lambda n: qc.cast("bfloat16"),
    "onebit_bucket": lambda n: qc.onebit(bucket_size=16),
    "onebit_column": lambda n: qc.onebit(grouping="column"),
    "qsgd4_nearest": lambda n: qc.qsgd(bits=4, bucket_size=32, stochastic=False),
    "qsgd8_leaf_scale": lambda n: qc.qsgd(bits=8, bucket_size=None, stochastic=False),
    "threshold": lambda n: qc.threshold(0.05, capacity=1.0),
    "adaptive_column": lambda n: qc.adaptive(4),
    "adaptive_bucket": lambda n: qc.adaptive(4, grouping="bucket", bucket_size=24),
    "entropy_full_sample": lambda n: qc.entropy(sample_fraction=1.0),
    "pca": _pca,
}


def _exact_algorithms(compressor):
    """Algorithms whose result for a leaf does not depend on where its groups
    land: the ring sums payloads, pairwise sums decodes at the owner. (The
    re-quantizing ring's result depends on which device starts a chunk's
    chain of re-encodings, so it is compared by its error below.)"""
    return ("ring", "pairwise") if compressor.linear else ("pairwise",)


def _tree(shapes, scales, n, seed):
    """Leaves of ``shapes`` at ``scales``, with a leading device axis of ``n``:
    NumPy's draws (``jax.random.normal`` compiles a program per shape)."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(s * rng.standard_normal((n,) + shape, dtype=np.float32))
            for shape, s in zip(shapes, scales, strict=True)]


@functools.cache
def _together_and_alone(compressor, algorithm, n):
    """One program: the tree reduced together, and every leaf reduced alone."""
    def fn(tree, key):
        together = qc.compressed_all_reduce(tree, "d", compressor, key, algorithm=algorithm)
        alone = [qc.compressed_all_reduce(leaf, "d", compressor, key, algorithm=algorithm)
                 for leaf in tree]
        return together, alone
    return per_device(fn, n)


def _keys(n, seed=0):
    return jnp.stack([jax.random.key(seed)] * n)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _random_case(name, index):
    """A tree of 2-5 leaves of random shapes and scales, a device count and an exact
    algorithm, drawn from a seed per compressor and index (each compressor sees other
    trees). Case 0 runs by default (several devices, 3-5 leaves); 1-3, with one
    device possible, under ``-m slow``."""
    rng = np.random.default_rng([index, *map(ord, name)])
    count = int(rng.integers(2 if index else 3, 6))
    shapes = [SHAPES[i] for i in rng.integers(0, len(SHAPES), count)]
    scales = [float(s) for s in rng.choice(SCALES, count)]
    n = int(rng.choice([1, 2, 3, 4, 8] if index else [2, 3, 4, 8]))
    algorithm = str(rng.choice(_exact_algorithms(DETERMINISTIC[name](n))))
    return shapes, scales, n, int(rng.integers(0, 100)), algorithm


@pytest.mark.parametrize("name, index", [
    pytest.param(name, index, marks=pytest.mark.slow)
    if index or name == "entropy_full_sample" else (name, index)  # entropy compiles slowly
    for name in DETERMINISTIC for index in range(4)])
def test_a_leaf_reduces_as_if_alone(name, index):
    shapes, scales, n, seed, algorithm = case = _random_case(name, index)
    compressor = DETERMINISTIC[name](n)
    tree = _tree(shapes, scales, n, seed)
    together, alone = _together_and_alone(compressor, algorithm, n)(tree, _keys(n))
    for i, leaf in enumerate(tree):
        total = np.asarray(leaf, np.float64).sum(0)
        scale = scales[i] * np.sqrt(max(total.size, 1))
        got, want = np.asarray(together.value[i]), np.asarray(alone[i].value)
        # The same groups and statistics; only the order of the owner's adds
        # (another device may own the bucket) rounds differently.
        assert np.linalg.norm(got - want) <= 1e-4 * scale, (i, case)
        # PCA projects around its mean: rounding is relative to the larger of the two.
        magnitude = max(scales[i], PCA_MEAN_SCALE if name == "pca" else 0.0)
        np.testing.assert_allclose(np.asarray(together.contributed[i]),
                                   np.asarray(alone[i].contributed), rtol=1e-5,
                                   atol=1e-6 * magnitude, err_msg=f"{i} {case}")
        if compressor.name == "identity":
            np.testing.assert_allclose(got[0], total, rtol=1e-5, atol=1e-5 * scale)


STOCHASTIC = {
    "qsgd4": qc.qsgd(bits=4),
    "qsgd2": qc.qsgd(bits=2),
    "onebit_sampled": qc.onebit(bucket_size=64, sample=8),
    "adaptive_sampled": qc.adaptive(16, sample=32),
    "entropy": qc.entropy(),
}


# Entropy's pairwise case runs under -m slow (it compiles slowly); by default its
# per-layer ranges are checked through model averaging below.
@pytest.mark.parametrize("name,algorithm", [(name, "pairwise") for name in STOCHASTIC
                                            if name not in ("adaptive_sampled", "entropy")]
                         + [pytest.param("entropy", "pairwise", marks=pytest.mark.slow)]
                         + [(name, "ring_requantize") for name in ("qsgd4", "onebit_column")]
                         + [pytest.param("adaptive_sampled", algorithm, marks=pytest.mark.slow)
                            for algorithm in ("pairwise", "ring_requantize")])
def test_small_scale_layer_beside_a_large_one(name, algorithm):
    """A 512x128 layer at 1e-3 beside a 128x128 layer at 1.0 and a conv
    kernel at 1e-2 keeps the error it has alone (before leaf-aware layout
    the 1-bit column error grew 70x and entropy's 700x)."""
    n = 4
    compressor = STOCHASTIC.get(name) or DETERMINISTIC[name](n)
    tree = _tree([(512, 128), (128, 128), (3, 3, 16, 32), (128,)], [1e-3, 1.0, 1e-2, 10.0],
                 n, seed=3)
    together, alone = _together_and_alone(compressor, algorithm, n)(tree, _keys(n))
    for i, leaf in enumerate(tree):
        total = np.asarray(leaf).sum(0)
        e_tree = _rel(np.asarray(together.value[i])[0], total)
        e_alone = _rel(np.asarray(alone[i].value)[0], total)
        # Independent random streams: the same error up to sampling noise.
        assert 0.8 * e_alone - 1e-3 <= e_tree <= 1.25 * e_alone + 1e-3, (i, e_tree, e_alone)


@pytest.mark.parametrize("compressor", [qc.onebit(grouping="column"), qc.adaptive(8)],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow),
                               pytest.param(3, marks=pytest.mark.slow), 4])
def test_columns_reach_the_error_of_encoding_each_leaf_directly(compressor, n):
    """Through the collective a device encodes whole columns of each leaf: what
    it contributes is exactly its own leaf's direct encoding, and the sum is
    the owner's column-wise re-encoding of the sum of those encodings."""
    shapes = [(64, 24), (3, 3, 8, 16), (64, 5), (50,)]
    tree = _tree(shapes, [1e-3, 1.0, 1e-2, 1e-1], n, seed=5)
    out = per_device(lambda t: qc.compressed_all_reduce(t, "d", compressor,
                                                        algorithm="pairwise"), n)(tree)
    codec = jax.jit(lambda v: compressor.decode(compressor.encode(v)))
    for i, leaf in enumerate(tree):
        leaf = np.asarray(leaf)
        direct = np.stack([np.asarray(codec(leaf[j])) for j in range(n)])
        np.testing.assert_allclose(np.asarray(out.contributed[i]), direct, rtol=1e-6,
                                   atol=1e-9)
        owner = np.asarray(codec(jnp.asarray(direct.sum(0))))
        total = np.asarray(leaf).sum(0)
        value = np.asarray(out.value[i])[0]
        assert abs(_rel(value, total) - _rel(owner, total)) <= 1e-3
        # Per-column statistics: every decoded column takes at most its two
        # means (1-bit) or the means and zero (adaptive).
        mat = value.reshape(qc.matrix_view(shapes[i]))
        assert max(len(np.unique(col)) for col in mat.T) <= 3


def _sharded_step(body, n):
    """``body(*per-device args)`` jitted under shard_map on ``n`` devices;
    arguments and results carry a leading device axis (local SGD replicas)."""
    spec = jax.sharding.PartitionSpec("d")

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh_of(n), in_specs=spec, out_specs=spec)
    def step(*args):
        return unblock(body(*block(args)))
    return step


def _shard(tree, n):
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh_of(n),
                                                           jax.sharding.PartitionSpec("d")))


@pytest.mark.parametrize("compressor", [qc.onebit(grouping="column"),
                                        qc.qsgd(bits=4, stochastic=False)],
                         ids=lambda c: c.name)
def test_transform_residuals_are_each_leafs_own_encoding_error(compressor):
    """First step of `transforms.compressed_all_reduce` (zero residuals): each
    device's residual is its leaf's own encoding error, whatever the other
    leaves hold, so error feedback keeps per-layer semantics too."""
    n = 4
    shapes = [(48, 32), (32,), (3, 3, 4, 8)]
    grads = _tree(shapes, [1e-3, 10.0, 1e-2], n, seed=9)
    key = jax.random.key(0)
    tx = transforms.compressed_all_reduce("d", compressor=compressor, key=key,
                                          algorithm="pairwise")
    state = transforms.init_sharded(tx, [g[0] for g in grads], mesh_of(n), "d")
    _, state = sharded_update(tx, n, state)(grads, state)
    for i, g in enumerate(grads):
        residual = np.asarray(state.feedback.residual[i])
        alone = transforms.init_sharded(tx, g[0], mesh_of(n), "d")
        _, alone = sharded_update(tx, n, alone)(g, alone)
        np.testing.assert_allclose(residual, np.asarray(alone.feedback.residual), rtol=1e-5,
                                   atol=1e-6 * float(np.abs(g).max()))


def test_model_averaging_codes_every_layer_with_its_own_range():
    """`compressed_model_averaging` with entropy: a layer of weights at 1e-3
    beside one at 1.0 is averaged as precisely as it is alone."""
    n = 4
    shapes = [(64, 32), (32, 32)]
    weights = _tree(shapes, [1e-3, 1.0], n, seed=2)
    key = jax.random.key(1)

    def averaged(params):
        tx = optax.chain(optax.sgd(0.0), transforms.compressed_model_averaging(
            "d", every_k=1, key=key, compressor=qc.entropy(sample_fraction=1.0), min_size=0))
        def body(p, s):
            u, _ = tx.update(jax.tree.map(jnp.zeros_like, p), s, p)
            return optax.apply_updates(p, u)

        state = stacked_on_mesh(tx.init([w[0] for w in params]), n)
        return [np.asarray(w) for w in _sharded_step(body, n)(_shard(params, n), state)]

    together = averaged(weights)
    for i, w in enumerate(weights):
        mean = np.asarray(w).mean(0)
        alone = averaged([w])[0]
        e_tree, e_alone = _rel(together[i][0], mean), _rel(alone[0][0], mean)
        assert e_tree <= 1.01 * e_alone + 1e-6, (i, e_tree, e_alone)
        assert e_tree < 0.05


@pytest.mark.parametrize("compressor", [qc.onebit(grouping="column"), qc.qsgd(bits=4),
                                        qc.adaptive(16),
                                        pytest.param(qc.entropy(), marks=pytest.mark.slow)],
                         ids=lambda c: c.name)
def test_wire_bytes_are_the_payloads_of_whole_group_chunks(compressor):
    """Pairwise sends each chunk's payload N - 1 times and all-gathers the
    owner's: 2 (N - 1) payloads of one chunk per segment, as laid out."""
    n = 4
    shapes = [(64, 24), (3, 3, 8, 16), (64, 5), (50,), (7, 7)]
    tree = [jnp.zeros((n,) + s) for s in shapes]
    fn = per_device(lambda t: qc.compressed_all_reduce(t, "d", compressor, jax.random.key(0),
                                                       algorithm="pairwise").value, n)
    sent = qc.wire_bytes(fn.mapped, *fn.shard(tree))
    segments = plan_segments([jnp.zeros(s) for s in shapes], compressor.grouping,
                             compressor.block, n)
    want = 0
    for seg in segments:
        chunk = jnp.zeros(seg.chunk_shape)
        masked = compressor.masks_padding and seg.valid() is not None
        kwargs = {"valid": jnp.zeros(seg.per_chunk, jnp.int32)} if masked else {}
        payload = jax.eval_shape(functools.partial(compressor.encode, **kwargs), chunk,
                                 jax.random.key(0))
        want += 2 * (n - 1) * qc.payload_bytes(payload)
    assert sent == want
    if compressor.grouping != "leaf":  # unplanned entropy: 10 bits and a 1024-entry table
        dense = sum(qc.ring_bytes_per_device(int(np.prod(s)), 4, n) for s in shapes)
        assert sent < dense / 3  # small leaves here: padded to whole 512-value buckets
