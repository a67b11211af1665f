"""`transforms.zero_one_adam`: Lu et al.'s Algorithm 1 on per-device replicas
of leaves of several shapes and scales over 4 devices, against a float64
oracle of the algorithm and against ``optax.adamw``."""

import dataclasses
import functools

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
SHAPES = {"w": (24, 20), "k": (3, 3, 2, 4), "b": (20,), "s": ()}
SCALES = {"w": 1.0, "k": 1e-3, "b": 1e2, "s": 1.0}
#: refreshes at 0 and 1, a compressed step at 2, then syncs at 3, 5, 9, 13
#: with local steps between (spacings 1, 2, 4, 4)
SCHEDULE = transforms.ZeroOneSchedule(freeze_after=3, refreshes=1, local_steps=4,
                                      syncs_per_spacing=1)
SETTINGS = dict(b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1, mask=transforms.matrices())


def _problem(seed=0, scales=SCALES):
    """Each device's least squares ``0.5 (a x - b)^2`` per value: ``(params, a, b)``."""
    rng = np.random.default_rng(seed)
    params = {k: (scales[k] * rng.standard_normal(s)).astype(np.float32)
              for k, s in SHAPES.items()}
    a = {k: (1 + 0.5 * rng.standard_normal((N, *s))).astype(np.float32)
         for k, s in SHAPES.items()}
    b = {k: (scales[k] * rng.standard_normal((N, *s))).astype(np.float32)
         for k, s in SHAPES.items()}
    return params, a, b


def _tx(**kwargs):
    settings = dict(learning_rate=1e-2, freeze_after=SCHEDULE, key=jax.random.key(1))
    return transforms.zero_one_adam("d", **(settings | kwargs))


def _stepper(tx, params):
    """``(replicas, state, step)``: ``step(replicas, state, a, b) -> (replicas,
    state)`` on 4 devices, the replicas stacked ``(N, ...)`` on ``P("d")``."""
    mesh = mesh_of(N)
    state = transforms.init_sharded(tx, params, mesh, "d")
    specs = transforms.state_specs(state, "d")

    def body(replicas, state, a, b):
        x = transforms.local_replica(replicas, "d")
        a, b = transforms.local_replica((a, b), "d")
        grads = jax.tree.map(lambda a, b, x: a * (a * x - b), a, b, x)
        updates, state = tx.update(grads, state, x)
        return jax.tree.map(lambda v: v[None], optax.apply_updates(x, updates)), state

    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), specs, P("d"), P("d")),
                                   out_specs=(P("d"), specs)))
    put = functools.partial(jax.device_put, device=NamedSharding(mesh, P("d")))

    def step(replicas, state, a, b):
        return jax.block_until_ready(mapped(put(replicas), state, put(a), put(b)))

    step.mapped, step.put = mapped, put
    replicas = {k: np.broadcast_to(v, (N, *v.shape)).copy() for k, v in params.items()}
    return replicas, state, step


def _oracle(params, a, b, steps, lr, schedule, b1, b2, eps, weight_decay, mask):
    """Algorithm 1 as the module's docstring states it, in float64 NumPy:
    each device's replica after each step."""
    decays = mask(params) if callable(mask) else {k: True for k in params}
    f64 = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = [dict(f64) for _ in range(N)]
    m = [{k: np.zeros_like(v) for k, v in f64.items()} for _ in range(N)]
    u = [{k: np.zeros_like(v) for k, v in f64.items()} for _ in range(N)]
    nu, anchor = {k: np.zeros_like(v) for k, v in f64.items()}, dict(f64)
    lr_sum, nu_count, out = 0.0, 0, []
    for c in range(steps):
        t, flags, rate = c + 1, schedule.at(c), lr(c)
        wd = {k: weight_decay * decays[k] for k in params}
        g = [{k: a[k][i] * (a[k][i] * x[i][k] - b[k][i]) for k in params} for i in range(N)]
        if bool(flags.refresh):
            nu_count += 1
            for k in params:
                mean = np.mean([g[i][k] for i in range(N)], axis=0)
                nu[k] = b2 * nu[k] + (1 - b2) * mean**2
                mk = b1 * m[0][k] + (1 - b1) * mean
                d = np.sqrt(nu[k] / (1 - b2**nu_count)) + eps
                anchor[k] = anchor[k] - rate * (mk / (1 - b1**t) / d + wd[k] * anchor[k])
                for i in range(N):
                    m[i][k], x[i][k] = mk, anchor[k]
        else:
            lr_sum += rate
            for k in params:
                d = np.sqrt(nu[k] / (1 - b2**nu_count)) + eps
                for i in range(N):
                    m[i][k] = b1 * m[i][k] + (1 - b1) * g[i][k]
                    u[i][k] = u[i][k] + rate * m[i][k] / (1 - b1**t)
                    x[i][k] = x[i][k] - rate * (m[i][k] / (1 - b1**t) / d + wd[k] * x[i][k])
                if bool(flags.sync):
                    w = np.mean([u[i][k] for i in range(N)], axis=0)
                    anchor[k] = anchor[k] - w / d - lr_sum * wd[k] * anchor[k]
                    for i in range(N):
                        m[i][k], u[i][k] = w / lr_sum * (1 - b1**t), np.zeros_like(w)
                        x[i][k] = anchor[k]
            lr_sum = 0.0 if bool(flags.sync) else lr_sum
        out.append([dict(xi) for xi in x])
    return out


