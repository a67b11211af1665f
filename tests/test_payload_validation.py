"""Decode checks its payload: format, leaf names, shapes and dtypes.

A payload whose leaves are not those its compressor's encode makes for the
payload's static shape and dtype (a truncated scale, a cast code array, a
leaf of another format) raises ValueError naming the leaf, at trace time,
eagerly and under jit, instead of decoding to wrong values.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcollect as qc
from qcollect import _payload
from tests.helpers import normal

KEY = jax.random.key(0)
SHAPE = (11, 13)  # 143 values: partial buckets, a PCA tail, an odd matrix view
X = normal(1, SHAPE)


def _entropy_planned():
    """Planned on `X` (built at collection: the plan compiled as one program
    takes a tenth of the time of its operations run one by one)."""
    c = qc.entropy()
    return c.with_plan(jax.tree.map(int, jax.jit(c.plan)(X, KEY)))


def _pca(mean: bool):
    basis = jnp.linalg.qr(normal(2, (8, 3)))[0]
    return qc.pca(basis, jnp.full((8,), 0.1) if mean else None, num_workers=2)


def _powersgd(side: str):
    rows = SHAPE[1] if side == "right" else SHAPE[0]
    return qc.powersgd(qc.orthogonalize(normal(3, (rows, 2))),
                       side=side)


COMPRESSORS = {
    "identity": qc.identity,
    "cast_bf16": lambda: qc.cast(jnp.bfloat16),
    "onebit_bucket": lambda: qc.onebit(bucket_size=16),
    "onebit_column": lambda: qc.onebit(grouping="column"),
    "qsgd4": lambda: qc.qsgd(bits=4, bucket_size=64),
    "qsgd8": lambda: qc.qsgd(bits=8, bucket_size=64),
    "threshold_words": lambda: qc.threshold(0.5),
    "threshold_golomb": lambda: qc.threshold(1.0, capacity=0.25, coding="golomb_rice"),
    "adaptive": lambda: qc.adaptive(8),
    "entropy": qc.entropy,
    "entropy_planned": _entropy_planned,
    "pca": lambda: _pca(True),
    "pca_no_mean": lambda: _pca(False),
    "powersgd_right": lambda: _powersgd("right"),
    "powersgd_left": lambda: _powersgd("left"),
}
_BUILT = {}


def compressor(name):
    if name not in _BUILT:
        _BUILT[name] = COMPRESSORS[name]()
    return _BUILT[name]


def payload_of(name, x=X):
    return jax.jit(compressor(name).encode)(x, KEY)


def leaf_cases():
    """``(compressor name, leaf name)`` for every leaf of every payload."""
    return [(name, leaf) for name in COMPRESSORS for leaf in sorted(
        jax.eval_shape(compressor(name).encode, X, KEY).arrays)]


def with_leaf(payload, name, leaf):
    return qc.Payload({**payload.arrays, name: leaf}, payload.shape, payload.dtype,
                      payload.format)


def truncated(leaf):
    """``leaf`` one element shorter: a scalar becomes empty, an array loses the
    last entry along its first axis."""
    return jnp.zeros((0,), leaf.dtype) if leaf.ndim == 0 else leaf[:-1]


def recast(leaf):
    """``leaf`` in another dtype of the same kind."""
    if jnp.issubdtype(leaf.dtype, jnp.floating):
        return leaf.astype(jnp.float16 if leaf.dtype != jnp.float16 else jnp.float32)
    flipped = {jnp.uint32: jnp.int32, jnp.int32: jnp.uint32, jnp.uint8: jnp.int8,
               jnp.int8: jnp.uint8}
    return leaf.astype(flipped[jnp.dtype(leaf.dtype).type])


@pytest.mark.parametrize("name", COMPRESSORS)
def test_a_valid_payload_decodes_eagerly_and_under_jit(name):
    c = compressor(name)
    payload = payload_of(name)
    eager, jitted = c.decode(payload), jax.jit(c.decode)(payload)
    assert eager.shape == jitted.shape == SHAPE and eager.dtype == X.dtype
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), rtol=1e-6, atol=1e-6)


def damage_cases():
    """``(compressor, leaf, damage)``: every leaf truncated and recast."""
    return [pytest.param(name, leaf, damage, id=f"{damage.__name__}-{name}-{leaf}")
            for name, leaf in leaf_cases() for damage in (truncated, recast)]


@pytest.mark.parametrize("name,leaf,damage", damage_cases())
def test_a_damaged_leaf_raises_naming_it(name, leaf, damage):
    c = compressor(name)
    payload = payload_of(name)
    good = payload[leaf]
    assert good.size > 0 or damage is recast
    bad = with_leaf(payload, leaf, damage(good))
    match = (re.escape(f"leaf '{leaf}' has shape {tuple(bad[leaf].shape)} and dtype "
                       f"{jnp.dtype(bad[leaf].dtype).name}") + ".*" +
             re.escape(f"'{leaf}' of shape {tuple(good.shape)} and dtype "
                       f"{jnp.dtype(good.dtype).name}"))
    with pytest.raises(ValueError, match=match):
        c.decode(bad)
    with pytest.raises(ValueError, match=match):
        jax.jit(c.decode)(bad)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_a_missing_or_extra_leaf_raises_naming_it(name):
    c = compressor(name)
    payload = payload_of(name)
    first = sorted(payload.arrays)[0]
    rest = {k: v for k, v in payload.arrays.items() if k != first}
    with pytest.raises(ValueError, match=rf"missing \['{first}'\]"):
        c.decode(qc.Payload(rest, payload.shape, payload.dtype, payload.format))
    extra = with_leaf(payload, "spare", jnp.zeros(3, jnp.uint32))
    with pytest.raises(ValueError, match=r"unexpected \['spare'\]"):
        jax.jit(c.decode)(extra)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_another_compressors_payload_raises_naming_both_formats(name):
    c = compressor(name)
    names = list(COMPRESSORS)
    # another format, not one of this compressor's own plans (entropy)
    others = [o for o in names[names.index(name) + 1:] + names
              if compressor(o).name.split("/plan/")[0] != c.name.split("/plan/")[0]]
    other = compressor(others[0])
    payload = payload_of(others[0])
    for decode in (c.decode, jax.jit(c.decode)):
        with pytest.raises(ValueError) as err:
            decode(payload)
        assert repr(other.name) in str(err.value) and repr(c.name) in str(err.value)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_leaves_that_do_not_fit_the_payload_shape_raise(name):
    """The same leaves relabelled with a larger array shape."""
    c = compressor(name)
    payload = payload_of(name)
    for shape in [(8 * SHAPE[0], SHAPE[1]), (8 * SHAPE[0] * SHAPE[1],)]:
        moved = qc.Payload(payload.arrays, shape, payload.dtype, payload.format)
        with pytest.raises(ValueError, match="payload"):
            jax.jit(c.decode)(moved)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_vmapped_decode_checks_per_example_leaves(name):
    c = compressor(name)
    xs = jnp.stack([X, 2 * X, -X])
    payloads = jax.jit(jax.vmap(c.encode, in_axes=(0, None)))(xs, KEY)
    decoded = jax.jit(jax.vmap(c.decode))(payloads)
    assert decoded.shape == (3, *SHAPE)
    np.testing.assert_allclose(np.asarray(decoded[1]),
                               np.asarray(c.decode(payload_of(name, 2 * X))),
                               rtol=1e-6, atol=1e-6)
    leaf = sorted(payloads.arrays)[-1]
    batched = payloads[leaf]  # per example: one element fewer, or a scalar made (1,)
    cut = batched[:, :-1] if batched.ndim > 1 else batched[:, None]
    for damaged in (recast(batched), cut):
        with pytest.raises(ValueError, match=f"leaf '{leaf}'"):
            jax.jit(jax.vmap(c.decode))(with_leaf(payloads, leaf, damaged))


@pytest.mark.parametrize("name", [n for n in COMPRESSORS if compressor(n).linear])
def test_payloads_summed_in_the_compressed_domain_decode(name):
    c = compressor(name)
    total = jax.tree.map(jnp.add, payload_of(name), payload_of(name, 2 * X))
    summed = jax.jit(c.decode)(total)
    separate = c.decode(payload_of(name)) + c.decode(payload_of(name, 2 * X))
    np.testing.assert_allclose(np.asarray(summed, np.float32), np.asarray(separate, np.float32),
                               rtol=2e-2, atol=2e-2)


def valid_counts(c, shape):
    """One count per group of ``c``, each a little short of the group's size."""
    size = int(np.prod(shape))
    if c.grouping == "bucket":
        sizes = [min(c.block, size - start) for start in range(0, size, c.block)]
    elif c.grouping == "column":
        rows, cols = qc.matrix_view(shape)
        sizes = [rows] * cols
    else:
        sizes = [size]
    return jnp.asarray([max(s - 3, 0) for s in sizes], jnp.int32)


