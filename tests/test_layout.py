"""Laying leaves out for a collective: whole groups, one leaf per group, the round trip."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

import qcollect as qc
from qcollect.collectives._layout import plan_segments
from qcollect.collectives._segments import ColumnSegment
from tests.helpers import normal, per_device


def _tree():
    # float32 leaves of 4 KiB, 40 KiB, 400 B, 4 KiB; one bfloat16 leaf.
    return {"a": jnp.arange(1024.0), "b": jnp.ones((100, 100)), "c": jnp.zeros(100),
            "d": jnp.full((32, 32), 2.0), "h": jnp.ones(10, jnp.bfloat16)}


def _members(segments):
    return [seg.members for seg in segments]


def test_small_leaves_share_a_segment_cut_into_buckets_and_large_ones_go_alone():
    # Tree order is a, b, c, d, h (dict keys sorted). With an 8 KiB cap: b
    # (40 KiB) goes alone; a, c, d (8.4 KiB of float32) share a segment of
    # 8 KiB buckets: one full bucket and a shorter last one.
    leaves = jax.tree.leaves(_tree())
    segments = plan_segments(leaves, bucket_bytes=8 << 10)
    assert _members(segments) == [(0, 2, 3), (1,), (4,)]
    assert segments[0].parts == ((1, 2048), (1, 100)) and segments[0].buckets == 2
    assert segments[1].parts == ((1, 10_000),)
    assert _members(plan_segments(leaves, bucket_bytes=None)) == [(0, 1, 2, 3), (4,)]
    assert len(plan_segments(leaves, bucket_bytes=0)) == 5
    assert len(plan_segments(leaves, fuse=False)) == 5


def test_full_buckets_are_equal_and_hold_whole_groups():
    # 3 leaves of 14 rows of 64 values on 4 devices, 4 KiB buckets: 16 rows
    # a bucket (4 per device), so 2 full buckets and one of 10 rows (3 per
    # device, padded).
    leaves = [jnp.full((14 * 64 - 5,), float(i + 1)) for i in range(3)]
    (seg,) = plan_segments(leaves, "bucket", 64, 4, bucket_bytes=4096)
    assert seg.parts == ((2, 4), (1, 3))
    parts = seg.bucketed(leaves)
    assert [p.shape for p in parts] == [(2, 4, 256), (1, 4, 192)]
    valid = seg.bucket_valid()
    assert [v.shape for v in valid] == [(2, 4, 4), (1, 4, 3)]
    assert int(sum(v.sum() for v in valid)) == 3 * (14 * 64 - 5)
    for back, leaf in zip(seg.unbucketed(parts), leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(back), np.asarray(leaf))
    with pytest.raises(ValueError, match="3 buckets"):
        seg.laid_out(leaves)


def test_a_leaf_of_the_cap_goes_alone_and_empty_leaves_get_empty_segments():
    leaves = [jnp.zeros(0), jnp.ones(1024), jnp.zeros(0), jnp.ones(10), jnp.ones(1024)]
    segments = plan_segments(leaves, bucket_bytes=4096, n=4)
    assert _members(segments) == [(0,), (1,), (2,), (3,), (4,)]
    assert [seg.length for seg in segments] == [0, 1024, 0, 10, 1024]


@pytest.mark.parametrize("grouping,block", [("bucket", 64), ("bucket", 7), ("element", 1)])
@pytest.mark.parametrize("n", [1, 3, 4, 8])
def test_row_segments_hold_whole_buckets_of_one_leaf(grouping, block, n):
    shapes = [(5, 3), (130,), (64,), (2, 3, 4, 5), (1,)]
    leaves = [jnp.full(s, float(i + 1)) for i, s in enumerate(shapes)]
    (seg,) = plan_segments(leaves, grouping, block, n)
    chunks = np.asarray(seg.chunks(leaves))
    assert chunks.shape == (n, seg.per_chunk * block)
    rows = chunks.reshape(-1, block)
    # Each bucket holds one leaf's values (its leaf's tag), then zero padding.
    for i, shape in enumerate(shapes):
        first = sum(-(-math.prod(s) // block) for s in shapes[:i])
        count = -(-math.prod(shape) // block)
        mine = rows[first:first + count].reshape(-1)
        assert np.all(mine[:math.prod(shape)] == i + 1) and np.all(mine[math.prod(shape):] == 0)
    assert np.all(rows[seg.length:] == 0)  # padding rows
    for back, leaf in zip(seg.leaves(jnp.asarray(chunks)), leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(back), np.asarray(leaf))
    valid = seg.valid()
    if block > 1:  # partial buckets: their real counts
        assert valid.shape == (n, seg.per_chunk)
        np.testing.assert_array_equal(valid.reshape(-1)[:seg.length],
                                      np.count_nonzero(rows[:seg.length], axis=1))
        assert np.all(valid.reshape(-1)[seg.length:] == 0)
    else:
        assert valid is None


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_column_segments_hold_whole_columns_side_by_side(n):
    # Leaves with 12 rows in their matrix view share a segment; (3, 4, 5)
    # has 12 rows too (channels-last: (kh*kw*in, out)); (7, 2) does not.
    shapes = [(12, 3), (3, 4, 5), (7, 2), (12,)]
    leaves = [normal(i, s) for i, s in enumerate(shapes)]
    segments = plan_segments(leaves, "column", 1, n)
    assert _members(segments) == [(0, 1, 3), (2,)]
    seg = segments[0]
    assert isinstance(seg, ColumnSegment) and seg.unit == 12 and seg.spans == (3, 5, 1)
    chunks = np.asarray(seg.chunks(leaves))
    assert chunks.shape == (n, 12, -(-9 // n))
    # Chunk j holds columns [j c, (j + 1) c) of the side-by-side matrix.
    side = np.concatenate([np.asarray(leaves[i]).reshape(12, -1) for i in (0, 1, 3)], axis=1)
    side = np.pad(side, ((0, 0), (0, n * chunks.shape[2] - 9)))
    np.testing.assert_array_equal(np.concatenate(list(chunks), axis=1), side)
    for m, back in zip(seg.members, seg.leaves(jnp.asarray(chunks)), strict=True):
        np.testing.assert_array_equal(np.asarray(back), np.asarray(leaves[m]))
    assert seg.valid() is None


def test_leaf_grouping_never_fuses_and_splits_a_leaf_into_equal_shares():
    leaves = [jnp.arange(1.0, 11.0), jnp.ones(3), jnp.ones((2, 2))]
    segments = plan_segments(leaves, "leaf", 1, 4)
    assert _members(segments) == [(0,), (1,), (2,)]
    seg = segments[0]
    assert seg.chunk_shape == (3,)  # ceil(10 / 4) values per device
    np.testing.assert_array_equal(seg.valid(), [[3], [3], [3], [1]])
    np.testing.assert_array_equal(np.asarray(seg.chunks(leaves)).reshape(-1)[:10],
                                  np.arange(1.0, 11.0))


def test_a_float32_residual_lays_out_like_its_bfloat16_leaves():
    tree = [jnp.ones(3000, jnp.bfloat16), jnp.ones(3000, jnp.bfloat16)]
    (seg,) = plan_segments(tree, "bucket", 64, 4, bucket_bytes=16 << 10)
    residual = [leaf.astype(jnp.float32) for leaf in tree]
    chunks = seg.chunks(residual)
    assert chunks.dtype == jnp.float32 and chunks.shape == seg.chunks(tree).shape


@pytest.mark.parametrize("bad", [-1, 1.5, "4MiB"])
def test_bad_bucket_bytes_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_segments(jax.tree.leaves(_tree()), bucket_bytes=bad)


def test_unknown_grouping_is_a_clear_error():
    with pytest.raises(ValueError, match="grouping"):
        plan_segments([jnp.ones(3)], "rows")


@given(shapes=st.lists(st.sampled_from([(0,), (1,), (5,), (33,), (4, 6), (3, 5, 7),
                                        (2, 2, 3, 4), (100,)]), min_size=1, max_size=5),
       grouping=st.sampled_from(["element", "bucket", "column", "leaf"]),
       block=st.sampled_from([1, 4, 64]), n=st.sampled_from([1, 2, 3, 8]),
       cap=st.sampled_from([None, 0, 256, 4096]))
def test_every_layout_round_trips(shapes, grouping, block, n, cap):
    leaves = [jnp.arange(math.prod(s), dtype=jnp.float32).reshape(s) + 100 * i
              for i, s in enumerate(shapes)]
    segments = plan_segments(leaves, grouping, block, n, bucket_bytes=cap)
    seen = sorted(m for seg in segments for m in seg.members)
    assert seen == list(range(len(leaves)))
    for seg in segments:
        back = seg.unbucketed(_as_chunks(seg, leaves))
        for m, leaf in zip(seg.members, back, strict=True):
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(leaves[m]))
        if seg.buckets == 1:
            np.testing.assert_array_equal(np.asarray(_join(seg.leaves(seg.chunks(leaves)))),
                                          np.asarray(_join(back)))


def _as_chunks(seg, leaves):
    """`Segment.bucketed` with column buckets cut into their ``n`` chunks:
    ``(count, n, rows, c)``, as the collective returns them."""
    parts = seg.bucketed(leaves)
    if not isinstance(seg, ColumnSegment):
        return parts
    return [p.reshape(p.shape[0], seg.unit, seg.n, -1).transpose(0, 2, 1, 3) for p in parts]


def _join(arrays):
    return jnp.concatenate([jnp.ravel(a) for a in arrays]) if arrays else jnp.zeros(0)


def _collectives(fn, *args):
    return sum(op.multiplicity for op in qc.wire_report(fn, *args)
               if op.op in ("collective-permute", "all-gather"))


def test_bucket_cap_splits_collectives_not_results():
    n = 4
    tree = {"big": normal(0, (n, 4096)),
            "small1": normal(1, (n, 30)),
            "small2": normal(2, (n, 20))}
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
    # One ring (N - 1 shifts and an all-gather) for everything, or one for the
    # 16 KiB leaf and one for the two small leaves together.
    assert counts[None] == n
    assert counts[1 << 10] == 2 * n


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_matrix_leaf_is_shared_by_whole_columns(n):
    """Whole-leaf groups (entropy): a kernel with at least N columns is shared
    by columns, so every device's share spans all of the layer's inputs."""
    x = jnp.arange(60.0).reshape(3, 4, 5) * (1 + jnp.arange(5.0))  # columns differ in scale
    c = qc.entropy()
    chunks, valid = qc.leaf_chunks(x, c, n)
    per = -(-5 // n)
    assert chunks.shape == (n, 12, per) and valid is None
    mat = np.pad(np.asarray(x).reshape(12, 5), ((0, 0), (0, n * per - 5)))
    for j in range(n):
        np.testing.assert_array_equal(np.asarray(chunks[j]), mat[:, j * per:(j + 1) * per])
    # A vector, or fewer columns than devices: equal runs of values.
    chunks, valid = qc.leaf_chunks(jnp.arange(10.0), c, 4)
    assert chunks.shape == (4, 3)
    np.testing.assert_array_equal(np.asarray(valid), [[3], [3], [3], [1]])


@pytest.mark.parametrize("grouping", ["bucket", "column"])
def test_collective_codec_codes_whole_groups_as_the_leaf_codec_does(grouping):
    """One-bit's groups are whole buckets or columns, so coding the leaf in
    4 chunks decodes to what coding it whole does, and the payload carries
    every chunk's bytes."""
    x = normal(0, (64, 32)) * jnp.linspace(0.1, 3.0, 32)
    c = qc.onebit(grouping=grouping)
    laid = qc.collective_codec(c, x, 4)
    payload = laid.encode(x, jax.random.key(1))
    assert laid.name == f"{c.name}/layout4" and payload.format == laid.name
    np.testing.assert_array_equal(laid.decode(payload), c.decode(c.encode(x)))
    assert qc.payload_bytes(payload) == qc.payload_bytes(c.encode(x))


def test_collective_codec_masks_the_padding_of_a_partial_bucket():
    """130 values in buckets of 64 over 4 devices: one-bit's means see only
    the real values, as in `compressed_all_reduce` (`leaf_chunks`' valid
    counts), and the padding never reaches the decoded leaf."""
    x = jnp.linspace(-1.0, 0.5, 130)
    c = qc.onebit()
    laid = qc.collective_codec(c, x, 4)
    got = laid.decode(laid.encode(x))
    chunks, valid = qc.leaf_chunks(x, c, 4)
    want = jnp.concatenate([c.decode(c.encode(chunks[j], valid=valid[j])) for j in range(4)])
    assert valid is not None and int(valid.sum()) == 130
    np.testing.assert_allclose(got, want.reshape(-1)[:130], rtol=1e-6)  # summation order
    with pytest.raises(ValueError, match="num_devices"):
        qc.collective_codec(c, x, 0)
