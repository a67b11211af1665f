"""The recipes that keep a model's loss: the exact mean before compression
(``compress_after``) and Adam's variance frozen where compression starts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms
from tests.helpers import mesh_of, sharded_update

N = 4
# Leaves of several shapes and scales: a matrix, a conv kernel, a vector.
SHAPES = {"w": (48, 40), "k": (3, 3, 4, 8), "b": (40,)}
SCALES = {"w": 1.0, "k": 1e-3, "b": 1e2}


def _grads(seed):
    rng = np.random.default_rng(seed)
    return {k: (SCALES[k] * rng.standard_normal((N,) + s)).astype(np.float32)
            for k, s in SHAPES.items()}


def _template():
    return {k: jnp.zeros(s) for k, s in SHAPES.items()}


def _tx(**kwargs):
    return transforms.compressed_all_reduce("d", compressor=qc.onebit(), key=jax.random.key(1),
                                            **kwargs)


def _run(tx, steps, seed=0):
    state = transforms.init_sharded(tx, _template(), mesh_of(N), "d")
    step = sharded_update(tx, N, state)
    outs = []
    for t in range(steps):
        out, state = step(_grads(seed + t), state)
        outs.append(out)
    return outs, state, step


def _assert_close(a, b):
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=1e-5,
                                   atol=1e-6 * SCALES[k])


def test_compress_after_sends_the_exact_mean_then_the_compressor():
    """Steps before ``compress_after`` are the exact mean with untouched
    residuals; the first compressed step is the compressor's first step."""
    warm, state, _ = _run(_tx(compress_after=2), 3)
    for t in range(2):
        _assert_close(warm[t], jax.tree.map(lambda g: g.mean(0), _grads(t)))
    plain, _, _ = _run(_tx(), 1, seed=2)
    _assert_close(warm[2], plain[0])
    # onebit is no exact mean: the compressed step really compressed
    assert not np.allclose(warm[2]["w"], _grads(2)["w"].mean(0), rtol=1e-3)
    assert int(state.count) == 3


def test_each_phase_is_measured_and_scheduled_by_name():
    """The exact steps send what an exact all-reduce sends, the compressed
    phase what the transformation without them sends."""
    def measured(tx, by_phase=True):
        state = transforms.init_sharded(tx, _template(), mesh_of(N), "d")
        step = sharded_update(tx, N, state).mapped
        grads = jax.device_put(_grads(0), NamedSharding(mesh_of(N), P("d")))
        return (qc.wire_bytes_by_phase if by_phase else qc.wire_bytes)(step, grads, state)

    exact = optax.GradientTransformation(lambda p: optax.EmptyState(),
                                         lambda g, s, p=None: (lax.pmean(g, "d"), s))
    plain, alone = measured(exact, by_phase=False), measured(_tx(), by_phase=False)
    assert plain == 2 * (N - 1) / N * 4 * sum(int(np.prod(s)) for s in SHAPES.values())
    assert alone < plain / 8
    assert measured(_tx(compress_after=5)) == {"compressed": alone, "exact": plain}
    assert measured(_tx()) == {}
    spans = transforms.CompressAfter(120).spans(600)
    assert transforms.steps_per_phase(spans) == {"exact": 120, "compressed": 480}


@pytest.mark.parametrize("warm_up", [qc.cast("bfloat16"), qc.qsgd(bits=8)])
def test_a_warm_up_compressor_sends_the_first_steps_through_it(warm_up):
    """``CompressAfter(K, warm_up=c)``: the first K steps are the mean
    through ``c`` (close to the exact mean, not equal; the residuals
    untouched), marked ``"lead-in"`` and priced by their own bytes."""
    schedule = transforms.CompressAfter(2, warm_up=warm_up)
    warm, state, step = _run(_tx(compress_after=schedule), 3)
    exact, _, _ = _run(_tx(compress_after=2), 3)
    for t in range(2):
        mean = jax.tree.map(lambda g: g.mean(0), _grads(t))
        for k in SHAPES:
            err = np.abs(np.asarray(warm[t][k]) - mean[k]).max()
            assert 0 < err <= 0.02 * np.abs(_grads(t)[k]).max()
    _assert_close(warm[2], exact[2])    # the compressed phase starts from the same residuals
    grads = jax.device_put(_grads(0), NamedSharding(mesh_of(N), P("d")))
    phases = qc.wire_bytes_by_phase(step.mapped, grads, state)
    plain = 2 * (N - 1) / N * 4 * sum(int(np.prod(s)) for s in SHAPES.values())
    assert set(phases) == {"lead-in", "compressed"}
    # half of float32's or less (qsgd-8's scales and chunk padding on these small leaves)
    assert phases["compressed"] < phases["lead-in"] <= 0.52 * plain
    assert [s.name for s in schedule.spans(10)] == ["lead-in", "compressed"]