def _close(got, expected, rtol=1e-4):
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(got[k]), np.stack([e[k] for e in expected]),
                                   rtol=rtol, atol=3e-5 * SCALES[k], err_msg=k)


def test_with_an_exact_compressor_it_is_the_algorithm_step_by_step():
    """The identity compressor on every phase (refreshes, compressed steps
    before the freeze, local steps and syncs after it), a learning-rate
    schedule and masked weight decay: each device's replica follows the
    float64 oracle of Algorithm 1, and after each sync all replicas agree."""
    lr = optax.linear_schedule(1e-2, 2e-3, 14)
    params, a, b = _problem()
    replicas, state, step = _stepper(_tx(learning_rate=lr, compressor=qc.identity(),
                                         **SETTINGS), params)
    expected = _oracle(params, a, b, 14, lr, SCHEDULE, **SETTINGS)
    assert [s.name for s in SCHEDULE.spans(14)] == [
        "exact", "compressed", "inner", "compressed", "inner", "compressed", "inner",
        "compressed"]
    moved = []
    for c in range(14):
        replicas, state = step(replicas, state, a, b)
        _close(replicas, expected[c])
        spread = max(float(np.ptp(np.asarray(v), axis=0).max()) for v in replicas.values())
        moved.append(spread)
        if bool(SCHEDULE.at(c).sync):
            assert spread <= 1e-6 * 100, (c, spread)
    assert max(moved) > 1e-3, "the local steps never let the replicas differ"
    assert int(state.count) == 14 and int(state.nu_count) == 2
    # the anchor and a replica reach the synced point by different float32
    # expressions: equal to a few units in the last place
    np.testing.assert_allclose(np.asarray(state.anchor["w"]), np.asarray(replicas["w"])[0],
                               rtol=1e-5)


def test_refreshing_every_step_is_adamw_on_the_mean_gradient():
    """Up to ``freeze_after``, with a refresh at each step: ``optax.adamw``
    (its bias corrections, masked decay, a schedule) on the exact mean."""
    lr = optax.linear_schedule(1e-2, 1e-3, 10)
    schedule = transforms.ZeroOneSchedule(freeze_after=5, refreshes=5)
    params, a, b = _problem(1)
    replicas, state, step = _stepper(_tx(learning_rate=lr, freeze_after=schedule, **SETTINGS),
                                     params)
    adamw = optax.adamw(lr, **SETTINGS)
    theirs, x = adamw.init(params), jax.tree.map(jnp.asarray, params)
    for _ in range(5):
        replicas, state = step(replicas, state, a, b)
        mean = jax.tree.map(lambda a, b, x: jnp.mean(a * (a * x - b), axis=0), a, b, x)
        updates, theirs = adamw.update(mean, theirs, x)
        x = optax.apply_updates(x, updates)
        _close(replicas, [x] * N, rtol=2e-5)
    assert int(state.nu_count) == 5
    # nothing went through the compressor yet
    assert all(float(jnp.abs(r).max()) == 0.0
               for r in jax.tree.leaves(state.sync.feedback.residual))


