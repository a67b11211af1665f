"""The compressor contract, checked for every compressor.

Each compressor must: restore shape and dtype under jit and vmap, accept odd
lengths and 16-bit inputs, decode all-zero input to zeros, never turn NaN/Inf
into a finite answer, carry its payload through cond / ppermute, reject a
payload of another format, and send fewer bytes than the input when it claims
to compress.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import qcollect as qc
from tests.helpers import normal

COMPRESSORS = {
    "identity": qc.identity,
    "cast_bf16": lambda: qc.cast(jnp.bfloat16),
    "cast_f16": lambda: qc.cast("float16"),
    "onebit": qc.onebit,
    "onebit_column": lambda: qc.onebit(grouping="column"),
    "onebit_sampled": lambda: qc.onebit(bucket_size=16, sample=4),
    "qsgd2": lambda: qc.qsgd(bits=2),
    "qsgd4": lambda: qc.qsgd(bits=4),
    "qsgd8_l2": lambda: qc.qsgd(bits=8, norm="l2"),
    "qsgd16": lambda: qc.qsgd(bits=16),
    "qsgd4_nearest_whole": lambda: qc.qsgd(bits=4, bucket_size=None, stochastic=False),
    "threshold": lambda: qc.threshold(0.5),
    "threshold_golomb": lambda: qc.threshold(1.0, capacity=0.25, coding="golomb_rice"),
    "adaptive": lambda: qc.adaptive(8),
    "adaptive_bucket_sampled": lambda: qc.adaptive(4, grouping="bucket", bucket_size=64,
                                                   sample=16),
    "entropy": lambda: qc.entropy(),
    "entropy_raw": lambda: qc.entropy(huffman=False, sample_fraction=1.0),
    "pca": lambda: qc.pca(jnp.linalg.qr(normal(0, (8, 3)))[0],
                          num_workers=2),  # affine with a mean; see test_pca
}
COMPRESSING = [n for n in COMPRESSORS if n != "identity"]
SHAPES = [(0,), (1,), (13,), (1000,), (3, 5, 7), (), (4, 0)]
# Every shape in float32; the 16-bit dtypes on odd, prime and multi-dim shapes.
CASES = ([(s, jnp.float32) for s in SHAPES]
         + [(s, d) for s in [(97,), (3, 5, 7)] for d in (jnp.bfloat16, jnp.float16)])


def _round_trips(c, xs, keys=None):
    """``[(encode(x), decode(encode(x))) for x in xs]`` (``encode`` then ``decode``, not
    the fused ``round_trip``) in one jitted program, as a collective runs them; the
    cases are independent computations in it, and one compile serves them all."""
    keys = [jax.random.key(0)] * len(xs) if keys is None else keys

    def encode_decode(xs, keys):
        payloads = [c.encode(x, k) for x, k in zip(xs, keys, strict=True)]
        return [(p, c.decode(p)) for p in payloads]

    return jax.jit(encode_decode)(list(xs), list(keys))


ZERO_SHAPES = [(1,), (13,), (1000,), (8, 9)]
POISONS = [(np.nan, 0), (np.inf, 500), (-np.inf, 999), (np.nan, 999)]


def _poisoned(bad, where):
    x = np.array(normal(2, (1000,)))
    x[where] = bad
    return jnp.asarray(x)


# 16-bit inputs of `CASES` with a NaN first (`test_round_trip_is_encode_then_decode`).
POISONED_16 = [((3, 5, 7), jnp.bfloat16), ((97,), jnp.float16)]
_FIRST_POISON = len(CASES) + len(ZERO_SHAPES)  # where `POISONS` start in `_inputs`


def _inputs():
    """The inputs of one compressor's program: `CASES`, zeros of `ZERO_SHAPES`,
    `POISONS` in float32 and the `POISONED_16`, in that order."""
    xs = [normal(1, shape, jnp.float32).astype(dtype) for shape, dtype in CASES]
    zeros = [jnp.zeros(s) for s in ZERO_SHAPES]
    poisoned = [_poisoned(bad, where) for bad, where in POISONS]
    poisoned_16 = [normal(1, shape, jnp.float32).at[(0,) * len(shape)].set(jnp.nan).astype(d)
                   for shape, d in POISONED_16]
    return xs + zeros + poisoned + poisoned_16


@functools.cache
def _encoded_and_decoded(name):
    """`_inputs` and ``(encode(x), decode(encode(x)))`` of each under
    ``COMPRESSORS[name]`` and key 0: one compiled program per compressor, which
    the shapes test checks and the round-trip test takes as its unfused path."""
    xs = _inputs()
    return xs, _round_trips(COMPRESSORS[name](), xs)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_shapes_dtypes_zeros_and_non_finite_inputs(name):
    """In one program: every shape and dtype of `CASES` comes back with its shape and
    dtype, finite and within the input's range; all-zero inputs decode to zeros; a
    NaN or an Inf anywhere is never decoded to an all-finite answer."""
    inputs, results = _encoded_and_decoded(name)
    xs = inputs[:len(CASES)]
    decoded = [x_hat for _, x_hat in results]
    for (shape, dtype), x, x_hat in zip(CASES, xs, decoded[:len(xs)], strict=True):
        case = f"{shape} {jnp.dtype(dtype).name}"
        assert x_hat.shape == x.shape and x_hat.dtype == x.dtype, case
        assert np.all(np.isfinite(np.asarray(x_hat, np.float32))), case
        # Lossy, but never wild: a quantizer's error is within the input's range.
        if x.size:
            err = np.max(np.abs(np.asarray(x_hat, np.float32) - np.asarray(x, np.float32)))
            assert err <= 2 * np.max(np.abs(np.asarray(x, np.float32))) + 1e-6, case
    for shape, x_hat in zip(ZERO_SHAPES, decoded[len(xs):_FIRST_POISON], strict=True):
        np.testing.assert_array_equal(np.asarray(x_hat), 0.0, err_msg=f"zeros {shape}")
    for poison, x_hat in zip(POISONS + POISONED_16, decoded[_FIRST_POISON:], strict=True):
        assert not np.all(np.isfinite(np.asarray(x_hat, np.float32))), poison


@pytest.mark.parametrize("name", COMPRESSING)
def test_payload_is_smaller_than_input(name):
    """Payload shapes are static (`test_payload_bytes_is_static`): no need to run it."""
    x = normal(3, (4096,))
    payload = jax.eval_shape(COMPRESSORS[name]().encode, x, jax.random.key(0))
    assert qc.payload_bytes(payload) < x.nbytes


@pytest.mark.parametrize("name", COMPRESSORS)
def test_payload_bytes_is_static(name):
    """The bytes of the traced payload (no compile) are those of the payloads
    the compiled program of `_encoded_and_decoded` made, for every input."""
    c = COMPRESSORS[name]()
    inputs, results = _encoded_and_decoded(name)
    for x, (payload, _) in zip(inputs, results, strict=True):
        shapes = jax.eval_shape(c.encode, x, jax.random.key(0))
        assert qc.payload_bytes(shapes) == qc.payload_bytes(payload), (x.shape, x.dtype)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_vmap_matches_per_example(name):
    c = COMPRESSORS[name]()
    xs = normal(4, (3, 50))
    keys = jax.random.split(jax.random.key(5), 3)
    one = lambda x, k: c.decode(c.encode(x, k))  # noqa: E731
    # One program: the vmapped batch and each example alone.
    batched, singles = jax.jit(lambda xs, keys: (jax.vmap(one)(xs, keys),
                                                 [one(xs[i], keys[i]) for i in range(3)]))(xs, keys)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(singles[i]),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_payload_through_cond(name):
    c = COMPRESSORS[name]()
    x = normal(6, (100,))

    @jax.jit
    def f(x, flag):  # through the cond, and decoded directly
        p = c.encode(x, jax.random.key(0))
        through = jax.lax.cond(flag, lambda p: p, lambda p: jax.tree.map(jnp.zeros_like, p), p)
        return c.decode(through), c.decode(p)

    through, direct = f(x, True)
    np.testing.assert_array_equal(np.asarray(through), np.asarray(direct))
    np.testing.assert_array_equal(np.asarray(f(x, False)[0]), 0.0)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_payload_through_ppermute(name):
    c = COMPRESSORS[name]()
    n = 4
    mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])
    xs = normal(7, (n, 37))
    keys = jax.random.split(jax.random.key(8), n)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("d"), P("d")),
                       out_specs=(P("d"), P("d")))
    def shifted(x, key):  # the neighbour's payload decoded here, and this device's own
        p = c.encode(x[0], key[0])
        moved = jax.lax.ppermute(p, "d", [(i, (i + 1) % n) for i in range(n)])
        return c.decode(moved)[None], c.decode(p)[None]

    sharding = jax.sharding.NamedSharding(mesh, P("d"))
    got, own = map(np.asarray, shifted(jax.device_put(xs, sharding),
                                       jax.device_put(keys, sharding)))
    for i in range(n):
        np.testing.assert_array_equal(got[i], own[(i - 1) % n])


@pytest.mark.parametrize("name", COMPRESSORS)
def test_wrong_format_is_rejected(name):
    c = COMPRESSORS[name]()
    other = qc.qsgd(bits=8, bucket_size=3) if not name.startswith("qsgd") else qc.onebit()
    payload = other.encode(jnp.ones(8), jax.random.key(0))
    with pytest.raises(ValueError, match="format"):
        c.decode(payload)


@pytest.mark.parametrize("name", [n for n in COMPRESSORS if COMPRESSORS[n]().stochastic])
def test_stochastic_needs_key(name):
    with pytest.raises(ValueError, match="key"):
        COMPRESSORS[name]().encode(jnp.ones(8))


@pytest.mark.parametrize("name", COMPRESSING)
def test_integer_input_is_rejected(name):
    with pytest.raises(TypeError, match="floating"):
        COMPRESSORS[name]().encode(jnp.ones(8, jnp.int32), jax.random.key(0))


@settings(max_examples=10)  # a compile per example and compressor
@given(length=st.integers(0, 2000), seed=st.integers(0, 2**16))
def test_linear_compressors_commute_with_sum(length, seed):
    xs = normal(seed, (3, length))
    for c in (qc.identity(), qc.cast(jnp.bfloat16)):
        payloads = [c.encode(x) for x in xs]
        summed = jax.tree.map(lambda *leaves: sum(leaves), *payloads)
        np.testing.assert_allclose(
            np.asarray(c.decode(summed), np.float32),
            np.asarray(sum(c.decode(p) for p in payloads), np.float32),
            rtol=2e-2, atol=2e-2)
    assert qc.identity().linear and not qc.qsgd().linear and not qc.onebit().linear


def _bits(a):
    """An array's bit pattern (NaNs compare equal to themselves)."""
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32) if a.size else a