def test_a_warm_up_compressor_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="warm_up"):
        transforms.CompressAfter(2, warm_up="bf16")
    lossy = transforms.CompressAfter(2, warm_up=qc.cast("bfloat16"))
    with pytest.raises(ValueError, match="residual"):
        _tx(compress_after=lossy, error_feedback=transforms.ef21())
    with pytest.raises(ValueError, match="warm_up"):
        transforms.powersgd("d", rank=2, key=jax.random.key(0), compress_after=lossy)
    # the variance freeze reads only the steps
    frozen = transforms.frozen_adamw(1e-2, lossy)
    assert frozen.init({"w": jnp.zeros(2)})[0].nu_count == 0


def test_compress_after_is_checked():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="compress_after"):
            _tx(compress_after=bad)
    with pytest.raises(ValueError, match="compress_after"):
        transforms.CompressAfter(-2)


# Mixed leaves: a matrix, a conv kernel, a vector, a scalar and a None (no parameter).
ADAM_PARAMS = {"w": jnp.linspace(-1, 1, 12).reshape(3, 4), "k": jnp.ones((2, 2, 2, 3)),
               "b": jnp.linspace(0, 1, 4), "s": jnp.float32(0.5), "none": None}


def _adam_grads(t, scale=1.0):
    rng = np.random.default_rng(t)
    return jax.tree.map(lambda p: jnp.asarray(scale * rng.standard_normal(np.shape(p)),
                                              jnp.float32), ADAM_PARAMS)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("mu_dtype", [None, jnp.bfloat16])
def test_frozen_adamw_is_optax_adamw_bit_for_bit_until_the_freeze(nesterov, mu_dtype):
    """Every setting of ``optax.adamw`` (masked weight decay, a schedule,
    Nesterov, ``mu_dtype``), under jit: the same updates and moments, bit
    for bit, for each of the ``freeze_after`` steps."""
    settings = dict(b1=0.8, b2=0.99, eps=1e-6, eps_root=1e-9, mu_dtype=mu_dtype,
                    weight_decay=0.1, mask=transforms.matrices(), nesterov=nesterov)
    lr = optax.linear_schedule(1e-2, 1e-3, 10)
    theirs, ours = optax.adamw(lr, **settings), transforms.frozen_adamw(lr, 5, **settings)
    t_state, o_state = theirs.init(ADAM_PARAMS), ours.init(ADAM_PARAMS)
    t_step, o_step = jax.jit(theirs.update), jax.jit(ours.update)
    for t in range(5):
        grads = _adam_grads(t)
        ut, t_state = t_step(grads, t_state, ADAM_PARAMS)
        uo, o_state = o_step(grads, o_state, ADAM_PARAMS)
        assert jax.tree.structure(uo) == jax.tree.structure(ut)
        jax.tree.map(np.testing.assert_array_equal, uo, ut)
        adam, frozen = t_state[0], o_state[0]
        jax.tree.map(np.testing.assert_array_equal, (frozen.mu, frozen.nu), (adam.mu, adam.nu))
        assert int(frozen.count) == int(frozen.nu_count) == t + 1
    # the decay was masked: the bias and the scalar got none, the kernel some
    wd = transforms.frozen_adamw(1.0, 5, weight_decay=1.0, mask=transforms.matrices())
    zeros = jax.tree.map(jnp.zeros_like, ADAM_PARAMS)
    decayed, _ = wd.update(zeros, wd.init(ADAM_PARAMS), ADAM_PARAMS)
    np.testing.assert_array_equal(decayed["k"], -ADAM_PARAMS["k"])
    assert float(decayed["b"].sum()) == 0.0 and float(decayed["s"]) == 0.0


