"""transforms.accumulate: k micro-batches per device, one all-reduce per optimizer step."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms
from tests.helpers import mesh_of

N = 4
K = 4
AXIS = "d"


def _mesh():
    return mesh_of(N)


def _params():
    """Leaves of other shapes and scales, one of them odd-sized."""
    k = jax.random.split(jax.random.key(5), 2)
    return {"w": 0.3 * jax.random.normal(k[0], (12, 32)), "b": jnp.full(32, 0.01),
            "v": 30.0 * jax.random.normal(k[1], (32, 4)), "odd": jnp.ones(7)}


def _loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) @ p["v"] - y) ** 2) + jnp.sum(p["odd"] ** 2)


def _micro_batches():
    """``K`` micro-batches of 2 rows per device: ``(K, N * 2, ...)``."""
    k = jax.random.split(jax.random.key(7), 2)
    return (jax.random.normal(k[0], (K, N * 2, 12)), jax.random.normal(k[1], (K, N * 2, 4)))


def _step(tx, state, mesh):
    specs = transforms.state_specs(state, AXIS)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)),
                       out_specs=(P(), specs))
    def step(params, state, x, y):
        g = jax.grad(_loss)(jax.lax.pcast(params, AXIS, to="varying"), x, y)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    return step


def _chain(compressor):
    return optax.chain(transforms.compressed_all_reduce(AXIS, compressor=compressor,
                                                        key=jax.random.key(0)),
                       optax.sgd(0.05))


def _put(mesh, a):
    return jax.device_put(a, NamedSharding(mesh, P(AXIS)))


def test_identity_accumulation_is_the_large_batch_step():
    """Four micro-batches per device accumulated, then one identity-compressed
    all-reduce: the step of the gradient of their union (float32 rounding)."""
    mesh = _mesh()
    x, y = _micro_batches()
    tx = transforms.accumulate(AXIS, inner=_chain(qc.identity()), every=K)
    state = transforms.init_sharded(tx, _params(), mesh, AXIS)
    step = _step(tx, state, mesh)
    params = _params()
    for t in range(K):
        before = params
        params, state = step(params, state, _put(mesh, x[t]), _put(mesh, y[t]))
        if t < K - 1:  # held: nothing moves
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # device d's rows of every micro-batch, all devices: the large batch
    big_x = x.reshape(K, N, 2, 12).transpose(1, 0, 2, 3).reshape(-1, 12)
    big_y = y.reshape(K, N, 2, 4).transpose(1, 0, 2, 3).reshape(-1, 4)
    grads = jax.grad(_loss)(_params(), big_x, big_y)
    want = jax.tree.map(lambda p, g: p - 0.05 * g, _params(), grads)
    for name in want:
        np.testing.assert_allclose(np.asarray(params[name]), np.asarray(want[name]),
                                   rtol=2e-6, atol=2e-6 * float(jnp.abs(want[name]).max()))
    assert int(state.micro_step) == 0
    assert all(float(jnp.abs(s).max()) == 0 for s in jax.tree.leaves(state.sums))


def _collectives(compiled_text: str) -> int:
    return len(re.findall(r"= [^=]*\b(all-reduce|collective-permute|all-gather|all-to-all|"
                          r"reduce-scatter)(-start)?\(", compiled_text))


@pytest.mark.parametrize("compressor", [qc.qsgd(bits=4), qc.onebit()],
                         ids=["qsgd-4", "onebit"])
def test_one_optimizer_step_of_bytes_per_k_micro_steps(compressor):
    """The compiled micro-step holds the wrapped all-reduce once, in the
    branch taken every k-th micro-step: held micro-steps send 0 bytes, the
    k-th sends exactly what the step without accumulation sends, with the
    same collectives in the HLO."""
    mesh = _mesh()
    x, y = _micro_batches()
    batch = (_put(mesh, x[0]), _put(mesh, y[0]))
    plain = _chain(compressor)
    plain_state = transforms.init_sharded(plain, _params(), mesh, AXIS)
    plain_step = _step(plain, plain_state, mesh)
    tx = transforms.accumulate(AXIS, inner=_chain(compressor), every=K)
    state = transforms.init_sharded(tx, _params(), mesh, AXIS)
    step = _step(tx, state, mesh)
    one_step = qc.wire_bytes(plain_step, _params(), plain_state, *batch)
    assert one_step > 0
    assert qc.wire_bytes(step, _params(), state, *batch, branches="min") == 0
    assert qc.wire_bytes(step, _params(), state, *batch, branches="max") == one_step
    per_optimizer_step = ((K - 1) * qc.wire_bytes(step, _params(), state, *batch,
                                                  branches="min")
                          + qc.wire_bytes(step, _params(), state, *batch, branches="max"))
    assert per_optimizer_step == one_step
    hlo = step.lower(_params(), state, *batch).compile().as_text()
    plain_hlo = plain_step.lower(_params(), plain_state, *batch).compile().as_text()
    assert _collectives(hlo) == _collectives(plain_hlo) > 0


def test_error_feedback_runs_once_per_optimizer_step_and_survives_a_bad_micro_batch():
    """Residuals change only on the k-th micro-step; a non-finite micro-batch
    on one device reaches neither the residuals nor the next optimizer step's
    sums (the update it yields is non-finite, for `optax.apply_if_finite` or
    the caller's check to skip, as without accumulation)."""
    mesh = _mesh()
    x, y = _micro_batches()
    tx = transforms.accumulate(AXIS, inner=_chain(qc.qsgd(bits=4)), every=K)
    state = transforms.init_sharded(tx, _params(), mesh, AXIS)
    step = _step(tx, state, mesh)
    params = _params()
    for t in range(K):
        params, state = step(params, state, _put(mesh, x[t]), _put(mesh, y[t]))
        residuals = jax.tree.leaves(state.inner[0].feedback.residual)
        encoded = any(float(jnp.abs(r).max()) > 0 for r in residuals)
        assert encoded == (t == K - 1), t
    kept = [np.asarray(r) for r in jax.tree.leaves(state.inner[0].feedback.residual)]
    bad_x = x.at[1, 0].set(jnp.nan)  # device 0's second micro-batch
    for t in range(K):
        _, state = step(params, state, _put(mesh, bad_x[t]), _put(mesh, y[t]))
    for before, after in zip(kept, jax.tree.leaves(state.inner[0].feedback.residual),
                             strict=True):
        np.testing.assert_array_equal(before, np.asarray(after))  # the bad step left them
    assert all(float(jnp.abs(s).max()) == 0 for s in jax.tree.leaves(state.sums))


def test_bf16_gradients_and_one_micro_step():
    mesh = _mesh()
    x, y = _micro_batches()
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _params())
    once = transforms.accumulate(AXIS, inner=_chain(qc.identity()), every=1)
    plain = _chain(qc.identity())
    outs = []
    for tx in (once, plain):
        state = transforms.init_sharded(tx, params, mesh, AXIS)
        new, _ = _step(tx, state, mesh)(params, state, _put(mesh, x[0]), _put(mesh, y[0]))
        outs.append(new)
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_state_specs_and_bad_settings():
    tx = transforms.accumulate(AXIS, inner=_chain(qc.onebit()), every=K)
    specs = transforms.state_specs(jax.eval_shape(tx.init, _params()), AXIS)
    assert all(s == P(AXIS) for s in jax.tree.leaves(specs.sums))
    assert specs.micro_step == P() and specs.inner[0].feedback.residual["w"] == P(AXIS)
    for every in (0, 1.5, "4"):
        with pytest.raises(ValueError, match="every"):
            transforms.accumulate(AXIS, inner=optax.sgd(0.1), every=every)
    with pytest.raises(ValueError, match="inner"):
        transforms.accumulate(AXIS, inner="sgd", every=2)


