"""The recipes that keep a model's loss: the exact mean before compression
(``compress_after``) and Adam's variance frozen where compression starts."""

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
    """The warm-up sends what an exact all-reduce sends, the compressed
    phase what the transformation without warm-up sends."""
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
    assert measured(_tx(compress_after=5)) == {"compressed": alone, "warm-up": plain}
    assert measured(_tx()) == {}
    spans = transforms.warm_up_phases(600, compress_after=120)
    assert transforms.steps_per_phase(spans) == {"warm-up": 120, "compressed": 480}
    assert spans == transforms.powersgd_phases(600, start_iter=120)


def test_compress_after_is_checked():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="compress_after"):
            _tx(compress_after=bad)
    with pytest.raises(ValueError, match="compress_after"):
        transforms.warm_up_phases(10, compress_after=-2)


def test_frozen_adam_is_optax_adam_until_the_freeze_then_nu_stays():
    adam, frozen = optax.scale_by_adam(), transforms.scale_by_frozen_adam(3)
    params = {"w": jnp.zeros(5), "m": jnp.zeros((2, 3))}
    a, f = adam.init(params), frozen.init(params)
    for i, g in enumerate([0.5, -1.0, 2.0, 40.0, -7.0]):
        grads = jax.tree.map(lambda p, g=g: jnp.linspace(-1, 1, p.size).reshape(p.shape) * g,
                             params)
        ua, a = adam.update(grads, a)
        uf, f = frozen.update(grads, f)
        if i < 3:   # 1 - b2 ** t in float32 is good to about 2e-5 of itself at t = 3
            jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4), uf, ua)
            nu = f.nu
        else:   # mu still follows Adam's; nu and its bias correction do not
            jax.tree.map(np.testing.assert_array_equal, f.nu, nu)
            jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), f.mu, a.mu)
    # AdamW: the same with decoupled weight decay and a schedule
    w = {"w": jnp.linspace(-1, 1, 5)}
    grads = {"w": jnp.linspace(2, 3, 5)}
    ours = transforms.frozen_adamw(optax.linear_schedule(1e-2, 1e-3, 10), 4, weight_decay=0.1)
    theirs = optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.1)
    uo, _ = ours.update(grads, ours.init(w), w)
    ut, _ = theirs.update(grads, theirs.init(w), w)
    np.testing.assert_allclose(uo["w"], ut["w"], rtol=1e-6)


def test_frozen_adam_settings_are_checked_and_mu_dtype_is_kept():
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="freeze_after"):
            transforms.scale_by_frozen_adam(bad)
    tx = transforms.scale_by_frozen_adam(2, mu_dtype=jnp.bfloat16)
    state = tx.init({"w": jnp.zeros(3)})
    _, state = tx.update({"w": jnp.ones(3)}, state)
    assert state.mu["w"].dtype == jnp.bfloat16 and state.nu["w"].dtype == jnp.float32


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
               transforms.powersgd("d", rank=2, key=jax.random.key(0), start_iter=0,
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