def test_one_bit_sends_a_sixteenth_and_the_local_steps_nothing():
    """The compiled step's bytes per phase: a refresh sends float32's exact
    all-reduce, a sync one-bit's pairwise all-reduce (about 16x less), a
    local step nothing; the spans say how many of each a run has."""
    params, a, b = _problem()
    replicas, state, step = _stepper(_tx(), params)
    phases = qc.wire_bytes_by_phase(step.mapped, step.put(replicas), state, step.put(a),
                                    step.put(b))
    values = sum(int(np.prod(s)) for s in SHAPES.values())
    assert phases["exact"] == 2 * (N - 1) / N * 4 * values
    assert phases["exact"] / 20 < phases["compressed"] < phases["exact"] / 8
    assert phases["inner"] == 0
    spans = transforms.steps_per_phase(transforms.ZeroOneSchedule(120).spans(600))
    # DeepSpeed's defaults: 49 refreshes before step 120, 79 syncs after it
    assert spans == {"exact": 49, "compressed": 71 + 79, "inner": 600 - 49 - 71 - 79}
    # bfloat16 refreshes: phase "lead-in", half of float32's bytes
    low = dataclasses.replace(SCHEDULE, refresh_compressor=qc.cast("bfloat16"))
    replicas, state, step = _stepper(_tx(freeze_after=low), params)
    low_phases = qc.wire_bytes_by_phase(step.mapped, step.put(replicas), state, step.put(a),
                                        step.put(b))
    assert low_phases["compressed"] == phases["compressed"] and low_phases["inner"] == 0
    # half of float32's, and its ring's padding to whole chunks (under 1%)
    assert phases["exact"] / 2 <= low_phases["lead-in"] < 1.01 * phases["exact"] / 2
    assert [s.name for s in low.spans(3)] == ["lead-in", "compressed"]
    replicas, state = step(replicas, state, a, b)
    assert int(state.nu_count) == 1 and float(np.abs(np.asarray(state.nu["w"])).max()) > 0


def test_one_bit_trains_and_the_errors_are_kept_per_device():
    """With the default one-bit compressor the loss falls through every
    phase, the replicas agree after each sync to rounding, and the worker
    and server errors (per device) are not zero. (Leaves of one scale:
    one learning rate cannot train 1e-3 and 1e2 alike in 40 steps.)"""
    params, a, b = _problem(2, dict.fromkeys(SHAPES, 1.0))
    schedule = transforms.ZeroOneSchedule(10, refreshes=4, local_steps=4, syncs_per_spacing=2)
    replicas, state, step = _stepper(_tx(learning_rate=5e-2, freeze_after=schedule), params)

    def loss(x):  # at the replicas' mean
        return sum(float(np.mean((a[k] * np.asarray(x[k]).mean(0) - b[k]) ** 2)) for k in SHAPES)

    # the devices disagree: the least loss is at sum(a b) / sum(a^2) over them
    best = loss({k: (a[k] * b[k]).sum(0, keepdims=True) / (a[k] ** 2).sum(0, keepdims=True)
                 for k in SHAPES})

    losses = [loss(replicas)]
    for c in range(80):
        replicas, state = step(replicas, state, a, b)
        losses.append(loss(replicas))
        if bool(schedule.at(c).sync):
            for k in SHAPES:
                np.testing.assert_allclose(np.asarray(replicas[k]), np.asarray(
                    replicas[k])[:1].repeat(N, 0), rtol=1e-5, atol=1e-6)
    # exact (qc.identity) ends at 0.006 of the first gap, one-bit at 0.2 here
    assert losses[-1] - best < 0.3 * (losses[0] - best) and losses[-1] < losses[20]
    errors = state.sync.feedback
    assert errors.residual["w"].shape == (N, *SHAPES["w"])
    assert float(np.abs(np.asarray(errors.residual["w"])).max()) > 0


def _bits(a):
    is_key = jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
    return np.asarray(jax.random.key_data(a) if is_key else a)


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(_bits(x), _bits(y))


def test_non_finite_gradients_skip_without_poisoning_the_state():
    """A NaN at a refresh skips the step on every device (the count too); at
    a local step only that device's replica stays; at a sync the others'
    values go through and every error stays finite."""
    params, a, b = _problem()
    replicas, state, step = _stepper(_tx(), params)
    bad = {k: v.copy() for k, v in a.items()}
    bad["w"][2, 0, 0] = np.nan
    after = step(replicas, state, bad, b)       # step 0: a refresh
    _same(after, (replicas, state))
    for _ in range(6):                           # to step 6, a local step
        replicas, state = step(replicas, state, a, b)
    assert not bool(SCHEDULE.at(6).sync)
    moved, later = step(replicas, state, bad, b)
    np.testing.assert_array_equal(np.asarray(moved["w"])[2], np.asarray(replicas["w"])[2])
    assert not np.array_equal(np.asarray(moved["w"])[0], np.asarray(replicas["w"])[0])
    assert int(later.count) == 7
    assert bool(SCHEDULE.at(9).sync)
    moved, later = step(*step(*step(moved, later, a, b), a, b), bad, b)  # step 9: a sync
    assert int(later.count) == 10
    assert all(np.isfinite(_bits(v)).all() for v in jax.tree.leaves((moved, later)))


