"""Compressors are values: equal settings, equal compressors, one compiled program."""

import dataclasses

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
    "qsgd-8": (qc.qsgd, {"bits": 8}, {"bits": 8, "bucket_size": None}),
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
    with pytest.raises(AttributeError, match="levels"):
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
    assert planned.codec is e.codec and planned.floor == e.floor == 6


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


@pytest.mark.parametrize("name", sorted(CASES))
def test_static_jit_argument_per_factory(name):
    factory, kwargs, other = CASES[name]
    traces = []

    def scaled(x, c):
        traces.append(c)
        return x * c.block

    f = jax.jit(scaled, static_argnums=1)
    x = jnp.ones(4)
    f(x, _build(factory, kwargs))
    f(x, _build(factory, kwargs))
    assert len(traces) == 1
    if other is not None:
        f(x, _build(factory, other))
        assert len(traces) == 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_settings_are_typed_fields(name):
    """Every setting is a declared dataclass field of the family's class (or a
    `Compressor` field), listed in ``setting_names``; an unknown name is an
    ordinary AttributeError."""
    factory, kwargs, _ = CASES[name]
    c = _build(factory, kwargs)
    fields = {f.name: f for f in dataclasses.fields(c)}
    assert tuple(k for k, _ in c.settings) == type(c).setting_names
    for key, value in c.settings:
        assert key in fields and getattr(c, key) is value
    assert "__getattr__" not in vars(qc.Compressor)
    with pytest.raises(AttributeError, match="levelz"):
        _ = c.levelz
    assert not hasattr(c, "levelz")


@pytest.mark.parametrize("name", sorted(CASES))
def test_value_semantics(name):
    factory, kwargs, _ = CASES[name]
    c = _build(factory, kwargs)
    assert isinstance(c, qc.Compressor) and dataclasses.is_dataclass(c)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.name = "other"
    # Every setting is the field of the same name.
    for key, value in c.settings:
        assert key in {f.name for f in dataclasses.fields(c)} and getattr(c, key) is value
    assert c != c.name and c != dict(c.settings)


@pytest.mark.parametrize("name", sorted(k for k in CASES if k not in ("pca", "powersgd")))
def test_repr_is_the_factory_call(name):
    factory, kwargs, other = CASES[name]
    for c in [_build(factory, kwargs)] + ([] if other is None else [_build(factory, other)]):
        assert eval(repr(c), {f: getattr(qc, f) for f in qc.__all__}) == c


def test_reprs_of_every_family():
    assert repr(qc.identity()) == "identity()"
    assert repr(qc.cast(jnp.float16)) == "cast(dtype='float16')"
    assert repr(qc.onebit(grouping="column")) == (
        "onebit(grouping='column', bucket_size=64, sample=None)")
    assert repr(qc.threshold(0.5)) == (
        "threshold(tau=0.5, capacity=0.03125, coding='words', rice_k=None)")
    assert repr(qc.adaptive(16)).startswith("adaptive(proportion=16.0, sample=None, ")
    assert repr(qc.entropy(floor=5)).startswith("entropy(sample_fraction=0.03, ")
    assert repr(qc.entropy().with_plan((7, 100))).endswith(
        ", plan=EntropyPlan(bits=7, words=100))")
    assert repr(qc.powersgd(U, side="left")) == (
        "powersgd(factor=<array (16, 4) float32>, side='left', view='last')")
    assert repr(qc.pca(U, num_workers=2)) == (
        "pca(basis=<array (16, 4) float32>, mean=None, num_workers=2)")


def test_settings_are_recorded_validated():
    assert qc.qsgd(bits=np.int64(4)) == qc.qsgd(bits=4)
    assert repr(qc.qsgd(bits=np.int64(4))).startswith("qsgd(bits=4, ")
    assert qc.qsgd(bits=16, bucket_size=None).bucket_size is None
    assert qc.qsgd(stochastic=np.bool_(False)).stochastic is False
    for bad in ({"bits": 4.0}, {"bits": True}, {"stochastic": 1}, {"norm": 2}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            qc.qsgd(**bad)
    # A count and a fraction are different capacities (1 slot against all of them).
    assert qc.threshold(0.5, capacity=1) != qc.threshold(0.5, capacity=1.0)
    assert qc.threshold(0.5).tau == 0.5 and qc.adaptive(16).proportion == 16.0
    assert qc.onebit(grouping="column").grouping == "column"
    assert qc.cast(jnp.bfloat16).dtype == "bfloat16"


def test_traced_array_settings_compare_without_tracer_errors():
    seen = {}

    @jax.jit
    def step(basis, factor):
        a, b = qc.pca(basis, num_workers=2), qc.pca(basis, num_workers=2)
        seen["pca"] = (a == b, hash(a) == hash(b), a != qc.pca(factor, num_workers=2))
        p, q = qc.powersgd(factor), qc.powersgd(factor)
        seen["powersgd"] = (p == q, {p: 1}[q] == 1, p != qc.powersgd(basis))
        assert p.factor is factor
        return a.decode(a.encode(jnp.ones(32)))

    step(U, U + 0.0)
    assert seen == {"pca": (True, True, True), "powersgd": (True, True, True)}
    np_basis = np.asarray(U)
    assert qc.pca(np_basis, num_workers=2) == qc.pca(np_basis, num_workers=2)
    assert qc.pca(np_basis, num_workers=2) != qc.pca(np_basis.copy(), num_workers=2)


def test_entropy_plans_hit_one_compiled_program_each():
    traces = []

    def encode(x, c):
        traces.append(c)
        return c.encode(x).arrays["stream"]

    f = jax.jit(encode, static_argnums=1)
    x = jnp.linspace(-1.0, 1.0, 64)
    a = f(x, qc.entropy(sample_fraction=1.0, huffman=False).with_plan((7, 20)))
    b = f(x, qc.entropy(sample_fraction=1.0, huffman=False).with_plan((7, 20)))
    assert len(traces) == 1 and a.shape == b.shape == (20,)
    f(x, qc.entropy(sample_fraction=1.0, huffman=False).with_plan((8, 20)))
    assert len(traces) == 2
