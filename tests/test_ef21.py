"""transforms.compressed_all_reduce with EF21 (and EF21-SGDM) error feedback and
zero-gradient row masks: the estimator's invariants, convergence, state, bytes."""

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms
from tests.helpers import mesh_of, sharded_update, train_sharded

N = 4
# Leaves of several shapes and scales: a matrix, a conv kernel, a vector.
SHAPES = {"w": (48, 40), "k": (3, 3, 4, 8), "b": (40,)}
SCALES = {"w": 1.0, "k": 1e-3, "b": 1e2}
AXES = ("node", "local")


def _grads(seed, n=N):
    rng = np.random.default_rng(seed)
    return {k: (SCALES[k] * rng.standard_normal((n,) + s)).astype(np.float32)
            for k, s in SHAPES.items()}


def _template():
    return {k: jnp.zeros(s) for k, s in SHAPES.items()}


#: The two strategies by name, for tests that run both.
FEEDBACK = {"residual": transforms.residual_feedback(), "ef21": transforms.ef21()}
EF21 = transforms.ef21()


def _tx(compressor=None, axis_name="d", **kwargs):
    return transforms.compressed_all_reduce(
        axis_name, compressor=qc.onebit() if compressor is None else compressor,
        key=jax.random.key(1), **kwargs)