def test_state_is_placed_and_settings_are_checked():
    params, _, _ = _problem()
    state = transforms.init_sharded(_tx(), params, mesh_of(N), "d")
    specs = transforms.state_specs(state, "d")
    assert specs.momentum["w"] == specs.accumulator["w"] == P("d")
    assert specs.sync.feedback.residual["w"] == specs.sync.feedback.owner_residual["w"] == P("d")
    assert specs.nu["w"] == specs.anchor["w"] == specs.lr_sum == P()
    for name, bad in (("freeze_after", 0), ("b1", 1.0), ("b2", -0.1), ("eps", -1.0),
                      ("weight_decay", -1e-4), ("algorithm", "tree")):
        with pytest.raises(ValueError, match=name):
            _tx(**{name: bad})
    for name in ("refreshes", "local_steps", "syncs_per_spacing"):
        with pytest.raises(ValueError, match=name):
            transforms.ZeroOneSchedule(10, **{name: 0})
    with pytest.raises(ValueError, match="refresh_compressor"):
        transforms.ZeroOneSchedule(10, refresh_compressor="bf16")
    tx = _tx()
    with pytest.raises(ValueError, match="needs params"):
        tx.update({"w": jnp.zeros(3)}, tx.init({"w": jnp.zeros(3)}))
    with pytest.raises(ValueError, match="steps"):
        tx.init({"w": jnp.zeros(3), "steps": jnp.zeros(3, jnp.int32)})


def _by_spacings(schedule, steps):
    """The schedule spacing by spacing: ``(refresh, sync)`` per step."""
    def marks(per, cap, last, length):
        out, spacing = [], 1
        while len(out) < length:
            for _ in range(per):
                out += [not last, *[False] * (spacing - 2), last][-spacing:] if spacing > 1 \
                    else [True]
            spacing = spacing * 2 if cap is None else min(spacing * 2, cap)
        return out[:length]

    first = schedule.freeze_after
    refresh = marks(schedule.refreshes, None, False, first)
    sync = marks(schedule.syncs_per_spacing, schedule.local_steps, True, steps)
    return [(c < first and refresh[c], c < first or sync[c - first]) for c in range(steps)]


@pytest.mark.parametrize("settings", [(3, 1, 4, 1), (120, 16, 16, 16), (7, 2, 5, 3),
                                      (1, 1, 1, 1), (50, 3, 6, 2)])
def test_the_schedule_is_its_counters_as_a_function_of_the_step(settings):
    """``at`` (one traced step, or every step at once) and ``spans`` agree
    with the schedule laid out spacing by spacing."""
    schedule = transforms.ZeroOneSchedule(*settings)
    steps = 700
    expected = _by_spacings(schedule, steps)
    flags = schedule.at(np.arange(steps))
    assert list(zip(np.asarray(flags.refresh).tolist(), np.asarray(flags.sync).tolist(),
                    strict=True)) == expected
    assert [bool(x) for x in jax.jit(schedule.at)(37)] == list(expected[37])
    names = [span.name for span in schedule.spans(steps)
             for _ in range(span.start, span.stop)]
    assert names == ["exact" if r else "compressed" if s else "inner" for r, s in expected]


def test_orbax_resume_inside_and_after_the_warm_up_is_bit_identical(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params, a, b = _problem()
    replicas, state, step = _stepper(_tx(weight_decay=0.1), params)
    for saved_at in (2, 7):
        x, s = replicas, state
        for _ in range(saved_at):
            x, s = step(x, s, a, b)
        x = step.put(x)
        ckpt = ocp.StandardCheckpointer()
        path = tmp_path / f"at{saved_at}"
        ckpt.save(path, {"replicas": x, "opt_state": s})
        ckpt.wait_until_finished()
        expected = (x, s)
        for _ in range(4):
            expected = step(*expected, a, b)
        fresh = {"replicas": step.put(replicas), "opt_state": state}
        restored = transforms.restore_sharded(ckpt, path, fresh, "d")
        got = (restored["replicas"], restored["opt_state"])
        for _ in range(4):
            got = step(*got, a, b)
        assert int(got[1].count) == saved_at + 4
        _same(expected, got)


def test_accumulate_runs_it_once_per_optimizer_step():
    """Under `transforms.accumulate` (2 micro-batches) it runs once per
    optimizer step: its count is half the micro-steps."""
    params, a, b = _problem()
    tx = transforms.accumulate("d", inner=_tx(), every=2)
    replicas, state, step = _stepper(tx, params)
    for _ in range(8):
        replicas, state = step(replicas, state, a, b)
    assert int(state.inner.count) == 4
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(replicas))
