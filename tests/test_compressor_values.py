"""Compressors are values: equal settings, equal compressors, one compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcollect as qc

U = jnp.linalg.qr(jax.random.normal(jax.random.key(0), (16, 4)))[0]

# (factory, settings, a different setting) per compressor family.
CASES = {
    "identity": (qc.identity, {}, None),
    "cast": (qc.cast, {"dtype": "bfloat16"}, {"dtype": "float16"}),
    "onebit-bucket": (qc.onebit, {"grouping": "bucket"}, {"grouping": "bucket", "bucket_size": 32}),
    "onebit-column": (qc.onebit, {"grouping": "column"}, {"grouping": "column", "sample": 8}),
    "qsgd-2": (qc.qsgd, {"bits": 2}, {"bits": 2, "norm": "l2"}),
    "qsgd-4": (qc.qsgd, {"bits": 4}, {"bits": 8}),
    "qsgd-16": (qc.qsgd, {"bits": 16}, {"bits": 16, "stochastic": False}),
    "threshold": (qc.threshold, {"tau": 0.5}, {"tau": 0.25}),
    "adaptive": (qc.adaptive, {"proportion": 32.0}, {"proportion": 16.0}),
    "entropy": (qc.entropy, {}, {"floor": 5}),
    "pca": (qc.pca, {"basis": U, "num_workers": 2}, {"basis": U, "num_workers": 4}),
    "powersgd": (qc.powersgd, {"factor": U}, {"factor": U, "side": "left"}),
}


def _build(factory, kwargs):
    if factory is qc.cast:
        return qc.cast(kwargs["dtype"])
    if factory is qc.threshold:
        return qc.threshold(kwargs["tau"])
    if factory in (qc.pca, qc.powersgd):
        first = "basis" if factory is qc.pca else "factor"
        rest = {k: v for k, v in kwargs.items() if k != first}
        return factory(kwargs[first], **rest)
    return factory(**kwargs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_equal_settings_make_equal_compressors(name):
    factory, kwargs, other = CASES[name]
    a, b = _build(factory, kwargs), _build(factory, kwargs)
    assert a is not b and a == b and hash(a) == hash(b)
    assert {a: name}[b] == name
    if other is not None:
        c = _build(factory, other)
        assert c != a
    for key, value in kwargs.items():
        if isinstance(value, jax.Array):
            assert getattr(a, key) is value
        else:
            assert getattr(a, key) == value
    assert repr(a).startswith(a.name.split("/")[0] + "(")


def test_defaults_are_resolved_and_readable():
    c = qc.qsgd(bits=4)
    assert (c.bits, c.bucket_size, c.norm, c.stochastic) == (4, 512, "max", True)
    assert c == qc.qsgd(bits=4, bucket_size=512)
    assert repr(c) == "qsgd(bits=4, bucket_size=512, norm='max', stochastic=True)"
    assert qc.cast(jnp.bfloat16) == qc.cast("bfloat16")
    with pytest.raises(AttributeError, match="no setting 'levels'.*bits, bucket_size"):
        _ = c.levels


def test_array_settings_compare_by_identity():
    other = jnp.array(U)
    assert qc.pca(U, num_workers=2) != qc.pca(other, num_workers=2)
    assert "array (16, 4)" in repr(qc.pca(U, num_workers=2))


def test_entropy_plans_are_settings():
    e = qc.entropy()
    planned = e.with_plan((7, 100))
    assert planned == qc.entropy().with_plan((7, 100))
    assert planned != e and planned != e.with_plan((8, 100))
    assert planned.plan == qc.EntropyPlan(7, 100)


def test_static_jit_argument_shares_the_compiled_program():
    traces = []

    def round_trip(x, c):
        traces.append(c)
        return c.decode(c.encode(x, jax.random.key(0)))

    f = jax.jit(round_trip, static_argnums=1)
    x = jnp.linspace(-1.0, 1.0, 64)
    first = f(x, qc.qsgd(bits=8))
    second = f(x, qc.qsgd(bits=8))
    assert len(traces) == 1
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    f(x, qc.qsgd(bits=4))
    assert len(traces) == 2
