"""Ring collectives equal XLA's: psum_scatter, all_gather, psum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import qcollect as qc
from tests.helpers import per_device

SIZES = [1, 2, 3, 4, 5, 8]


def _data(n, shape, dtype, seed):
    """``(n,) + shape`` random values of ``dtype``: NumPy's draws (a `jax.random`
    draw compiles a program per shape)."""
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-1000, 1000, (n,) + shape).astype(dtype))
    return jnp.asarray(rng.standard_normal((n,) + shape, dtype=np.float32).astype(dtype))


def _assert_close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if jnp.issubdtype(dtype, jnp.integer):
        np.testing.assert_array_equal(got, want)
    elif dtype == jnp.bfloat16:
        np.testing.assert_allclose(got, want, rtol=0.05, atol=0.1)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=8)  # a compile per example
@given(n=st.sampled_from(SIZES), length=st.integers(0, 70),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.int32]), seed=st.integers(0, 99))
def test_ring_all_reduce_equals_psum(n, length, dtype, seed):
    x = _data(n, (length,), dtype, seed)
    ring = per_device(lambda v: qc.ring_all_reduce(v, "d"), n)(x)
    psum = per_device(lambda v: lax.psum(v, "d"), n)(x)
    assert ring.shape == psum.shape and ring.dtype == psum.dtype
    if length:
        _assert_close(ring, psum, dtype)


@settings(max_examples=8)  # a compile per example
@given(n=st.sampled_from(SIZES), rows=st.integers(1, 6), seed=st.integers(0, 99),
       dtype=st.sampled_from([jnp.float32, jnp.int32]))
def test_ring_reduce_scatter_equals_psum_scatter(n, rows, seed, dtype):
    x = _data(n, (n * rows, 3), dtype, seed)
    ring = per_device(lambda v: qc.ring_reduce_scatter(v, "d"), n)(x)
    xla = per_device(lambda v: lax.psum_scatter(v, "d", tiled=True), n)(x)
    _assert_close(ring, xla, dtype)


@settings(max_examples=8)  # a compile per example
@given(n=st.sampled_from(SIZES), rows=st.integers(0, 5), seed=st.integers(0, 99))
def test_ring_all_gather_equals_all_gather(n, rows, seed):
    x = _data(n, (rows, 2), jnp.int32, seed)
    ring = per_device(lambda v: qc.ring_all_gather(v, "d"), n)(x)
    assert ring.shape == (n, n * rows, 2)
    if rows:  # XLA's own all_gather fails to lower for empty inputs
        xla = per_device(lambda v: lax.all_gather(v, "d", tiled=True), n)(x)
        _assert_close(ring, xla, jnp.int32)


@pytest.mark.parametrize("n", [3, 8])
def test_reduce_scatter_pads_uneven_lengths(n):
    x = _data(n, (10,), jnp.int32, 0)
    out = np.asarray(per_device(lambda v: qc.ring_reduce_scatter(v, "d"), n)(x))
    rows = -(-10 // n)
    total = np.zeros(n * rows, np.int64)
    total[:10] = np.asarray(x).sum(0)
    np.testing.assert_array_equal(out, total.reshape(n, rows))


def test_pytree_with_mixed_dtypes_and_shapes():
    n = 4
    tree = {"w": _data(n, (3, 5), jnp.float32, 1), "b": _data(n, (7,), jnp.bfloat16, 2),
            "i": _data(n, (), jnp.int32, 3), "s": [_data(n, (2, 2, 2), jnp.float32, 4)]}
    ring = per_device(lambda t: qc.ring_all_reduce(t, "d"), n)(tree)
    psum = per_device(lambda t: lax.psum(t, "d"), n)(tree)
    pairs = zip(jax.tree_util.tree_leaves_with_path(ring), jax.tree.leaves(psum), strict=True)
    for (path, a), b in pairs:
        assert a.shape == b.shape and a.dtype == b.dtype, path
        _assert_close(a, b, a.dtype)


@pytest.mark.parametrize("n", [2, 5, 8])
def test_under_pmap(n):
    x = _data(n, (13,), jnp.float32, 5)
    devices = jax.devices()[:n]
    ring = jax.pmap(lambda v: qc.ring_all_reduce(v, "i"), axis_name="i", devices=devices)(x)
    np.testing.assert_allclose(np.asarray(ring), np.tile(np.asarray(x).sum(0), (n, 1)),
                               rtol=1e-5, atol=1e-5)
    gathered = jax.pmap(lambda v: qc.ring_all_gather(v, "i"), axis_name="i",
                        devices=devices)(x[:, :2])
    np.testing.assert_array_equal(np.asarray(gathered)[0], np.asarray(x[:, :2]).reshape(-1))


def test_replicated_input_is_accepted():
    """An input invariant along the axis (a replicated value) is cast, not rejected."""
    n = 4
    mesh_fn = per_device(lambda v: qc.ring_all_reduce(jnp.arange(6.0) + 0 * v.sum(), "d"), n)
    np.testing.assert_allclose(np.asarray(mesh_fn(jnp.zeros((n, 1))))[0], n * np.arange(6.0))


@pytest.mark.parametrize("n", [2, 8])
def test_hlo_is_a_loop_not_unrolled(n):
    x = jnp.zeros((n, 1024))
    fn = per_device(lambda v: qc.ring_all_reduce(v, "d"), n)
    hlo = fn.mapped.lower(*fn.shard(x)).compile().as_text()
    assert hlo.count("collective-permute(") <= 2  # one per phase, whatever n is


def test_scalar_input_is_rejected():
    with pytest.raises(ValueError, match="leading axis"):
        per_device(lambda v: qc.ring_reduce_scatter(v.sum(), "d"), 2)(jnp.zeros((2, 3)))


@pytest.mark.parametrize("perm, swap", [
    ([(0, 1), (1, 0)], True),                    # two devices: every ring step
    ([(0, 2), (1, 3), (2, 0), (3, 1)], True),    # shift by N / 2
    ([(0, 1), (1, 2), (2, 3), (3, 0)], False),   # a ring of four
    ([(0, 0), (1, 1)], False),                   # sending to oneself moves nothing
])
def test_swaps_are_found(perm, swap):
    from qcollect._backend import has_swap

    assert has_swap(perm) is swap


def test_one_process_never_splits_swaps():
    from qcollect._backend import split_swaps

    assert jax.process_count() == 1 and not split_swaps([(0, 1), (1, 0)])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8])
@pytest.mark.parametrize("length", [1, 7, 101])  # empty leaves go whole; 101: ragged last piece
def test_swaps_in_pieces_move_what_one_ppermute_moves(monkeypatch, dtype, length):
    from qcollect import _backend
    from qcollect.collectives import _ring

    monkeypatch.setattr(_backend, "SWAP_PIECE_BYTES", 16)
    monkeypatch.setattr(_backend, "split_swaps", lambda perm: True)
    n = 4
    perm = [(i, (i + 2) % n) for i in range(n)]
    x = (jnp.arange(n * length).reshape(n, length) % 97).astype(dtype)
    in_pieces = per_device(lambda v: _ring.permute(v, "d", perm), n)
    pieces = in_pieces(x)
    whole = per_device(lambda v: lax.ppermute(v, "d", perm), n)(x)
    assert pieces.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(pieces), np.asarray(whole))
    # 16-byte pieces: several collective-permutes once a row passes 16 bytes.
    ops = [op for op in qc.wire_report(in_pieces, x) if op.op == "collective-permute"]
    assert len(ops) == max(1, -(-length * jnp.dtype(dtype).itemsize // 16))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_ring_all_gather_of_16_bit_floats_equals_all_gather_at_16_bits(dtype):
    n = 4
    x = jax.random.normal(jax.random.key(5), (n, 3, 5)).astype(dtype)
    ring = per_device(lambda v: qc.ring_all_gather(v, "d"), n)
    xla = per_device(lambda v: lax.all_gather(v, "d", tiled=True), n)(x)
    got = ring(x)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(xla, np.float32))
    assert qc.wire_bytes(ring, x) == (n - 1) * 3 * 5 * 2
