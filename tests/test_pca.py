"""GradiVeQ PCA compressor: eq. (1) commutation, eq. (6) rank, wire format."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
from tests.helpers import normal


def _orthonormal(seed, k, d):
    a = np.random.default_rng(seed).standard_normal((k, k))
    return np.linalg.qr(a)[0][:, :d].astype(np.float32)


@functools.partial(jax.jit, static_argnames="num_workers")
def _roundtrip(basis, mean, x, num_workers=1):
    """Encode and decode with a basis and mean traced as arguments (as from state)."""
    c = qc.pca(basis, mean, num_workers=num_workers)
    return c.decode(c.encode(x))


def _reference_decode(total, basis, mean, k, num_payloads, num_workers):
    """Eq. (4)-(5) in float64 for the sum of ``num_payloads`` encodings."""
    total = np.asarray(total, np.float64).ravel()
    full = total.size // k
    u = np.asarray(basis, np.float64)
    out = total.copy()
    if full:
        view = total[: full * k].reshape(full, k)
        share = num_payloads / num_workers * np.asarray(mean, np.float64)
        out[: full * k] = ((view - share) @ u @ u.T + share).ravel()
    return out


@pytest.mark.parametrize("num_devices", [1, 3, 8])
@settings(max_examples=10)
@given(length=st.integers(0, 70), k=st.integers(1, 9), data=st.data())
def test_commutes_with_summation_across_devices(num_devices, length, k, data):
    """decode(psum(encode g_i)) == psum(decode(encode g_i)) == projection of the sum."""
    d = data.draw(st.integers(1, k))
    seed = data.draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    basis = _orthonormal(seed, k, d)
    mean = rng.standard_normal(k).astype(np.float32)
    c = qc.pca(jnp.asarray(basis), jnp.asarray(mean), num_workers=num_devices)
    g = rng.standard_normal((num_devices, length)).astype(np.float32)
    mesh = jax.make_mesh((num_devices,), ("d",), devices=jax.devices()[:num_devices])

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("d"), out_specs=(P(), P()),
                       check_vma=True)
    def step(gi):
        payload = c.encode(gi[0])
        summed = jax.tree.map(lambda a: lax.psum(a, "d"), payload)
        return c.decode(summed), lax.psum(c.decode(payload), "d")

    decoded_sum, summed_decodes = step(jax.device_put(g, NamedSharding(mesh, P("d"))))
    ref = _reference_decode(g.sum(0), basis, mean, k, num_devices, num_devices)
    np.testing.assert_allclose(decoded_sum, ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(summed_decodes, ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(decoded_sum, summed_decodes, rtol=1e-5, atol=1e-4)


def _affine_data(seed, num, k, d, scale=1.0):
    rng = np.random.default_rng(seed)
    directions = _orthonormal(seed + 1, k, d) * np.linspace(2.0, 1.0, d, dtype=np.float32)
    mean = rng.standard_normal(k).astype(np.float32) * scale
    z = rng.standard_normal((num, d)).astype(np.float32)
    return (z @ directions.T + mean).astype(np.float32)


@settings(max_examples=6)
@given(k=st.sampled_from([2, 5, 12]), data=st.data())
def test_recovers_rank_d_affine_data(k, data):
    """Data in a d-dim affine subspace: eq. (6) picks d, reconstruction is exact."""
    d = data.draw(st.integers(1, k - 1))
    seed = data.draw(st.integers(0, 2**16))
    samples = _affine_data(seed, 64, k, d)
    fit = qc.pca_fit(samples, slice_size=k, loss_threshold=1e-3)
    assert fit.rank == d and fit.basis.shape == (k, d)
    np.testing.assert_allclose(fit.mean, samples.mean(0), atol=1e-5)
    np.testing.assert_allclose(fit.basis.T @ fit.basis, np.eye(d), atol=1e-5)
    recon = _roundtrip(fit.basis, fit.mean, samples)
    np.testing.assert_allclose(recon, samples, atol=1e-4 * (1 + np.abs(samples).max()))

    # Capped path under jit: same d, zero columns beyond it, same reconstruction.
    cap = min(k, d + 2)
    capped = jax.jit(functools.partial(qc.pca_fit, slice_size=k, loss_threshold=1e-3,
                                       max_rank=cap))(samples)
    assert int(capped.rank) == d and capped.basis.shape == (k, cap)
    np.testing.assert_array_equal(capped.basis[:, d:], 0.0)
    recon2 = _roundtrip(capped.basis, capped.mean, samples)
    np.testing.assert_allclose(recon2, samples, atol=1e-4 * (1 + np.abs(samples).max()))


def _numpy_fit(rows, loss_threshold):
    rows = np.asarray(rows, np.float64)
    centred = rows - rows.mean(0)
    eig = np.clip(np.linalg.eigvalsh(centred.T @ centred / len(rows))[::-1], 0, None)
    energy = np.cumsum(eig) / eig.sum()
    return int(np.argmax(energy >= 1 - loss_threshold)) + 1, energy


@settings(max_examples=15)
@given(num=st.integers(2, 40), k=st.integers(1, 12), lam=st.sampled_from([0.0, 0.01, 0.1, 0.3]),
       slices=st.sampled_from(["first", "all"]), extra=st.integers(0, 20),
       seed=st.integers(0, 2**16))
def test_eq6_rank_matches_numpy(num, k, lam, slices, extra, seed):
    rng = np.random.default_rng(seed)
    decay = np.geomspace(1.0, 1e-2, k)
    samples = rng.standard_normal((num, 2 * k + extra)) * np.resize(decay, 2 * k + extra)
    samples = samples.astype(np.float32)
    full = samples.shape[1] // k
    rows = samples[:, :k] if slices == "first" else samples[:, : full * k].reshape(-1, k)
    d_ref, energy_ref = _numpy_fit(rows, lam)
    # Skip draws where float32 rounding could flip the comparison of eq. (6).
    assume(lam == 0.0 or np.all(np.abs(energy_ref - (1 - lam)) > 1e-4))
    fit = qc.pca_fit(samples, slice_size=k, loss_threshold=lam, slices=slices)
    np.testing.assert_allclose(fit.energy, energy_ref, atol=1e-4)
    if lam > 0:
        assert fit.rank == d_ref


def test_fixed_rank_under_jit_spans_top_eigenvectors():
    rng = np.random.default_rng(5)
    samples = (rng.standard_normal((50, 24)) * np.geomspace(4.0, 0.1, 24)).astype(np.float32)
    fit = jax.jit(functools.partial(qc.pca_fit, slice_size=8, rank=3, slices="all"))(samples)
    assert fit.rank == 3 and fit.basis.shape == (8, 3)
    rows = samples.reshape(-1, 8).astype(np.float64)
    centred = rows - rows.mean(0)
    vecs = np.linalg.eigh(centred.T @ centred)[1][:, ::-1][:, :3]
    np.testing.assert_allclose(fit.basis @ fit.basis.T, vecs @ vecs.T, atol=1e-4)


@given(size=st.integers(0, 60), k=st.integers(1, 10), with_mean=st.booleans(), data=st.data())
def test_lengths_not_divisible_and_payload_bytes(size, k, with_mean, data):
    d = data.draw(st.integers(1, k))
    seed = data.draw(st.integers(0, 2**16))
    basis = _orthonormal(seed, k, d)
    mean = np.random.default_rng(seed).standard_normal(k).astype(np.float32)
    c = qc.pca(basis, mean if with_mean else None, num_workers=3)
    x = np.random.default_rng(seed + 1).standard_normal(size).astype(np.float32)
    payload = jax.jit(c.encode)(x)
    full, tail = divmod(size, k)
    assert qc.payload_bytes(payload) == 4 * (full * d + tail + int(with_mean))
    if full:
        assert payload["coeffs"].shape == (full, d) and payload["coeffs"].dtype == jnp.float32
    if tail:
        np.testing.assert_array_equal(payload["tail"], x[full * k:])
    out = jax.jit(c.decode)(payload)
    assert out.shape == x.shape and out.dtype == x.dtype
    # One payload decodes to the local reconstruction of eq. (7).
    ref = _reference_decode(x, basis, mean if with_mean else np.zeros(k), k, 1, 3)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@given(size=st.integers(0, 40), k=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_full_rank_basis_is_lossless(size, k, seed):
    x = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
    out = _roundtrip(_orthonormal(seed, k, k), jnp.ones(k), x, num_workers=1)
    np.testing.assert_allclose(out, x, atol=1e-5)


def test_conv_kernel_shape_and_compression_ratio():
    """A Flax HWIO kernel (3, 3, 16, 8): K = 3 * F * D = 384 slices, d = 48."""
    k, d = 384, 48
    c = qc.pca(_orthonormal(0, k, d), jnp.zeros(k), num_workers=4)
    x = normal(0, (3, 3, 16, 8))
    payload = jax.jit(c.encode)(x)
    assert payload["coeffs"].shape == (3, d) and "tail" not in payload.arrays
    assert qc.payload_bytes(payload) == 4 * 3 * d + 4
    assert jax.jit(c.decode)(payload).shape == x.shape


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtypes(dtype):
    k = 8
    c = qc.pca(_orthonormal(1, k, k), jnp.full(k, 0.5), num_workers=2)
    x = normal(1, (5, 7)).astype(dtype)
    payload = jax.jit(c.encode)(x)
    assert payload["coeffs"].dtype == jnp.float32
    out = jax.jit(c.decode)(payload)
    assert out.dtype == dtype and out.shape == x.shape
    # Full rank: decode gives x - mu/2 + mu/2 == x up to rounding to dtype.
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(x, np.float32),
                               rtol=1e-2, atol=1e-2)
    fit = qc.pca_fit(normal(2, (20, k)).astype(dtype),
                     slice_size=k, rank=3)
    assert fit.basis.dtype == jnp.float32 and fit.basis.shape == (k, 3)


def test_vmap_matches_loop():
    k, d = 6, 2
    c = qc.pca(_orthonormal(3, k, d), jnp.arange(k, dtype=jnp.float32), num_workers=4)
    xs = normal(3, (5, 20))
    payloads = jax.jit(jax.vmap(c.encode))(xs)
    outs = jax.jit(jax.vmap(c.decode))(payloads)
    for i in range(5):
        np.testing.assert_allclose(outs[i], c.decode(c.encode(xs[i])), rtol=1e-6, atol=1e-6)
    fits = jax.vmap(functools.partial(qc.pca_fit, slice_size=k, rank=d))(
        normal(4, (3, 10, k)))
    assert fits.basis.shape == (3, k, d)


def test_non_finite_input_gives_non_finite_output():
    k = 4
    c = qc.pca(_orthonormal(2, k, 2), jnp.zeros(k), num_workers=1)
    x = jnp.zeros(10).at[1].set(jnp.nan).at[9].set(jnp.inf)
    out = jax.jit(lambda v: c.decode(c.encode(v)))(x)
    assert not np.isfinite(out[:4]).any()
    assert np.isfinite(out[4:8]).all() and np.isinf(out[9])
    zeros = jax.jit(lambda v: c.decode(c.encode(v)))(jnp.zeros(10))
    np.testing.assert_array_equal(zeros, 0.0)
    samples = np.ones((6, 8), np.float32)
    samples[2, 5] = np.nan
    fit = qc.pca_fit(samples, slice_size=4, loss_threshold=0.1, slices="all")
    assert not np.isfinite(_roundtrip(fit.basis, fit.mean, jnp.ones(8))).any()


def test_bad_configs_name_the_argument():
    basis = _orthonormal(0, 4, 2)
    with pytest.raises(ValueError, match="num_workers"):
        qc.pca(basis, None, num_workers=0)
    with pytest.raises(ValueError, match="basis"):
        qc.pca(basis.T, None, num_workers=1)
    with pytest.raises(ValueError, match="basis"):
        qc.pca(np.zeros(4), None, num_workers=1)
    with pytest.raises(ValueError, match="mean"):
        qc.pca(basis, np.zeros(3), num_workers=1)
    samples = np.random.default_rng(0).standard_normal((10, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="loss_threshold"):
        qc.pca_fit(samples, slice_size=4)
    with pytest.raises(ValueError, match="loss_threshold"):
        qc.pca_fit(samples, slice_size=4, loss_threshold=0.1, rank=2)
    for bad in (1.0, -0.1, float("nan"), True):
        with pytest.raises(ValueError, match="loss_threshold"):
            qc.pca_fit(samples, slice_size=4, loss_threshold=bad)
    with pytest.raises(ValueError, match="rank"):
        qc.pca_fit(samples, slice_size=4, rank=5)
    with pytest.raises(ValueError, match="max_rank"):
        qc.pca_fit(samples, slice_size=4, loss_threshold=0.1, max_rank=0)
    with pytest.raises(ValueError, match="max_rank"):
        qc.pca_fit(samples, slice_size=4, rank=2, max_rank=2)
    with pytest.raises(ValueError, match="slice_size"):
        qc.pca_fit(samples, slice_size=9, rank=1)
    with pytest.raises(ValueError, match="slice_size"):
        qc.pca_fit(samples, slice_size=0, rank=1)
    with pytest.raises(ValueError, match="slices"):
        qc.pca_fit(samples, slice_size=4, rank=1, slices="some")
    with pytest.raises(ValueError, match="max_rank"):
        jax.jit(functools.partial(qc.pca_fit, slice_size=4, loss_threshold=0.1))(samples)
    with pytest.raises(ValueError, match="format"):
        qc.pca(basis, None, num_workers=1).decode(qc.identity().encode(jnp.ones(4)))
