"""PowerSGD building blocks: Gram-Schmidt, P/Q steps, the linear compressor."""

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


@jax.jit
def _power_step(m, q):
    p = qc.orthogonalize(qc.powersgd_p(m, q))
    return p, qc.powersgd_reconstruct(p, qc.powersgd_q(m, p))


@given(n=st.sampled_from([1, 3, 8]), m=st.sampled_from([1, 4, 9]), seed=st.integers(0, 2**16))
def test_full_rank_reconstructs_exactly(n, m, seed):
    mat = np.random.default_rng(seed).standard_normal((n, m)).astype(np.float32)
    rank = qc.powersgd_rank((n, m), 64)
    assert rank == min(n, m)
    q = qc.powersgd_init(jax.random.key(seed), (n, m), rank)
    assume(np.linalg.cond(mat) < 1e3 and np.linalg.cond(mat @ np.asarray(q)) < 1e3)
    _, approx = _power_step(jnp.asarray(mat), q)
    np.testing.assert_allclose(approx, mat, atol=1e-4)


def test_low_rank_matches_numpy_power_iteration():
    rng = np.random.default_rng(0)
    mat = rng.standard_normal((20, 30)).astype(np.float32)
    q = rng.standard_normal((30, 3)).astype(np.float32)
    p, approx = _power_step(jnp.asarray(mat), jnp.asarray(q))
    p_ref = np.linalg.qr(mat.astype(np.float64) @ q)[0]
    np.testing.assert_allclose(np.abs(p.T @ p_ref), np.eye(3), atol=1e-4)  # same span
    np.testing.assert_allclose(approx, p_ref @ p_ref.T @ mat, atol=1e-4)


@given(batch=st.integers(1, 3), n=st.integers(1, 10), data=st.data())
def test_orthogonalize_matches_qr(batch, n, data):
    r = data.draw(st.integers(1, n))
    seed = data.draw(st.integers(0, 2**16))
    mats = np.random.default_rng(seed).standard_normal((batch, n, r)).astype(np.float32)
    assume(max(np.linalg.cond(a) for a in mats) < 1e2)
    out = np.asarray(jax.jit(qc.orthogonalize)(mats))
    for a, o in zip(mats, out, strict=True):
        q, rr = np.linalg.qr(a.astype(np.float64))
        np.testing.assert_allclose(o, q * np.sign(np.diag(rr)), atol=1e-4)
        np.testing.assert_allclose(o.T @ o, np.eye(r), atol=1e-4)


@pytest.mark.parametrize("lead", [(), (1,), (2, 1), pytest.param((1, 1), marks=pytest.mark.slow),
                                  pytest.param((3,), marks=pytest.mark.slow)])
def test_orthogonalize_stacks_at_layer_sizes(lead):
    """Stacks of layer-sized factors, size-1 axes included, equal each matrix
    orthogonalized alone, and have orthonormal columns. XLA:CPU miscompiles
    the Gram-Schmidt projection on a size-1 batch axis at these sizes (off by
    up to 0.2, or NaN); toy sizes never showed it."""
    for n, r in [(784, 8), (1000, 8), (2048, 4), (4096, 4)]:
        p = normal(n + r, lead + (n, r))
        got = np.asarray(jax.jit(qc.orthogonalize)(p)).reshape(-1, n, r)
        for a, o in zip(np.asarray(p).reshape(-1, n, r), got, strict=True):
            q, rr = np.linalg.qr(a.astype(np.float64))
            np.testing.assert_allclose(o, q * np.sign(np.diag(rr)), atol=1e-5,
                                       err_msg=f"{lead} + {(n, r)}")
            np.testing.assert_allclose(o.T @ o, np.eye(r), atol=1e-5)