# Float32, the 16-bit dtypes and an empty array, finite and with a NaN first:
# their places among `_inputs`.
ROUND_TRIP_CASES = {
    "(1000,) float32": CASES.index(((1000,), jnp.float32)),
    "(1000,) float32, NaN first": _FIRST_POISON + POISONS.index((np.nan, 0)),
    "(3, 5, 7) bfloat16": CASES.index(((3, 5, 7), jnp.bfloat16)),
    "(3, 5, 7) bfloat16, NaN first": _FIRST_POISON + len(POISONS),
    "(97,) float16": CASES.index(((97,), jnp.float16)),
    "(97,) float16, NaN first": _FIRST_POISON + len(POISONS) + 1,
    "(0,) float32": CASES.index(((0,), jnp.float32)),  # no value to poison
}


@pytest.mark.parametrize("name", COMPRESSORS)
def test_round_trip_is_encode_then_decode(name):
    """``round_trip(x)`` is ``(encode(x), decode(encode(x)))`` bit for bit, fused or not,
    in one jitted program (as error feedback runs it), NaN included. Every case of
    `ROUND_TRIP_CASES` in one program per path: the fused one here, the other the
    shapes test's (`_encoded_and_decoded`)."""
    c = COMPRESSORS[name]()
    inputs, unfused = _encoded_and_decoded(name)
    xs = [inputs[i] for i in ROUND_TRIP_CASES.values()]
    assert [x.dtype for x in xs] == [jnp.float32, jnp.float32, jnp.bfloat16, jnp.bfloat16,
                                     jnp.float16, jnp.float16, jnp.float32]
    assert [bool(np.isnan(np.asarray(x, np.float32)).any()) for x in xs] == [
        False, True, False, True, False, True, False]
    key = jax.random.key(0)  # `_round_trips`'
    fused = jax.jit(lambda xs: [c.round_trip(x, key) for x in xs])(xs)
    for case, (payload, x_hat), (want, want_hat) in zip(
            ROUND_TRIP_CASES, fused, [unfused[i] for i in ROUND_TRIP_CASES.values()],
            strict=True):
        for got, ref in zip(jax.tree.leaves(payload), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(_bits(got), _bits(ref), err_msg=str(case))
        np.testing.assert_array_equal(_bits(x_hat), _bits(want_hat), err_msg=str(case))


@pytest.mark.parametrize("c", [qc.onebit(), qc.onebit(grouping="column"), qc.qsgd(bits=4),
                               qc.qsgd(bits=8, norm="l2")], ids=lambda c: c.name)
def test_fused_round_trip_with_padding_counts(c):
    """The fused path with ``valid=`` counts (a collective's partial groups)."""
    x = normal(5, (6, 128))
    kwargs = {}
    if c.grouping == "column":  # 128 columns of 6 rows; the last has 3 real ones
        kwargs["valid"] = jnp.full((128,), 6, jnp.int32).at[-1].set(3)
        x = x.at[3:, -1].set(0.0)
    elif c.masks_padding:  # 12 buckets of 64; the last has 3 real values
        kwargs["valid"] = jnp.full((12,), 64, jnp.int32).at[-1].set(3)
        x = x.reshape(-1).at[-61:].set(0.0).reshape(6, 128)
    assert c.encode_decoded is not None
    payload, x_hat = jax.jit(lambda x, k: c.round_trip(x, k, **kwargs))(x, jax.random.key(6))
    want = jax.jit(lambda x, k: c.encode(x, k, **kwargs))(x, jax.random.key(6))
    for got, ref in zip(jax.tree.leaves(payload), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(x_hat), np.asarray(jax.jit(c.decode)(want)))