def test_frozen_adam_nu_stays_after_the_freeze():
    """After ``freeze_after`` steps a huge gradient (its square overflows
    float32) leaves ``nu`` exactly as it was; the update is Adam's ``mu``
    step by hand over ``nu`` with the bias correction of step
    ``freeze_after``, while ``mu`` goes on as optax's."""
    b1, b2, eps, k = 0.9, 0.999, 1e-8, 3
    frozen, adam = transforms.scale_by_frozen_adam(k), optax.scale_by_adam()
    f, a = frozen.init(ADAM_PARAMS), adam.init(ADAM_PARAMS)
    step, adam_step = jax.jit(frozen.update), jax.jit(adam.update)
    for t in range(k):
        _, f = step(_adam_grads(t), f)
        _, a = adam_step(_adam_grads(t), a)
    nu = f.nu
    for t in range(k, k + 2):
        grads = _adam_grads(t, scale=1e30)
        mu = jax.tree.map(lambda m, g: b1 * np.float64(m) + (1 - b1) * np.float64(g),
                          f.mu, grads)
        out, f = step(grads, f)
        _, a = adam_step(grads, a)
        jax.tree.map(np.testing.assert_array_equal, f.nu, nu)
        assert int(f.nu_count) == k and int(f.count) == t + 1
        jax.tree.map(np.testing.assert_array_equal, f.mu, a.mu)
        hand = jax.tree.map(lambda m, v, t=t: m / (1 - b1 ** (t + 1)) / (
            np.sqrt(np.float64(v) / (1 - b2 ** k)) + eps), mu, nu)
        # float32's 1 - b2 ** 3 is good to about 2e-5 of itself; step 4's or 5's
        # correction instead of step 3's would be 15% or 29% off
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=3e-5), out, hand)


def test_frozen_adam_settings_are_checked_and_mu_dtype_is_kept():
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="freeze_after"):
            transforms.scale_by_frozen_adam(bad)
    tx = transforms.scale_by_frozen_adam(2, mu_dtype=jnp.bfloat16)
    state = tx.init({"w": jnp.zeros(3)})
    _, state = tx.update({"w": jnp.ones(3)}, state)
    assert state.mu["w"].dtype == jnp.bfloat16 and state.nu["w"].dtype == jnp.float32


def test_one_schedule_value_drives_the_freeze_and_the_compression():
    """``freeze_after=CompressAfter(K)`` is ``freeze_after=K`` bit for bit;
    chained after ``compress_after`` of the same value, Adam's ``nu`` takes
    in exactly the K exact steps' gradients: the all-reduce's first
    compressed step is the first that leaves ``nu`` as it was."""
    k = 2
    warm = transforms.CompressAfter(k)
    by_int, by_value = transforms.frozen_adamw(1e-2, k), transforms.frozen_adamw(1e-2, warm)
    a, b = by_int.init(ADAM_PARAMS), by_value.init(ADAM_PARAMS)
    for t in range(4):
        out_a, a = jax.jit(by_int.update)(_adam_grads(t), a, ADAM_PARAMS)
        out_b, b = jax.jit(by_value.update)(_adam_grads(t), b, ADAM_PARAMS)
        jax.tree.map(np.testing.assert_array_equal, (out_a, a), (out_b, b))
    for bad in (transforms.CompressAfter(0), "2"):
        with pytest.raises(ValueError, match="freeze_after"):
            transforms.frozen_adamw(1e-2, bad)
    tx = optax.chain(_tx(compress_after=warm), transforms.scale_by_frozen_adam(warm))
    state = transforms.init_sharded(tx, _template(), mesh_of(N), "d")
    step = sharded_update(tx, N, state)
    nus = []
    for t in range(k + 2):
        _, state = step(_grads(t), state)
        nus.append(jax.tree.map(np.asarray, state[1].nu))
    changed = [any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before),
                                                              jax.tree.leaves(after)))
               for before, after in zip(nus, nus[1:])]
    assert changed == [True] + [False] * k    # step 2 (exact) moved nu; 3 and 4 did not
    assert int(state[1].nu_count) == k


