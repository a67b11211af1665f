"""`transforms.decoupled_momentum` (DeMo) and its codec, against an oracle
written with SciPy's DCT on leaves of several shapes and scales, 4 devices."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import scipy.fft
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms
from tests.helpers import device_grads, least_squares, mesh_of, train_sharded

N = 4
# a matrix, a conv kernel whose size is no multiple of the chunk, a vector, a scalar
SHAPES = {"w": (16, 40), "k": (3, 3, 2, 5), "b": (40,), "s": ()}
SCALES = {"w": 1.0, "k": 1e-3, "b": 1e2, "s": 3.0}


def _grads(seed):
    return device_grads(seed, SHAPES, SCALES, N)


def _params():
    return {k: np.full(s, 0.5, np.float32) for k, s in SHAPES.items()}


def test_the_codec_is_the_orthonormal_dct_and_keeps_the_largest():
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    np.testing.assert_allclose(qc.dct_matrix(16) @ x.T, scipy.fft.dct(x, norm="ortho").T,
                               rtol=1e-4, atol=1e-5)
    all_of = qc.dct_components(jnp.asarray(x), 16, value_dtype=jnp.float32)
    np.testing.assert_allclose(qc.from_dct_components(all_of, 16), x, atol=1e-5)
    top = qc.dct_components(jnp.asarray(x), 3)
    coeffs = scipy.fft.dct(x, norm="ortho")
    for row in range(5):
        assert set(np.asarray(top.index[row]).tolist()) == set(
            np.argsort(-np.abs(coeffs[row]))[:3].tolist())
    assert top.index.dtype == jnp.uint8 and top.value.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="k must"):
        qc.dct_components(jnp.asarray(x), 17)


def _oracle_step(momenta, grads, params, *, lr, beta, size, k, wd):
    """Algorithm 1 per device in NumPy/SciPy: new momenta and the update."""
    def chunks(tree):
        return np.concatenate([np.pad(np.ravel(a), (0, -np.size(a) % size)).reshape(-1, size)
                               for a in tree.values()])

    def unchunk(rows):
        out, start = {}, 0
        for name, shape in SHAPES.items():
            count = int(np.prod(shape))
            used = -(-count // size)
            out[name] = rows[start:start + used].ravel()[:count].reshape(shape)
            start += used
        return out

    sent, kept = [], []
    for i in range(N):
        m = chunks({n: beta * momenta[i][n] + lr * grads[n][i] for n in SHAPES})
        coeffs = scipy.fft.dct(m, norm="ortho")
        top = np.argsort(-np.abs(coeffs), axis=1, kind="stable")[:, :k]
        sparse = np.zeros_like(coeffs)
        np.put_along_axis(sparse, top, np.take_along_axis(coeffs, top, 1).astype(
            ml_dtypes.bfloat16).astype(np.float32), 1)
        sent.append(scipy.fft.idct(sparse, norm="ortho"))
        kept.append(unchunk(m - sent[-1]))
    shared = unchunk(np.sign(np.mean(sent, axis=0)))
    update = {n: -lr * (shared[n] + wd * params[n]) for n in SHAPES}
    return kept, update


def test_a_step_is_algorithm_1():
    """Three steps against the oracle: each device's momentum less what it
    sent, and ``-lr * (sign(mean of the sent) + wd * x)``."""
    lr, beta, size, k, wd = 1e-2, 0.9, 16, 3, 0.1
    tx = transforms.decoupled_momentum("d", learning_rate=lr, beta=beta, chunk_size=size,
                                       top_k=k, weight_decay=wd)
    params = _params()
    state = transforms.init_sharded(tx, params, mesh_of(N), "d")
    specs = transforms.state_specs(state, "d")
    assert specs.momentum["w"] == P("d") and specs.count == P()
    step = jax.jit(jax.shard_map(
        lambda g, s, p: tx.update(jax.tree.map(lambda x: x[0], g), s, p), mesh=mesh_of(N),
        in_specs=(P("d"), specs, P()), out_specs=(P(), specs)))
    momenta = [{n: np.zeros(s, np.float32) for n, s in SHAPES.items()} for _ in range(N)]
    for t in range(3):
        grads = _grads(t)
        updates, state = step(jax.device_put(grads, NamedSharding(mesh_of(N), P("d"))),
                              state, params)
        momenta, expected = _oracle_step(momenta, grads, params, lr=lr, beta=beta, size=size,
                                         k=k, wd=wd)
        ours = state.momentum
        for n in SHAPES:
            np.testing.assert_allclose(updates[n], expected[n], rtol=1e-6, atol=1e-9)
            for i in range(N):
                np.testing.assert_allclose(np.asarray(ours[n])[i], momenta[i][n], rtol=2e-3,
                                           atol=2e-5 * SCALES[n] * lr)
    grads = jax.device_put(_grads(0), NamedSharding(mesh_of(N), P("d")))
    chunks = sum(-(-int(np.prod(s)) // size) for s in SHAPES.values())
    # an all-gather of a uint8 index and a bfloat16 value per coefficient
    assert qc.wire_bytes(step, grads, state, params) == (N - 1) * chunks * k * 3


def test_non_finite_steps_are_skipped_and_settings_checked():
    tx = transforms.decoupled_momentum("d", learning_rate=1e-2, chunk_size=16, top_k=2)
    state = transforms.init_sharded(tx, _params(), mesh_of(N), "d")
    specs = transforms.state_specs(state, "d")
    step = jax.jit(jax.shard_map(lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s),
                                 mesh=mesh_of(N), in_specs=(P("d"), specs),
                                 out_specs=(P(), specs)))
    def put(grads):
        return jax.device_put(grads, NamedSharding(mesh_of(N), P("d")))

    _, state = step(put(_grads(0)), state)
    bad = _grads(1)
    bad["w"][3, 0, 0] = np.inf
    updates, after = step(put(bad), state)
    assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(updates))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
    for name, bad_value in (("chunk_size", 1), ("top_k", 17), ("beta", 1.0),
                            ("weight_decay", -1.0), ("value_dtype", jnp.float16)):
        with pytest.raises(ValueError, match=name):
            transforms.decoupled_momentum("d", learning_rate=1e-2,
                                          **({"chunk_size": 16} | {name: bad_value}))


def test_it_trains():
    """Least squares on 4 devices: sign steps from a decoupled momentum, 1/8
    of each chunk's coefficients sent."""
    params, loss, x, y = least_squares(N)

    tx = transforms.decoupled_momentum("d", learning_rate=optax_decay(), chunk_size=16,
                                       top_k=2, beta=0.9)
    _, state, losses = train_sharded(tx, loss, params, x, y, 150, N)
    assert losses[-1] < 0.05 * losses[0] and int(state.count) == 150


def optax_decay():
    import optax

    return optax.cosine_decay_schedule(0.05, 150, 0.05)