def _host(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _steps(tx, grads_of_step, steps, template=None):
    """``[(update, state)]`` after each of ``steps`` steps on N devices, on the host."""
    state = transforms.init_sharded(tx, _template() if template is None else template,
                                    mesh_of(N), "d")
    step = sharded_update(tx, N, state)
    out = []
    for t in range(steps):
        update, state = step(grads_of_step(t), state)
        out.append((_host(update), state))
    return out


@functools.cache
def _hierarchical_mesh():
    return jax.sharding.Mesh(np.asarray(jax.devices()[:N]).reshape(2, 2), AXES)


def _hierarchical_steps(tx, grads_of_step, steps):
    """`_steps` over the ("node", "local") pair of a 2 x 2 mesh."""
    mesh = _hierarchical_mesh()
    state = transforms.init_sharded(tx, _template(), mesh, AXES)
    specs = transforms.state_specs(state, AXES)
    run = jax.jit(jax.shard_map(lambda g, s: tx.update(jax.tree.map(lambda a: a[0], g), s),
                                mesh=mesh, in_specs=(P(AXES), specs), out_specs=(P(), specs)))
    out = []
    for t in range(steps):
        update, state = jax.block_until_ready(
            run(jax.device_put(grads_of_step(t), NamedSharding(mesh, P(AXES))), state))
        out.append((_host(update), state))
    return out


def _values(update, state):
    """The update and every state field but the PRNG key, as leaves."""
    return jax.tree.leaves((update, state._replace(key=None)))


def _field(state, name, leaf):
    """A field of the state's error feedback at a leaf, on the host (float64),
    or None where it is masked or the strategy keeps no such field."""
    if name not in state.feedback._fields:
        return None
    value = getattr(state.feedback, name)[leaf]
    return None if isinstance(value, optax.MaskedNode) else np.asarray(value, np.float64)


@pytest.mark.parametrize("algorithm", ["auto", "pairwise"])
@pytest.mark.parametrize("mean", [True, False])
def test_an_exact_compressor_gives_the_exact_mean(algorithm, mean):
    """With the identity compressor (linear: the compressed-domain ring, or
    pairwise) every step's update is the mean (or sum), and the estimates
    are the gradients: g_i = grad_i, g = their mean."""
    tx = _tx(qc.identity(), error_feedback=EF21, mean=mean, algorithm=algorithm)
    for t, (update, state) in enumerate(_steps(tx, _grads, 3)):
        for k, g in _grads(t).items():
            want = g.mean(0) if mean else g.sum(0)
            tol = 1e-5 * SCALES[k] * (1 if mean else N)
            np.testing.assert_allclose(update[k], want, rtol=1e-5, atol=tol)
            np.testing.assert_allclose(_field(state, "estimate", k), want, rtol=1e-5, atol=tol)
            np.testing.assert_allclose(_field(state, "local_estimate", k), g, rtol=1e-5,
                                       atol=1e-6 * SCALES[k])
            owner = _field(state, "owner_residual", k)
            if algorithm == "auto":
                assert owner is None     # the ring sums what the devices contributed
            else:
                np.testing.assert_allclose(owner, 0.0, atol=1e-6 * SCALES[k])


# compressor, algorithm, over the hierarchical pair: each way the estimate is kept.
INVARIANT = {
    "onebit_auto": (qc.onebit(), "auto", False),
    "qsgd4_pairwise": (qc.qsgd(bits=4), "pairwise", False),
    "onebit_hierarchical": (qc.onebit(), "auto", True),
}


@pytest.mark.parametrize("name", INVARIANT)
def test_the_estimate_is_the_mean_of_the_devices_estimates(name):
    """After every step g = mean_i g_i - sum_i e_i / N, e_i the owners' kept
    re-encoding errors: the gap between g and mean_i g_i is that bounded
    term, and does not grow over 30 steps."""
    compressor, algorithm, hierarchical = INVARIANT[name]
    tx = _tx(compressor, axis_name=AXES if hierarchical else "d", algorithm=algorithm,
             error_feedback=EF21)
    steps = (_hierarchical_steps if hierarchical else _steps)(tx, _grads, 30)
    gaps = []
    for update, state in steps:
        gap = 0.0
        for k in SHAPES:
            g, g_i = _field(state, "estimate", k), _field(state, "local_estimate", k)
            owner = _field(state, "owner_residual", k)
            assert owner is not None     # pairwise: the owner's error is kept
            np.testing.assert_allclose(g, g_i.mean(0) - owner.sum(0) / N, rtol=1e-4,
                                       atol=1e-5 * SCALES[k])
            np.testing.assert_array_equal(update[k], g.astype(np.float32))
            gap = max(gap, np.abs(g - g_i.mean(0)).max() / SCALES[k])
        gaps.append(gap)
    assert 0 < max(gaps[20:]) < 3 * max(gaps[:10]), gaps


def test_constant_gradients_are_learned_geometrically():
    """Each device's gradient constant: EF21's update tends to the true mean
    (g_i -> grad_i), the error shrinking geometrically; the classic residual's
    update keeps its error (only its running sum is right)."""
    fixed = _grads(0)
    for compressor in (qc.onebit(), qc.onebit(bucket_size=8)):
        errors = {}
        for mode, feedback in FEEDBACK.items():
            runs = _steps(_tx(compressor, error_feedback=feedback), lambda t: fixed, 40)
            errors[mode] = [max(np.abs(u[k] - fixed[k].mean(0)).max() / SCALES[k]
                                for k in SHAPES) for u, _ in runs]
            assert np.isfinite(errors[mode]).all()
        ef21 = errors["ef21"]
        assert ef21[39] < 0.5 * ef21[20] < 0.25 * ef21[5], ef21
        assert min(errors["residual"][20:]) > 0.3 * errors["residual"][0]
    assert ef21[39] < 1e-5    # buckets of 8 contract fast: to float32 rounding


def test_momentum_follows_its_recursion():
    """EF21-SGDM: v_i is the first gradient at step 0, then (1 - eta) v_i +
    eta grad_i; with an exact compressor the update is the mean of the v_i."""
    eta = 0.3
    for compressor in (qc.identity(), qc.onebit()):
        v = None
        tx = _tx(compressor, error_feedback=transforms.ef21(momentum=eta))
        for t, (update, state) in enumerate(_steps(tx, _grads, 4)):
            g = _host(_grads(t))
            v = g if v is None else jax.tree.map(lambda a, b: (1 - eta) * a + eta * b, v, g)
            for k in SHAPES:
                np.testing.assert_allclose(_field(state, "momentum", k), v[k], rtol=1e-5,
                                           atol=1e-6 * SCALES[k])
                if compressor == qc.identity():
                    np.testing.assert_allclose(update[k], v[k].mean(0), rtol=1e-5,
                                               atol=1e-6 * SCALES[k])


def test_exact_steps_first_start_from_the_full_gradient():
    """compress_after: the exact steps send the exact mean and set g_i to
    each device's gradient and g to the mean; the first compressed step
    starts from there."""
    runs = _steps(_tx(error_feedback=EF21, compress_after=2), _grads, 3)
    for t in range(2):
        update, state = runs[t]
        for k, g in _grads(t).items():
            np.testing.assert_allclose(update[k], g.mean(0), rtol=1e-5, atol=1e-6 * SCALES[k])
            np.testing.assert_array_equal(_field(state, "local_estimate", k), g)
            np.testing.assert_allclose(_field(state, "estimate", k), g.mean(0), rtol=1e-6,
                                       atol=1e-7 * SCALES[k])
    update, state = runs[2]
    assert not np.allclose(update["w"], _grads(2)["w"].mean(0), rtol=1e-3)  # compressed


DIM, OUT, BATCH = 12, 3, 32


@functools.cache
def _least_squares(tx, steps=300, lr=0.02):
    """The mean loss of every step of least squares on N devices, ``tx`` then Adam."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (N, BATCH, DIM))
    y = x @ jax.random.normal(k2, (DIM, OUT)) + 0.01 * jax.random.normal(k3, (N, BATCH, OUT))
    params = {"w": jnp.zeros((DIM, OUT)), "b": jnp.zeros((OUT,))}

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    return train_sharded(optax.chain(tx, optax.adam(lr)), loss, params, x, y, steps, N)[2]


TRAINING = {
    "onebit": (qc.onebit(), None),
    "onebit_sgdm": (qc.onebit(), 0.5),
    "qsgd4": (qc.qsgd(bits=4, stochastic=False), None),
}


@pytest.mark.parametrize("name", TRAINING)
def test_least_squares_trains_to_the_exact_loss(name):
    """Adam at 0.02 for 300 steps: EF21 ends within 5% of the exact mean's
    loss (1-bit EF21 lags at 0.05, where its estimate trails the gradient:
    docs/transforms.md, "Error feedback: residual or EF21")."""
    compressor, eta = TRAINING[name]
    exact = _least_squares(_tx(qc.identity()))
    ours = _least_squares(_tx(compressor, error_feedback=transforms.ef21(momentum=eta)))
    assert ours[-1] < 1e-3 * ours[0]
    assert ours[-1] <= 1.05 * exact[-1], (ours[-1], exact[-1])


def test_settings_are_checked():
    for bad in ("ef", "EF21", 1, "residuals", qc.onebit(), transforms.EF21State):
        with pytest.raises(ValueError, match=r"error_feedback must be transforms\."
                           r"residual_feedback\(\), transforms\.ef21\(\.\.\.\) or None"):
            _tx(error_feedback=bad)
    for bad in (0, 0.0, -0.1, 1.5, 2.0, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match=r"^momentum must be"):
            transforms.ef21(momentum=bad)
    with pytest.raises(ValueError, match=r"error_feedback=transforms\.ef21\(\).*ring_requantize"):
        _tx(error_feedback=EF21, algorithm="ring_requantize")
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="mask_zero_rows"):
            _tx(mask_zero_rows=bad)
    _tx(error_feedback=transforms.ef21(momentum=1))    # eta = 1: no averaging


def test_strategies_are_values():
    """Like compressors: equal settings, equal (and equally hashed) strategies;
    frozen."""
    assert transforms.residual_feedback() == transforms.residual_feedback()
    assert transforms.ef21() == EF21 != transforms.ef21(momentum=0.5)
    assert transforms.ef21(momentum=0.5) == transforms.ef21(momentum=0.5)
    assert hash(transforms.ef21(momentum=0.5)) == hash(transforms.ef21(momentum=0.5))
    assert hash(transforms.residual_feedback()) == hash(transforms.residual_feedback())
    assert transforms.ef21() != transforms.residual_feedback()
    assert len({transforms.residual_feedback(), transforms.residual_feedback(), EF21,
                transforms.ef21(), transforms.ef21(momentum=0.5)}) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        EF21.momentum = 0.5


def test_each_strategy_keeps_its_own_state_type():
    """The state is (feedback, key, count): a ResidualState for the residual
    (no EF21 field in it) and for None (every leaf masked), an EF21State for
    EF21."""
    assert transforms.CompressedAllReduceState._fields == ("feedback", "key", "count")
    residual = _tx().init(_template()).feedback
    assert type(residual) is transforms.ResidualState
    assert residual._fields == ("residual", "owner_residual")
    assert not any(hasattr(residual, name)
                   for name in ("local_estimate", "estimate", "momentum"))
    assert {k: v.shape for k, v in residual.residual.items()} == SHAPES
    none = _tx(error_feedback=None, algorithm="pairwise").init(_template()).feedback
    assert type(none) is transforms.ResidualState
    masked = jax.tree.leaves(none, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    assert len(masked) == 2 * len(SHAPES)
    assert all(isinstance(x, optax.MaskedNode) for x in masked)
    for strategy in (EF21, transforms.ef21(momentum=0.5)):
        ef21 = _tx(error_feedback=strategy).init(_template()).feedback
        assert type(ef21) is transforms.EF21State
        assert ef21._fields == ("local_estimate", "estimate", "owner_residual", "momentum")
        assert isinstance(ef21.momentum["w"], optax.MaskedNode) == (strategy.momentum is None)


def test_a_state_of_another_strategy_is_refused():
    """A state made under one strategy, passed to a transformation of the
    other: ValueError naming both state types."""
    residual, ef21 = _tx(), _tx(error_feedback=EF21)
    for made, used, name in ((ef21, residual, "EF21State"), (residual, ef21, "ResidualState")):
        state = transforms.init_sharded(made, _template(), mesh_of(N), "d")
        with pytest.raises(ValueError, match=f"the state's error feedback is of type {name}"):
            sharded_update(used, N, state)(_grads(0), state)


def test_state_fields_and_their_specs():
    """EF21's estimate is replicated, P(); g_i, the owner's error and the
    momentum per device, P("d"); masked on uncompressed leaves, and the
    residual's owner error where it runs no pairwise algorithm."""
    tx = _tx(error_feedback=transforms.ef21(momentum=0.5), min_size=41)
    specs = transforms.state_specs(jax.eval_shape(tx.init, _template()), "d").feedback
    assert specs.estimate["w"] == specs.estimate["k"] == P()
    assert (specs.momentum["w"] == specs.local_estimate["w"] == specs.owner_residual["w"]
            == P("d"))
    for field in specs._fields:
        assert isinstance(getattr(specs, field)["b"], optax.MaskedNode)   # 40 < min_size
    plain = transforms.state_specs(jax.eval_shape(_tx().init, _template()), "d").feedback
    assert plain.residual["w"] == P("d")
    assert isinstance(plain.owner_residual["w"], optax.MaskedNode)   # "auto" on the residual


def test_non_finite_gradients_leave_every_field_unchanged():
    tx = _tx(error_feedback=transforms.ef21(momentum=0.5), mask_zero_rows=True)
    state = transforms.init_sharded(tx, _template(), mesh_of(N), "d")
    step = sharded_update(tx, N, state)
    for t in range(3):
        _, state = step(_grads(t), state)
    bad = _grads(3)
    bad["k"][2, 0, 1, 2, 3] = np.nan
    update, after = step(bad, state)
    assert not np.isfinite(np.asarray(update["k"])).all()
    assert len(jax.tree.leaves(state.feedback)) == 4 * len(SHAPES)   # every field kept
    for a, b in zip(jax.tree.leaves(state.feedback), jax.tree.leaves(after.feedback),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(after.count) == int(state.count) + 1


def _bytes(tx, ops=False):
    state = transforms.init_sharded(tx, _template(), mesh_of(N), "d")
    grads = jax.device_put(_grads(0), NamedSharding(mesh_of(N), P("d")))
    return (qc.wire_report if ops else qc.wire_bytes)(sharded_update(tx, N, state).mapped,
                                                      grads, state)


def test_wire_bytes():
    """EF21 sends what the classic residual sends; EF21-SGDM too; the mask
    adds one all-reduce of one byte per row (48 + 3 + the vector's 1)."""
    qsgd = qc.qsgd(bits=4)
    assert _bytes(_tx(qsgd, error_feedback=EF21)) == _bytes(_tx(qsgd)) > 0
    plain, rows = _bytes(_tx()), 48 + 3 + 1
    assert _bytes(_tx(error_feedback=EF21)) == plain
    assert _bytes(_tx(error_feedback=transforms.ef21(momentum=0.9))) == plain
    for feedback in FEEDBACK.values():
        masked = _bytes(_tx(error_feedback=feedback, mask_zero_rows=True))
        assert masked - plain == 2 * (N - 1) / N * rows
    flags = [op for op in _bytes(_tx(mask_zero_rows=True), ops=True) if op.op == "all-reduce"]
    assert [(op.operand_bytes, op.multiplicity) for op in flags] == [(rows, 1)]


#: The older spellings of ``error_feedback=`` (and ``ef21_momentum=``), the
#: strategy each names, and how its warning spells that strategy.
OLDER_SPELLINGS = [
    (dict(error_feedback=True), transforms.residual_feedback(),
     "error_feedback=transforms.residual_feedback()"),
    (dict(error_feedback="residual"), transforms.residual_feedback(),
     "error_feedback=transforms.residual_feedback()"),
    (dict(error_feedback=False), None, "error_feedback=None"),
    (dict(error_feedback="none"), None, "error_feedback=None"),
    (dict(error_feedback="ef21"), transforms.ef21(), "error_feedback=transforms.ef21()"),
    (dict(error_feedback="ef21", ef21_momentum=0.5), transforms.ef21(momentum=0.5),
     "error_feedback=transforms.ef21(momentum=...)"),
]


def test_the_older_spellings_warn_and_are_their_strategies_bit_for_bit():
    """True, "residual", False, "none", "ef21" and ef21_momentum= still work:
    each warns (DeprecationWarning, naming the new spelling) and is the same
    program as its strategy, with the same updates and state bit for bit;
    the older momentum is still checked, under its own name."""
    compressor = qc.qsgd(bits=4)
    for old, new, spelled in OLDER_SPELLINGS:
        with pytest.warns(DeprecationWarning, match=re.escape(spelled)):
            old_tx = _tx(compressor, **old)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            new_tx = _tx(compressor, error_feedback=new)
        # one program text from equal starting states: the same updates and
        # states bit for bit, step after step (one program, one input)
        texts, starts = set(), []
        for tx in (old_tx, new_tx):
            state = transforms.init_sharded(tx, _template(), mesh_of(N), "d")
            step = sharded_update(tx, N, state)
            grads = jax.device_put(_grads(0), NamedSharding(mesh_of(N), P("d")))
            texts.add(step.mapped.lower(grads, state).as_text())
            starts.append(jax.tree.leaves(state._replace(key=None)))
        assert len(texts) == 1, old
        for a, b in zip(jax.tree.leaves(starts[0]), jax.tree.leaves(starts[1]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for bad in (0, 1.5, float("nan"), True, "0.5"):
        with pytest.warns(DeprecationWarning), pytest.raises(ValueError,
                                                             match="^ef21_momentum must"):
            _tx(error_feedback="ef21", ef21_momentum=bad)
    for feedback in (transforms.residual_feedback(), None, True, "none"):
        with pytest.warns(DeprecationWarning), pytest.raises(ValueError,
                                                             match="ef21_momentum.*needs EF21"):
            _tx(error_feedback=feedback, ef21_momentum=0.5)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="disagree"):
        _tx(error_feedback=transforms.ef21(momentum=0.9), ef21_momentum=0.5)


V, D, DEAD = 40, 16, 5   # an embedding of V rows; rows 0 .. DEAD - 1 get no gradient


def _embedding_grads(t, dead):
    """Gradients of an embedding and a vector: from step ``dead`` on, rows
    0 .. DEAD - 1 of the embedding and the whole vector are zero on every device."""
    rng = np.random.default_rng(t)
    emb = rng.standard_normal((N, V, D)).astype(np.float32)
    vec = rng.standard_normal((N, 40)).astype(np.float32)
    if t >= dead:
        emb[:, :DEAD] = 0.0
        vec[:] = 0.0
    return {"emb": emb, "vec": vec}


EMBEDDING = {"emb": jnp.zeros((V, D)), "vec": jnp.zeros(40)}


@pytest.mark.parametrize("name", FEEDBACK)
def test_rows_without_gradient_get_no_update_and_accrue_no_error(name):
    """Three steps with every row live, then six where rows 0 .. 4 (and the
    vector) get no gradient on any device. A sign compressor cannot send their
    zeros: without the mask they get updates and their state moves; with it
    their update is exactly zero and every state field keeps its value."""
    compressor = qc.onebit(bucket_size=256)       # buckets of 16 rows: dead and live together

    def run(mask):
        return _steps(_tx(compressor, error_feedback=FEEDBACK[name], mask_zero_rows=mask),
                      functools.partial(_embedding_grads, dead=3), 9, EMBEDDING)

    def dead(state, field):
        """The field's dead entries: the embedding's rows 0 .. DEAD - 1 and the vector."""
        emb, vec = _field(state, field, "emb"), _field(state, field, "vec")
        return None if emb is None else np.concatenate([emb[..., :DEAD, :].ravel(), vec.ravel()])

    plain, masked = run(False), run(True)
    for update, state in masked[3:]:
        assert not update["emb"][:DEAD].any() and not update["vec"].any()
        assert update["emb"][DEAD:].any()
        for field in state.feedback._fields:
            if dead(state, field) is not None:
                np.testing.assert_array_equal(dead(state, field), dead(masked[2][1], field))
    assert any(np.abs(u["emb"][:DEAD]).max() > 0.1 for u, _ in plain[3:])
    field = "residual" if name == "residual" else "estimate"
    moved = [np.abs(dead(s, field) - dead(plain[2][1], field)).max() for _, s in plain[3:]]
    assert moved[-1] > 0.1 and moved[-1] >= moved[0], moved


@pytest.mark.parametrize("name", FEEDBACK)
def test_the_mask_changes_nothing_where_every_row_has_gradient(name):
    runs = [_steps(_tx(qc.onebit(bucket_size=256), error_feedback=FEEDBACK[name],
                       mask_zero_rows=mask),
                   functools.partial(_embedding_grads, dead=99), 3, EMBEDDING)
            for mask in (False, True)]
    for (u1, s1), (u2, s2) in zip(*runs, strict=True):
        for a, b in zip(_values(u1, s1), _values(u2, s2), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_the_mask_finds_rows_zero_on_every_device_only():
    """A row with gradient on one device only is live: it is sent and updated."""
    grads = _embedding_grads(0, dead=0)
    grads["emb"][1, 2] = 1.0     # row 2 has gradient on device 1
    (update, _), = _steps(_tx(qc.identity(), mask_zero_rows=True), lambda t: grads, 1,
                          EMBEDDING)
    np.testing.assert_allclose(update["emb"][2], np.full(D, 1.0 / N), rtol=1e-6)
    assert not update["emb"][[0, 1, 3, 4]].any()
    np.testing.assert_allclose(update["emb"][DEAD:], grads["emb"][:, DEAD:].mean(0), rtol=1e-5,
                               atol=1e-6)