def test_one_bit_adam_recipe_trains_on_devices():
    """The whole recipe as one optax chain: the exact mean and Adam for K
    steps, then one-bit with Adam's variance frozen; the loss falls."""
    from tests.helpers import train_sharded

    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 32, 16)).astype(np.float32)
    w_true = rng.standard_normal((16, 4)).astype(np.float32)
    y = x @ w_true
    params = {"w": jnp.zeros((16, 4)), "b": jnp.zeros(4)}

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    tx = optax.chain(_tx(compress_after=10), transforms.frozen_adamw(0.05, 10, weight_decay=0.0))
    _, state, losses = train_sharded(tx, loss, params, x, y, 100, N)
    assert losses[-1] < 0.01 * losses[0]
    assert int(state[0].count) == 100 and int(state[1][0].count) == 100


def test_the_transformer_leaf_policy_keeps_vectors_and_embeddings_exact():
    """`transforms.matrices` through `compressed_all_reduce` and `powersgd`:
    the rejected leaves keep no state and are the exact mean, the others
    are compressed."""
    shapes = {"embed": {"embedding": (64, 40)}, "ln": {"scale": (40,)},
              "mlp": {"kernel": (40, 48)}}
    rng = np.random.default_rng(3)
    grads = jax.tree.map(lambda s: rng.standard_normal((N,) + s).astype(np.float32), shapes,
                         is_leaf=lambda s: isinstance(s, tuple))
    template = jax.tree.map(lambda g: jnp.zeros(g.shape[1:]), grads)
    mean = jax.tree.map(lambda g: g.mean(0), grads)
    policy = transforms.matrices(embeddings=False)
    for tx in (_tx(compress_if=policy),
               transforms.powersgd("d", rank=2, key=jax.random.key(0), compress_after=0,
                                   compress_if=policy)):
        state = transforms.init_sharded(tx, template, mesh_of(N), "d")
        out, _ = sharded_update(tx, N, state)(grads, state)
        kept = [not isinstance(x, optax.MaskedNode)
                for x in jax.tree.leaves(state[0], is_leaf=lambda x: isinstance(
                    x, optax.MaskedNode))][:3]
        assert kept == [False, False, True]   # flatten order: embed, ln, mlp
        for name in ("embed", "ln"):
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                         out[name], mean[name])
        assert not np.allclose(out["mlp"]["kernel"], mean["mlp"]["kernel"], rtol=1e-3)
    assert transforms.matrices()((), jnp.zeros((3, 3))) and not transforms.matrices()(
        (), jnp.zeros(3))


def test_matrices_is_one_rule_for_compression_and_for_optax_masks():
    """`transforms.matrices()` as ``compress_if`` of `compressed_all_reduce`
    (the bias and the scalar are the exact mean, the matrix and the conv
    kernel are compressed) and as the mask of ``optax.add_decayed_weights``
    (the same leaves decayed)."""
    shapes = {"dense": {"bias": (40,), "kernel": (40, 48)}, "conv": {"kernel": (3, 3, 4, 8)},
              "scale": ()}
    matrix = {"dense": {"bias": False, "kernel": True}, "conv": {"kernel": True},
              "scale": False}
    rule = transforms.matrices()
    params = jax.tree.map(lambda s: jnp.full(s, 2.0), shapes,
                          is_leaf=lambda s: isinstance(s, tuple))
    assert rule(params) == rule.mask(params) == matrix
    assert rule == transforms.matrices(embeddings=True) != transforms.matrices(embeddings=False)
    decay = optax.add_decayed_weights(0.5, mask=rule)
    zeros = jax.tree.map(jnp.zeros_like, params)
    decayed, _ = jax.jit(decay.update)(zeros, decay.init(params), params)
    jax.tree.map(lambda d, m: np.testing.assert_array_equal(d, 1.0 if m else 0.0),
                 decayed, matrix)
    rng = np.random.default_rng(5)
    grads = jax.tree.map(lambda s: rng.standard_normal((N,) + s).astype(np.float32), shapes,
                         is_leaf=lambda s: isinstance(s, tuple))
    tx = _tx(compress_if=rule)
    state = transforms.init_sharded(tx, params, mesh_of(N), "d")
    out, _ = sharded_update(tx, N, state)(grads, state)
    for name in ("dense/bias", "scale", "dense/kernel", "conv/kernel"):
        got, g = (functools.reduce(lambda t, k: t[k], name.split("/"), tree)
                  for tree in (out, grads))
        exact = np.allclose(got, g.mean(0), rtol=1e-5, atol=1e-6)
        assert exact != functools.reduce(lambda t, k: t[k], name.split("/"), matrix), name
