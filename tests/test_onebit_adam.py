"""`transforms.onebit_adam`: Tang et al.'s Algorithm 1 through the compressed
all-reduce, on leaves of several shapes and scales over 4 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms
from tests.helpers import device_grads, least_squares, mesh_of, sharded_update, train_sharded

N = 4
SHAPES = {"w": (48, 40), "k": (3, 3, 4, 8), "b": (40,)}
SCALES = {"w": 1.0, "k": 1e-3, "b": 1e2}
K = 3


def _grads(seed):
    return device_grads(seed, SHAPES, SCALES, N)


def _params():
    return {k: jnp.full(s, 0.5, jnp.float32) for k, s in SHAPES.items()}


def _tx(**kwargs):
    settings = dict(learning_rate=1e-2, compress_after=K, key=jax.random.key(1))
    return transforms.onebit_adam("d", **(settings | kwargs))


def _stepper(tx):
    """``step(grads, state) -> (updates, state)`` on 4 devices, with the params."""
    state = transforms.init_sharded(tx, _params(), mesh_of(N), "d")
    specs = transforms.state_specs(state, "d")
    mapped = jax.jit(jax.shard_map(
        lambda g, s, p: tx.update(jax.tree.map(lambda x: x[0], g), s, p), mesh=mesh_of(N),
        in_specs=(P("d"), specs, P()), out_specs=(P(), specs)))

    def step(grads, state):
        grads = jax.device_put(grads, NamedSharding(mesh_of(N), P("d")))
        return jax.block_until_ready(mapped(grads, state, _params()))

    step.mapped = mapped
    return state, step


def _close(a, b, rtol=1e-5):
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=rtol,
                                   atol=1e-7 * SCALES[k])


def test_the_warm_up_is_adamw_on_the_mean_gradient():
    """For the ``compress_after`` steps: ``optax.adamw`` (masked decay, a
    schedule) on the exact mean of the devices' gradients."""
    lr = optax.linear_schedule(1e-2, 1e-3, 10)
    settings = dict(b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1, mask=transforms.matrices())
    state, step = _stepper(_tx(learning_rate=lr, **settings))
    adamw = optax.adamw(lr, **settings)
    theirs = adamw.init(_params())
    for t in range(K):
        ours, state = step(_grads(t), state)
        mean = jax.tree.map(lambda g: jnp.asarray(g.mean(0)), _grads(t))
        expected, theirs = adamw.update(mean, theirs, _params())
        _close(ours, expected)
    _close(state.adam.nu, theirs[0].nu)
    assert int(state.adam.count) == int(state.adam.nu_count) == K
    # nothing owed yet: the warm-up sent the exact mean
    assert all(float(jnp.abs(r).max()) == 0.0
               for r in jax.tree.leaves(state.sync.feedback.residual))


def test_an_exact_compressor_makes_it_adam_with_the_variance_frozen():
    """Algorithm 1 with a lossless compressor is momentum SGD preconditioned
    by the frozen variance: `transforms.frozen_adamw` on the mean gradient."""
    state, step = _stepper(_tx(compressor=qc.identity(), algorithm="pairwise"))
    frozen = transforms.frozen_adamw(1e-2, K, weight_decay=0.0)
    theirs = frozen.init(_params())
    for t in range(K + 3):
        ours, state = step(_grads(t), state)
        mean = jax.tree.map(lambda g: jnp.asarray(g.mean(0)), _grads(t))
        expected, theirs = frozen.update(mean, theirs, _params())
        _close(ours, expected, rtol=2e-5)
    assert int(state.adam.nu_count) == K and int(state.adam.count) == K + 3


def test_worker_and_server_errors_telescope():
    """Lines 5-11 with 1-bit signs: every compressed step's shared momentum
    is the devices' mean local momentum less what the worker and server
    errors still owe, so summed over steps ``sum m = sum mean_i m_i -
    mean_i e_i - sum_owners e_s / N``, and ``nu`` never moves."""
    state, step = _stepper(_tx())
    for t in range(K):
        _, state = step(_grads(t), state)
    nu = jax.tree.map(np.asarray, state.adam.nu)
    sent = {k: np.zeros(s, np.float64) for k, s in SHAPES.items()}
    local = {k: np.zeros(s, np.float64) for k, s in SHAPES.items()}
    for t in range(K, K + 4):
        mu = jax.tree.map(np.asarray, state.adam.mu)
        grads = _grads(t)
        local = jax.tree.map(lambda a, m, g: a + (0.9 * m + 0.1 * g.astype(np.float64)).mean(0),
                             local, mu, grads)
        _, state = step(grads, state)
        sent = jax.tree.map(lambda a, m: a + np.asarray(m, np.float64), sent, state.adam.mu)
        jax.tree.map(np.testing.assert_array_equal, state.adam.nu, nu)
    errors = jax.tree.map(lambda e, s: np.asarray(e, np.float64).mean(0) + np.asarray(
        s, np.float64).sum(0) / N, state.sync.feedback.residual,
        state.sync.feedback.owner_residual)
    for k in SHAPES:
        np.testing.assert_allclose(sent[k] + errors[k], local[k], rtol=1e-4,
                                   atol=1e-5 * SCALES[k])
        # and the momentum really went compressed: the errors are not zero
        assert np.abs(errors[k]).max() > 1e-4 * SCALES[k]