@pytest.mark.parametrize("name", [n for n in COMPRESSORS if compressor(n).masks_padding])
def test_payloads_encoded_with_valid_counts_decode(name):
    c = compressor(name)
    valid = valid_counts(c, SHAPE)
    payload = jax.jit(lambda v, k: c.encode(v, k, valid=valid))(X, KEY)
    assert jax.tree.map(jnp.shape, payload.arrays) == jax.tree.map(jnp.shape,
                                                                   payload_of(name).arrays)
    assert jax.jit(c.decode)(payload).shape == SHAPE


def test_round_trip_and_encode_decoded_pass_the_check():
    for name in ["onebit_bucket", "qsgd4", "threshold_words", "pca"]:
        c = compressor(name)
        payload, x_hat = jax.jit(c.round_trip)(X, KEY)
        np.testing.assert_array_equal(np.asarray(x_hat), np.asarray(c.decode(payload)))


def test_entropy_payloads_name_their_plan_and_are_checked_against_it():
    """A planned payload's format names its plan, so any entropy compressor
    of the same settings decodes it and checks the planned sizes exactly."""
    base, planned = qc.entropy(), compressor("entropy_planned")
    payload = payload_of("entropy_planned")
    bits, words = planned.plan
    assert payload.format == f"{base.name}/plan/b{bits}/w{words}" == planned.name
    assert payload["stream"].shape != jax.eval_shape(base.encode, X, KEY)["stream"].shape
    other_plan = base.with_plan((bits, words + 1))
    for c in (base, planned, other_plan):
        np.testing.assert_array_equal(np.asarray(c.decode(payload)),
                                      np.asarray(planned.decode(payload)))
    for c in (base, planned):
        with pytest.raises(ValueError, match=re.escape(
                f"leaf 'stream' has shape ({words - 1},)")):
            c.decode(with_leaf(payload, "stream", payload["stream"][:-1]))
        with pytest.raises(ValueError, match="leaf 'range'"):
            c.decode(with_leaf(payload, "range", payload["range"].astype(jnp.float16)))
    with pytest.raises(ValueError, match="wire format"):
        qc.entropy(huffman=False).decode(payload)


