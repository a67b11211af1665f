"""One message per collective: `pack` / `unpack`, `qc.fused_psum`, and the
compressed all-reduce sending each hop's payload arrays as one buffer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcollect as qc
import transforms
from qcollect.collectives._messages import pack, unpack
from tests.helpers import normal, per_device

N = 4


def _mixed(lead=()):
    f32 = normal(0, lead + (3, 5))
    f32 = f32.at[..., 0, 0].set(jnp.nan).at[..., 0, 1].set(-0.0)
    return [
        f32,
        normal(1, lead + (7,), jnp.bfloat16),
        jnp.full(lead + (2, 2), -1.5, jnp.float16),
        jnp.arange(np.prod(lead + (6,), dtype=int), dtype=jnp.int8).reshape(lead + (6,)),
        jnp.full(lead + (4,), 0xDEADBEEF, jnp.uint32),
        jnp.zeros(lead + (0,), jnp.float32),
        jnp.full(lead, 7, jnp.int32),
    ]


def _bits(a):
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.itemsize > 1 else a.view(np.uint8)


@pytest.mark.parametrize("lead", [(), (3,)])
def test_pack_round_trips_every_dtype_bit_for_bit(lead):
    arrays = _mixed(lead)
    buffer, packing = pack(arrays, lead=len(lead))
    assert buffer.dtype == jnp.uint8  # the narrowest dtype sets the word
    assert buffer.shape == lead + (sum(a[(0,) * len(lead)].nbytes for a in arrays),)
    back = unpack(buffer, packing)
    for a, b in zip(arrays, back, strict=True):
        assert b.shape == a.shape and b.dtype == a.dtype
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_pack_uses_the_widest_common_word():
    buffer, _ = pack([jnp.ones(3), jnp.arange(2, dtype=jnp.uint32)])
    assert buffer.dtype == jnp.uint32 and buffer.shape == (5,)
    buffer, _ = pack([jnp.ones(3), jnp.ones(2, jnp.bfloat16)])
    assert buffer.dtype == jnp.uint16 and buffer.shape == (8,)


@pytest.mark.parametrize("bad", [jnp.ones(2, bool), jnp.ones(2, jnp.complex64)])
def test_pack_rejects_what_it_cannot_view_as_words(bad):
    with pytest.raises(ValueError, match="real or integer"):
        pack([jnp.ones(2), bad])


def test_pack_rejects_different_leading_axes():
    with pytest.raises(ValueError, match="first 1 axes differ"):
        pack([jnp.ones((2, 3)), jnp.ones((3, 3))], lead=1)


def _tree(dtype=jnp.float32):
    return {
        "embed": normal(2, (N, 256, 16), dtype) * 30,
        "scale": jnp.ones((N, 16), dtype) * jnp.arange(1, N + 1, dtype=dtype)[:, None],
        "bias": normal(3, (N, 5), dtype) * 1e-3,
        "count": jnp.arange(N, dtype=jnp.int32)[:, None] * jnp.ones((N, 3), jnp.int32),
        "empty": jnp.zeros((N, 0), dtype),
        "scalar": jnp.arange(N, dtype=dtype),
    }


@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("bucket_bytes", [None, 100, qc.BUCKET_BYTES])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_psum_equals_psum_exactly(mean, bucket_bytes, dtype):
    tree = _tree(dtype)
    fused = per_device(lambda t: qc.fused_psum(t, "d", mean=mean, bucket_bytes=bucket_bytes), N)
    plain = per_device(lambda t: (jax.lax.pmean if mean else jax.lax.psum)(t, "d"), N)
    got, want = fused(tree), plain(tree)
    for path, a in jax.tree_util.tree_leaves_with_path(got):
        b = dict(jax.tree_util.tree_leaves_with_path(want))[path]
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                      err_msg=str(path))


def _report(fn, tree) -> list:
    return qc.wire_report(fn.mapped, *fn.shard(tree))


def _ops(report, op: str) -> list:
    return [o for o in report if o.op == op]


def _operands(report, op: str = "all-reduce") -> int:
    """Arrays carried by all ``op`` collectives of a compiled program (XLA
    combines separate all-reduces into one of several operands: each operand
    is still an exchange of its own on the CPU backend)."""
    return sum(o.arrays for o in _ops(report, op))


def test_fused_psum_sends_one_buffer_per_bucket():
    tree = {k: v for k, v in _tree().items() if k != "count"}  # one dtype, 5 leaves
    assert _operands(_report(per_device(lambda t: jax.lax.psum(t, "d"), N), tree)) >= 4
    assert _operands(_report(per_device(lambda t: qc.fused_psum(t, "d"), N), tree)) == 1
    # 256 x 16 floats are 16 KiB: a bucket of their own under an 8 KiB cap
    capped = per_device(lambda t: qc.fused_psum(t, "d", bucket_bytes=8192), N)
    assert _operands(_report(capped, tree)) == 2


@pytest.mark.parametrize("compressor, arrays", [(qc.onebit(), 3), (qc.qsgd(bits=4), 2)],
                         ids=["onebit", "qsgd"])
def test_a_hop_is_one_message_whatever_the_payload_holds(compressor, arrays):
    """One-bit's payload is three arrays (sign words, two means per bucket),
    QSGD's two; each shift and the gather still send one buffer each."""
    tree = {k: v for k, v in _tree().items() if k not in ("count", "empty", "scalar")}
    leaves = jax.tree.leaves(compressor.encode(jnp.ones(256), jax.random.key(0)))
    assert len(leaves) == arrays
    fn = per_device(lambda t: qc.compressed_all_reduce(
        t, "d", compressor, jax.random.key(2), algorithm="pairwise").value, N)
    report = _report(fn, tree)
    assert len(_ops(report, "collective-permute")) == N - 1
    assert len(_ops(report, "all-gather")) == 1
    # each leaf reduced alone sends as many messages, and (deterministic) the same values
    alone = per_device(lambda t: qc.compressed_all_reduce(
        t, "d", compressor, jax.random.key(2), algorithm="pairwise", fuse=False).value, N)
    assert len(_ops(_report(alone, {"bias": tree["bias"]}), "collective-permute")) == N - 1
    for a, b in zip(jax.tree.leaves(fn(tree)), jax.tree.leaves(alone(tree)), strict=True):
        assert np.isfinite(np.asarray(a)).all() and a.shape == b.shape
        if not compressor.stochastic:  # fusion never changes a leaf's groups
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_the_transform_averages_its_small_leaves_in_one_exchange():
    grads = _tree()
    grads = {k: v for k, v in grads.items() if k != "count"}
    tx = transforms.compressed_all_reduce("d", compressor=qc.onebit(), key=jax.random.key(0),
                                          min_size=1000)

    def step(g):
        params = jax.tree.map(lambda x: x * 0, g)  # per device: the state varies along "d"
        return tx.update(g, tx.init(params), params)[0]

    report = _report(per_device(step, N), grads)
    assert _operands(report) == 1  # bias, scale, empty and scalar in one buffer
    assert len(_ops(report, "collective-permute")) == N - 1  # the embedding, one-bit