def _assert_same_products(a, b):
    """Two XLA programs (a jitted list against one stacked call) agree to the
    rounding of a float32 dot product: each output is a sum of up to 96
    products, so it may differ by a few units of float32's 6e-8 relative
    precision times the length, measured against each matrix's largest
    value (the leaves' scales differ by 1e3 apiece). XLA:CPU blocks a dot
    differently on different processors, so the two programs agree bit for
    bit on one machine and not on the next."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    for x, y in zip(a, b, strict=True):
        scale = float(np.max(np.abs(y)))
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * scale)


def test_products_of_unstacked_leaves_equal_the_stacked_products():
    """A list of matrices (the leaves of one shape, never stacked) gives the
    stacked products, and ``stacked=False`` the decode of each; the
    overflow-safe path too."""
    mats = [normal((0, j), (96, 40)) * 10.0 ** (3 * j) for j in range(3)]
    q = qc.powersgd_normalize(normal((0, 3), (3, 40, 4)))
    stack = jnp.stack(mats)
    p = jax.jit(qc.powersgd_p)(mats, q)
    _assert_same_products(p, qc.powersgd_p(stack, q))
    p = qc.orthogonalize(p)
    _assert_same_products(jax.jit(qc.powersgd_q)(mats, p), qc.powersgd_q(stack, p))
    qs = qc.powersgd_q(stack, p)
    each = jax.jit(functools.partial(qc.powersgd_reconstruct, stacked=False))(p, qs)
    assert isinstance(each, list) and len(each) == 3
    _assert_same_products(jnp.stack(each), qc.powersgd_reconstruct(p, qs))
    # Products past the float32 range take the rescaled path, per list as per stack.
    huge = [m * 1e25 for m in mats]
    big = jax.jit(qc.powersgd_p)(huge, q)
    assert np.isfinite(big).all()
    _assert_same_products(big, qc.powersgd_p(jnp.stack(huge), q))
    _assert_same_products(
        jnp.stack(qc.powersgd_reconstruct(p, qs * 1e30, stacked=False)),
        qc.powersgd_reconstruct(p, qs * 1e30))
    with pytest.raises(ValueError, match="sequence of"):
        qc.powersgd_p([mats[0], mats[0][:5]], q)
    with pytest.raises(ValueError, match="stacked=False needs"):
        qc.powersgd_reconstruct(p[0], qs[0], stacked=False)


def test_normalize_keeps_the_orthogonalized_p():
    """Power-of-two column scales of Q: each column's largest entry in [0.5, 1), and
    orthogonalize(M Q) unchanged (Gram-Schmidt ignores positive column scales)."""
    rng = np.random.default_rng(0)
    m = jnp.asarray(rng.standard_normal((3, 40, 24)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((24, 4)) * np.array([1e-20, 1.0, 3e15, 1e30]),
                    jnp.float32)
    unit = np.asarray(qc.powersgd_normalize(q))
    top = np.abs(unit).max(axis=0)
    assert ((top >= 0.5) & (top < 1)).all()
    np.testing.assert_array_equal(np.log2(unit / np.asarray(q)) % 1, 0)   # exact powers
    q64 = np.asarray(q, np.float64)
    unit_norm = jnp.asarray(q64 / np.linalg.norm(q64, axis=0), jnp.float32)
    want = qc.orthogonalize(qc.powersgd_p(m, unit_norm), 0.0)
    got = qc.orthogonalize(qc.powersgd_p(m, unit), 0.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    assert np.asarray(qc.powersgd_normalize(jnp.zeros((5, 2)))).max() == 0
    with pytest.raises(ValueError, match="q must have shape"):
        qc.powersgd_normalize(jnp.ones(3))


def test_orthogonalize_zero_and_dependent_columns_stay_finite():
    a = np.random.default_rng(1).standard_normal((6, 1)).astype(np.float32)
    mat = np.concatenate([a, np.zeros((6, 1)), 2 * a, np.ones((6, 1))], axis=1)
    out = np.asarray(jax.jit(qc.orthogonalize)(jnp.asarray(mat)))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:, 0], a[:, 0] / np.linalg.norm(a), atol=1e-6)
    np.testing.assert_array_equal(out[:, 1], 0.0)
    assert np.linalg.norm(out, axis=0).max() < 1 + 1e-5
    zeros = jax.jit(qc.orthogonalize)(jnp.zeros((3, 5, 2)))
    np.testing.assert_array_equal(zeros, 0.0)
    # epsilon = 0 is PyTorch's default: a zero column is 0 / 0.
    assert np.isnan(jax.jit(functools.partial(qc.orthogonalize, epsilon=0.0))(
        jnp.zeros((4, 1)))).all()
    nan_in = jnp.ones((4, 2)).at[0, 0].set(jnp.nan)
    assert not np.isfinite(jax.jit(qc.orthogonalize)(nan_in)).any()


@pytest.mark.parametrize("num_devices", [pytest.param(1, marks=pytest.mark.slow),
                                         pytest.param(3, marks=pytest.mark.slow), 8])
@settings(max_examples=5)
@given(shape=st.sampled_from([(6, 5), (4, 3, 2), (8, 12), (1, 7)]), rank=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_two_round_step_commutes_with_summation(num_devices, shape, rank, seed):
    """Both halves are linear: decode(psum(payload)) == psum(decode(payload))."""
    rank = qc.powersgd_rank(shape, rank)
    n, m = qc.powersgd_matrix_shape(shape)
    q = qc.powersgd_init(jax.random.key(seed), shape, rank)
    g = np.random.default_rng(seed).standard_normal((num_devices, *shape)).astype(np.float32)
    mesh = jax.make_mesh((num_devices,), ("d",), devices=jax.devices()[:num_devices])

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("d"), P()),
                       out_specs=(P(), P(), P(), P()), check_vma=True)
    def step(gi, q):
        right = qc.powersgd(q, side="right")
        pay = right.encode(gi[0])
        p_sum = jax.tree.map(lambda a: lax.psum(a, "d"), pay)
        first = (right.decode(p_sum), lax.psum(right.decode(pay), "d"))
        p = qc.orthogonalize(p_sum["p"])
        left = qc.powersgd(p, side="left")
        pay2 = left.encode(gi[0])
        q_sum = jax.tree.map(lambda a: lax.psum(a, "d"), pay2)
        return (*first, left.decode(q_sum), lax.psum(left.decode(pay2), "d"))

    dec1, sum1, dec2, sum2 = step(jax.device_put(g, NamedSharding(mesh, P("d"))), q)
    total = g.sum(0).reshape(n, m).astype(np.float64)
    qn = np.asarray(q, np.float64)
    np.testing.assert_allclose(dec1, (total @ qn @ qn.T).reshape(shape), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(sum1, dec1, rtol=1e-4, atol=1e-4)
    p_ref = np.linalg.qr(total @ qn)[0]
    assume(np.linalg.cond(total @ qn) < 1e2)
    np.testing.assert_allclose(dec2, (p_ref @ p_ref.T @ total).reshape(shape), atol=1e-3)
    np.testing.assert_allclose(sum2, dec2, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("view, n, m", [("last", 144, 8), ("first", 16, 72)])
def test_payload_bytes_and_formats(view, n, m):
    q = qc.powersgd_init(jax.random.key(0), (16, 3, 3, 8), 4, view=view)
    assert q.shape == (m, 4)
    right = qc.powersgd(q, view=view)
    x = normal(1, (16, 3, 3, 8))
    payload = jax.jit(right.encode)(x)
    assert payload["p"].shape == (n, 4) and qc.payload_bytes(payload) == 4 * n * 4
    p = jnp.ones((n, 2))
    left = qc.powersgd(p, side="left", view=view)
    payload = jax.jit(left.encode)(x)
    assert payload["q"].shape == (m, 2) and qc.payload_bytes(payload) == 4 * m * 2
    assert jax.jit(left.decode)(payload).shape == x.shape
    assert right.linear and left.linear and not right.stochastic
    with pytest.raises(ValueError, match="format"):
        left.decode(right.encode(x))
    other = "first" if view == "last" else "last"
    square = jnp.ones((4, 4))  # the same (4, 4) matrix in both views
    with pytest.raises(ValueError, match="format"):  # a payload of the other view
        qc.powersgd(q[:4], view=other).decode(qc.powersgd(q[:4], view=view).encode(square))


@pytest.mark.parametrize("view", ["last", "first"])
def test_full_rank_round_trip_of_a_4d_kernel_is_exact(view):
    """Both halves at full rank reproduce a conv kernel, whichever way it is viewed."""
    shape = (3, 3, 4, 5)  # (36, 5) channels-last, (3, 60) channels-first
    x = normal(7, shape)
    q = qc.powersgd_init(jax.random.key(8), shape, 64, view=view)
    n, m = qc.powersgd_matrix_shape(shape, view=view)
    assert q.shape == (m, min(n, m))

    @jax.jit
    def round_trip(x, q):
        pay = qc.powersgd(q, view=view).encode(x)
        left = qc.powersgd(qc.orthogonalize(pay["p"]), side="left", view=view)
        pay2 = left.encode(x)
        return pay["p"], pay2["q"], left.decode(pay2)

    p, q2, out = round_trip(x, q)
    assert p.shape == (n, min(n, m)) and q2.shape == (m, min(n, m))
    assert out.shape == shape and out.dtype == x.dtype
    np.testing.assert_allclose(out, x, atol=1e-4)


def test_matrix_views():
    for view in ("last", "first"):
        assert qc.powersgd_matrix_shape((), view=view) == (1, 1)
        assert qc.powersgd_matrix_shape((7,), view=view) == (7, 1)
        assert qc.powersgd_matrix_shape((5, 3), view=view) == (5, 3)
    assert qc.powersgd_matrix_shape((4, 3, 2)) == (12, 2)  # channels-last by default
    assert qc.powersgd_matrix_shape((4, 3, 2), view="first") == (4, 6)
    assert qc.powersgd_matrix_shape((3, 3, 32, 64)) == (288, 64)
    assert qc.powersgd_matrix_shape((3, 3, 32, 64), view="first") == (3, 6144)
    x = jnp.arange(24.0).reshape(4, 3, 2)
    np.testing.assert_array_equal(qc.powersgd_matrix(x), np.reshape(np.asarray(x), (12, 2)))
    np.testing.assert_array_equal(qc.powersgd_matrix(x, view="first"),
                                  np.reshape(np.asarray(x), (4, 6)))
    # A Flax conv kernel (kh, kw, in, out) viewed channels-last is the transpose
    # of PyTorch's view of the same layer's (out, in, kh, kw) weight, up to row order.
    k = np.random.default_rng(0).standard_normal((3, 3, 4, 6)).astype(np.float32)
    flax_m = np.asarray(qc.powersgd_matrix(k))
    torch_m = np.asarray(qc.powersgd_matrix(k.transpose(3, 2, 0, 1), view="first"))
    np.testing.assert_array_equal(flax_m.reshape(3, 3, 4, 6).transpose(2, 0, 1, 3)
                                  .reshape(36, 6), torch_m.T)
    np.testing.assert_allclose(np.linalg.svd(flax_m, compute_uv=False),
                               np.linalg.svd(torch_m, compute_uv=False), rtol=1e-5)


@pytest.mark.parametrize("view", ["last", "first"])
def test_matrix_helpers_match_pytorch_rules(view):
    assert qc.powersgd_rank((4, 6), 8, view=view) == 4
    assert qc.powersgd_rank((0, 6), 2, view=view) == 1
    for shape, rank in [((512, 256), 4), ((16, 16), 4), ((64, 3, 3, 3), 2), ((3, 3, 3, 64), 2),
                        ((1000,), 1), ((8, 8), 2), ((9, 9), 2), ((10, 10), 2)]:
        n, m = qc.powersgd_matrix_shape(shape, view=view)
        r = min(n, m, rank)
        assert qc.powersgd_rank(shape, rank, view=view) == r
        expected = len(shape) > 1 and (n + m) * r * 2 < n * m
        assert qc.powersgd_should_compress(shape, rank, view=view) == expected, shape
    assert not qc.powersgd_should_compress((8, 8), 2, view=view)  # (8 + 8) * 2 * 2 == 64
    assert qc.powersgd_should_compress((8, 8), 2, min_compression_rate=1.5, view=view)


def test_should_compress_depends_on_the_view():
    # Flax conv kernel: (288, 64) channels-last pays at rank 4, (3, 6144) never does.
    assert qc.powersgd_should_compress((3, 3, 32, 64), 4)
    assert qc.powersgd_should_compress((3, 3, 32, 64), 4, view="last")
    assert not qc.powersgd_should_compress((3, 3, 32, 64), 4, view="first")
    # The same layer in PyTorch's layout is the other way round.
    assert qc.powersgd_should_compress((64, 32, 3, 3), 4, view="first")
    assert not qc.powersgd_should_compress((64, 32, 3, 3), 4, view="last")
    assert qc.powersgd_init(jax.random.key(0), (3, 3, 32, 64), 4).shape == (64, 4)
    assert qc.powersgd_init(jax.random.key(0), (3, 3, 32, 64), 4, view="first").shape == (6144, 3)


def test_bad_configs_name_the_argument():
    with pytest.raises(ValueError, match="side"):
        qc.powersgd(jnp.ones((4, 2)), side="up")
    with pytest.raises(ValueError, match="factor"):
        qc.powersgd(jnp.ones(4))
    with pytest.raises(ValueError, match="factor"):
        qc.powersgd(jnp.ones((4, 0)))
    with pytest.raises(ValueError, match="factor"):
        qc.powersgd(jnp.ones((4, 2))).encode(jnp.ones((3, 5)))
    with pytest.raises(ValueError, match="epsilon"):
        qc.orthogonalize(jnp.ones((3, 2)), -1.0)
    with pytest.raises(ValueError, match="rank"):
        qc.powersgd_rank((4, 4), 0)
    with pytest.raises(ValueError, match="min_compression_rate"):
        qc.powersgd_should_compress((4, 4), 1, min_compression_rate=0.0)
    with pytest.raises(ValueError, match="p must"):
        qc.orthogonalize(jnp.ones(3))
    for bad in ("rows", "cols", None, "LAST"):
        with pytest.raises(ValueError, match=r"view must be one of \('last', 'first'\)"):
            qc.powersgd_matrix_shape((4, 4), view=bad)
        with pytest.raises(ValueError, match="view"):
            qc.powersgd_matrix(jnp.ones((4, 4)), view=bad)
        with pytest.raises(ValueError, match="view"):
            qc.powersgd_rank((4, 4), 2, view=bad)
        with pytest.raises(ValueError, match="view"):
            qc.powersgd_should_compress((4, 4), 2, view=bad)
        with pytest.raises(ValueError, match="view"):
            qc.powersgd_should_compress((4,), 2, view=bad)
        with pytest.raises(ValueError, match="view"):
            qc.powersgd_init(jax.random.key(0), (4, 4), 2, view=bad)
        with pytest.raises(ValueError, match="view"):
            qc.powersgd(jnp.ones((4, 2)), view=bad)
    with pytest.raises(TypeError):
        qc.powersgd(jnp.ones((4, 2))).encode(jnp.ones((3, 4), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtypes(dtype):
    x = normal(2, (6, 4)).astype(dtype)
    q = qc.powersgd_init(jax.random.key(3), x.shape, 4)  # full rank: lossless
    c = qc.powersgd(q)
    payload = jax.jit(c.encode)(x)
    assert payload["p"].dtype == jnp.float32
    out = jax.jit(c.decode)(payload)
    assert out.dtype == dtype and out.shape == x.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(x, np.float32),
                               atol=2e-2)
    p = jax.jit(qc.orthogonalize)(x[:, :3])
    assert p.dtype == dtype


def test_vmap_and_batched_blocks():
    ms = normal(4, (5, 6, 8))
    qs = jax.vmap(lambda k: qc.powersgd_init(k, (6, 8), 2))(jax.random.split(jax.random.key(5), 5))
    p_batched, approx = _power_step(ms, qs)  # leading batch axis through matmul and GS
    p_vmapped, approx_v = jax.jit(jax.vmap(_power_step))(ms, qs)
    np.testing.assert_allclose(p_batched, p_vmapped, atol=1e-5)
    np.testing.assert_allclose(approx, approx_v, atol=1e-5)
    c = qc.powersgd(qs[0])
    outs = jax.jit(jax.vmap(lambda x: c.decode(c.encode(x))))(ms)
    for i in range(5):
        np.testing.assert_allclose(outs[i], c.decode(c.encode(ms[i])), atol=1e-5)


def test_non_finite_input_gives_non_finite_output():
    c = qc.powersgd(qc.powersgd_init(jax.random.key(6), (4, 5), 2))
    x = jnp.zeros((4, 5)).at[1, 2].set(jnp.inf)
    assert not np.isfinite(jax.jit(lambda v: c.decode(c.encode(v)))(x)).all()
    np.testing.assert_array_equal(jax.jit(lambda v: c.decode(c.encode(v)))(jnp.zeros((4, 5))),
                                  0.0)