def test_the_expected_leaves_are_traced_once_per_shape_and_dtype(monkeypatch):
    calls = []
    real = _payload._eval_layout
    monkeypatch.setattr(_payload, "_eval_layout",
                        lambda c, shape, dtype: calls.append((shape, dtype)) or real(
                            c, shape, dtype))
    c = qc.qsgd(bits=4, bucket_size=64)
    for x in (X, 3 * X, X.reshape(-1), X.astype(jnp.bfloat16)):
        jax.jit(c.decode)(jax.jit(c.encode)(x, KEY))
        c.decode(c.encode(x, KEY))
    assert calls == [(SHAPE, np.dtype("float32")), ((143,), np.dtype("float32")),
                     (SHAPE, np.dtype("bfloat16"))]


def test_the_check_follows_the_compressors_own_encode():
    """A decode taken from another compressor (``dataclasses.replace``, a shared
    decode function) is checked against the new compressor's encode."""

    def rows(x, key=None):
        return qc.Payload({"x": jnp.asarray(x)}, tuple(x.shape), x.dtype, "custom")

    def flat(x, key=None):
        return qc.Payload({"x": jnp.ravel(x)}, tuple(x.shape), x.dtype, "custom")

    def decode(payload):
        """Restores the shape."""
        return payload["x"].reshape(payload.shape)

    base = qc.Compressor("custom", rows, decode, linear=True, stochastic=False)
    flattened = dataclasses.replace(base, encode=flat)
    assert getattr(flattened.decode, _payload._UNCHECKED) is decode  # not wrapped twice
    assert flattened.decode.__doc__ == decode.__doc__
    assert flattened.decode(flat(X)).shape == base.decode(rows(X)).shape == SHAPE
    with pytest.raises(ValueError, match="leaf 'x' has shape \\(143,\\)"):
        base.decode(flat(X))
    with pytest.raises(ValueError, match="leaf 'x' has shape \\(11, 13\\)"):
        flattened.decode(rows(X))