def test_multisteps_is_refused_under_shard_map_in_favour_of_accumulate():
    """``optax.MultiSteps`` inside shard_map broadcasts its per-device
    accumulators, of leading axis 1, into the parameters' shapes (SGD returned
    parameters of shape (1, ...), AdamW failed in lax.cond): `init_sharded`
    and `state_specs` refuse it, naming `transforms.accumulate`, which sends
    nothing on the held micro-steps."""
    mesh = _mesh()
    x, y = _micro_batches()
    batch = (_put(mesh, x[0]), _put(mesh, y[0]))
    for opt in (optax.sgd(0.1), optax.adamw(optax.linear_schedule(1e-2, 1e-3, 4))):
        multi = optax.MultiSteps(optax.chain(_chain(qc.qsgd(bits=4)), opt), every_k_schedule=K)
        with pytest.raises(ValueError, match=r"optax.MultiSteps cannot run inside shard_map"
                                             r".*transforms.accumulate\(axis_name"):
            transforms.init_sharded(multi, _params(), mesh, AXIS)
        with pytest.raises(ValueError, match="optax.MultiSteps cannot run inside shard_map"):
            transforms.state_specs(jax.eval_shape(multi.init, _params()), AXIS)
    acc = transforms.accumulate(AXIS, inner=_chain(qc.qsgd(bits=4)), every=K)
    acc_state = transforms.init_sharded(acc, _params(), mesh, AXIS)
    assert qc.wire_bytes(_step(acc, acc_state, mesh), _params(), acc_state, *batch,
                         branches="min") == 0