def test_the_compressed_phase_sends_the_compressors_bytes():
    """The warm-up sends float32's exact all-reduce; the compressed steps
    what one-bit's pairwise all-reduce of the momenta sends (the compiled
    program's own bytes), about 16x less."""
    state, step = _stepper(_tx())
    grads = jax.device_put(_grads(0), NamedSharding(mesh_of(N), P("d")))
    phases = qc.wire_bytes_by_phase(step.mapped, grads, state, _params())
    values = sum(int(np.prod(s)) for s in SHAPES.values())
    assert phases["exact"] == 2 * (N - 1) / N * 4 * values
    assert phases["exact"] / 20 < phases["compressed"] < phases["exact"] / 8
    # a bfloat16 warm-up: phase "lead-in", half of float32's bytes
    state, step = _stepper(_tx(compress_after=transforms.CompressAfter(
        K, warm_up=qc.cast("bfloat16"))))
    low = qc.wire_bytes_by_phase(step.mapped, grads, state, _params())
    assert low == {"lead-in": phases["exact"] / 2, "compressed": phases["compressed"]}


def test_non_finite_steps_are_skipped_in_either_phase():
    """A NaN on one device, at a warm-up step and at a compressed one: zero
    update, every part of the state as it was (the count too, so the
    freeze and the compression stay in step)."""
    state, step = _stepper(_tx())
    for t in range(K + 2):
        if t in (1, K + 1):
            bad = _grads(t)
            bad["w"][2, 0, 0] = np.nan
            updates, after = step(bad, state)
            assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(updates))
            for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(state), strict=True):
                np.testing.assert_array_equal(_bits(a), _bits(b))
        _, state = step(_grads(t), state)
    assert int(state.adam.count) == K + 2 and int(state.adam.nu_count) == K
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.sync.feedback))


def _bits(a):
    is_key = jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
    return np.asarray(jax.random.key_data(a) if is_key else a)


def test_state_is_placed_and_settings_are_checked():
    state = transforms.init_sharded(_tx(algorithm="pairwise"), _params(), mesh_of(N), "d")
    specs = transforms.state_specs(state, "d")
    assert specs.sync.feedback.residual["w"] == P("d")
    assert specs.sync.feedback.owner_residual["w"] == P("d")
    assert specs.adam.mu["w"] == P() and specs.adam.nu["w"] == P()
    for name, bad in (("compress_after", 0), ("b1", 1.0), ("b2", -0.1), ("eps", -1.0),
                      ("weight_decay", -1e-4), ("algorithm", "tree")):
        with pytest.raises(ValueError, match=name):
            _tx(**{name: bad})
    with pytest.raises(ValueError, match="params"):
        tx = _tx(weight_decay=0.1)
        tx.update({"w": jnp.zeros(3)}, tx.init({"w": jnp.zeros(3)}))


def test_integer_leaves_are_refused_by_name():
    tx = _tx()
    state = transforms.init_sharded(tx, {"w": jnp.zeros((N, 8)), "steps": jnp.zeros(3)},
                                    mesh_of(N), "d")
    step = sharded_update(tx, N, state)
    grads = {"w": np.ones((N, N, 8), np.float32), "steps": np.ones((N, 3), np.int32)}
    with pytest.raises((ValueError, TypeError), match="steps"):
        step(grads, state)


def test_it_trains_and_accumulate_runs_it_once_per_optimizer_step():
    """A least-squares model: the loss falls through the warm-up and on past
    the freeze; under `transforms.accumulate` (2 micro-batches) it runs once
    per optimizer step, so its counts are half the micro-steps."""
    params, loss, x, y = least_squares(N)

    tx = _tx(learning_rate=0.05, compress_after=10)
    _, state, losses = train_sharded(tx, loss, params, x, y, 100, N)
    # signs and two means per 64 values of the momentum: slower than exact
    # Adam on this tiny problem (0.005 of the start), but falling past the freeze
    assert losses[-1] < 0.05 * losses[0] and losses[-1] < 0.2 * losses[10]
    assert int(state.adam.count) == 100 and int(state.adam.nu_count) == 10
    acc = transforms.accumulate("d", inner=_tx(learning_rate=0.05, compress_after=10), every=2)
    _, state, losses = train_sharded(acc, loss, params, x, y, 40, N)
    assert int(state.inner.adam.count) == 20 and losses[-1] < 0.5 * losses[0]


def test_sharded_training_refuses_the_optimizers_that_reduce_inside():
    """Under FSDP the gradients are reduced shards: 1-bit Adam, 0/1 Adam and DeMo,
    which all-reduce each device's gradients, are refused by name."""
    params = {"w": jnp.zeros((N * 4, 8))}
    dims = qc.shard_dimensions(params, N)
    shards = transforms.shard_params(params, mesh_of(N), "d", dims)
    for tx in (_tx(), transforms.decoupled_momentum("d", learning_rate=1e-3),
               transforms.zero_one_adam("d", learning_rate=1e-3, freeze_after=10,
                                        key=jax.random.key(0))):
        assert isinstance(tx, optax.GradientTransformation)
        with pytest.raises(ValueError, match="frozen_adamw"):
            transforms.init_on_shards(tx, shards, mesh_of(N))
