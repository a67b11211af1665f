"""Fusing leaves into buffers: buckets, their effect on the collectives, the round trip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qcollect as qc
from qcollect._fusion import fuse_by_dtype
from tests.helpers import per_device


def _tree():
    # float32 leaves of 4 KiB, 40 KiB, 400 B, 4 KiB; one bfloat16 leaf.
    return {"a": jnp.arange(1024.0), "b": jnp.ones((100, 100)), "c": jnp.zeros(100),
            "d": jnp.full((32, 32), 2.0), "h": jnp.ones(10, jnp.bfloat16)}


def _members(buffers):
    return {name: int(buf.size) for name, buf in buffers.items()}


def test_buckets_cap_small_leaves_and_leave_large_ones_alone():
    # Tree order is a, b, c, d, h. With an 8 KiB cap: a (4 KiB) opens a bucket;
    # b (40 KiB) goes alone; c (400 B) still fits a's bucket; d (4 KiB) does
    # not and opens the next one.
    buffers, _ = fuse_by_dtype(_tree(), bucket_bytes=8 << 10)
    assert _members(buffers) == {"float32/0": 1024 + 100, "float32/1": 10000,
                                 "float32/3": 1024, "bfloat16/4": 10}


def test_a_leaf_of_the_cap_goes_alone_even_beside_empty_leaves():
    tree = [jnp.zeros(0), jnp.ones(1024), jnp.zeros(0), jnp.ones(10), jnp.ones(1024)]
    buffers, unfuse = fuse_by_dtype(tree, bucket_bytes=4096)
    # Leaves 1 and 4 are exactly 4 KiB: alone. 0, 2 and 3 share the open bucket.
    assert _members(buffers) == {"float32/0": 10, "float32/1": 1024, "float32/4": 1024}
    assert all(buf is leaf for buf, leaf in zip([buffers["float32/1"], buffers["float32/4"]],
                                                [tree[1], tree[4]], strict=True))
    back = unfuse(buffers)
    assert [b.shape for b in back] == [leaf.shape for leaf in tree]


def test_no_cap_is_one_buffer_per_dtype_and_separate_is_one_per_leaf():
    buffers, _ = fuse_by_dtype(_tree(), bucket_bytes=None)
    assert _members(buffers) == {"float32": 1024 + 10000 + 100 + 1024, "bfloat16": 10}
    assert len(fuse_by_dtype(_tree(), separate=True)[0]) == 5
    assert len(fuse_by_dtype(_tree(), bucket_bytes=0)[0]) == 5


@pytest.mark.parametrize("cap", [None, 0, 8 << 10, qc.BUCKET_BYTES])
def test_unfuse_round_trips(cap):
    tree = _tree()
    buffers, unfuse = fuse_by_dtype(tree, bucket_bytes=cap)
    back = unfuse(buffers)
    for name, leaf in tree.items():
        assert back[name].dtype == leaf.dtype and back[name].shape == leaf.shape
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(leaf))


def test_group_like_decides_buckets():
    # A float32 residual of a bfloat16 tree lands in the tree's buckets.
    tree = {"x": jnp.ones(3000, jnp.bfloat16), "y": jnp.ones(3000, jnp.bfloat16)}
    residual = jax.tree.map(lambda v: v.astype(jnp.float32), tree)
    # 12 KB of bfloat16 fit a 16 KiB bucket; the 24 KB float32 residual alone would not.
    own = fuse_by_dtype(tree, bucket_bytes=16 << 10)[0]
    like = fuse_by_dtype(residual, tree, bucket_bytes=16 << 10)[0]
    alone = fuse_by_dtype(residual, bucket_bytes=16 << 10)[0]
    assert list(own) == list(like) == ["bfloat16/0"]
    assert like["bfloat16/0"].dtype == jnp.float32 and like["bfloat16/0"].size == 6000
    assert list(alone) == ["float32/0", "float32/1"]


@pytest.mark.parametrize("bad", [-1, 1.5, "4MiB"])
def test_bad_bucket_bytes_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="bucket_bytes"):
        fuse_by_dtype(_tree(), bucket_bytes=bad)


def _collectives(fn, *args):
    return sum(op.multiplicity for op in qc.wire_report(fn, *args)
               if op.op == "collective-permute")


def test_bucket_cap_splits_collectives_not_results():
    n = 4
    tree = {"big": jax.random.normal(jax.random.key(0), (n, 4096)),
            "small1": jax.random.normal(jax.random.key(1), (n, 30)),
            "small2": jax.random.normal(jax.random.key(2), (n, 20))}
    exact = per_device(lambda t: lax.psum(t, "d"), n)(tree)
    counts = {}
    for cap in (None, 1 << 10):
        def ring(t, cap=cap):
            return qc.ring_all_reduce(t, "d", bucket_bytes=cap)

        def compressed(t, cap=cap):
            return qc.compressed_all_reduce(t, "d", qc.identity(), bucket_bytes=cap).value

        for fn in (ring, compressed):
            out = per_device(fn, n)(tree)
            for name in tree:
                np.testing.assert_allclose(np.asarray(out[name]), np.asarray(exact[name]),
                                           rtol=1e-5, atol=1e-5)
        counts[cap] = _collectives(per_device(ring, n), tree)
    # One ring (2 (N - 1) shifts) for everything, or one for the 16 KiB leaf
    # and one for the two small leaves together.
    assert counts[None] == 2 * (n - 1)
    assert counts[1 << 10] == 2 * 2 * (n - 1)
