"""transforms.diloco: inner steps per worker, compressed outer steps, fragments and delays."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms

N = 4
AXIS = "data"


def _mesh():
    return jax.make_mesh((N,), (AXIS,), axis_types=(AxisType.Auto,), devices=jax.devices()[:N])


def _params():
    k = jax.random.split(jax.random.key(3), 2)
    return {"w": 0.3 * jax.random.normal(k[0], (12, 32)), "b": jnp.zeros(32),
            "v": 0.3 * jax.random.normal(k[1], (32, 4))}


def _loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) @ p["v"] - y) ** 2)


@functools.cache
def _batches():
    """Twelve steps' batches, drawn once (a draw compiles for each shape)."""
    k = jax.random.split(jax.random.key(7), 2)
    return (jax.random.normal(k[0], (12, N * 4, 12)), jax.random.normal(k[1], (12, N * 4, 4)))


def _data(steps):
    x, y = _batches()
    return x[:steps], y[:steps]


def _replicas(tree, mesh):
    return jax.device_put(jax.tree.map(lambda a: jnp.stack([a] * N), tree),
                          NamedSharding(mesh, P(AXIS)))


def _trainer(tx, mesh, state):
    specs = transforms.state_specs(state, AXIS)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(AXIS), specs, P(AXIS), P(AXIS)),
                       out_specs=(P(AXIS), specs))
    def step(replicas, state, x, y):
        p = jax.tree.map(lambda a: a[0], replicas)  # this worker's replica
        g = jax.grad(_loss)(p, x, y)
        updates, state = tx.update(g, state, p)
        return jax.tree.map(lambda a: a[None], optax.apply_updates(p, updates)), state

    return step


def _train(tx, steps, x=None, y=None, first=0, start=None):
    mesh = _mesh()
    if start is None:
        start = (_replicas(_params(), mesh), transforms.init_sharded(tx, _params(), mesh, AXIS))
    replicas, state = start
    step = _trainer(tx, mesh, state)
    if x is None:
        x, y = _data(first + steps)
    for t in range(first, first + steps):
        batch = jax.device_put((x[t], y[t]), NamedSharding(mesh, P(AXIS)))
        replicas, state = jax.block_until_ready(step(replicas, state, *batch))
    return replicas, state, step


def test_one_inner_step_per_round_is_synchronous_sgd():
    """H = 1, inner SGD, exact (or identity-compressed) mean, outer SGD at
    learning rate 1 without momentum: synchronous data-parallel SGD."""
    x, y = _data(5)
    p = _params()
    for t in range(5):
        p = jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(_loss)(p, x[t], y[t]))
    identity = transforms.compressed_all_reduce(AXIS, compressor=qc.identity(),
                                                key=jax.random.key(0))
    for reduce in (None, identity):
        tx = transforms.diloco(AXIS, inner=optax.sgd(0.1), every=1, outer=optax.sgd(1.0),
                               reduce=reduce)
        replicas, _, _ = _train(tx, 5, x, y)
        for name in p:
            np.testing.assert_allclose(np.asarray(replicas[name]),
                                       np.broadcast_to(np.asarray(p[name]),
                                                       replicas[name].shape),
                                       rtol=1e-5, atol=1e-6)


def _reference(steps, every, fragments, delay, mix, x, y, inner_lr=0.05, outer_lr=0.7,
               sync_first=0):
    """NumPy-free reference of Streaming DiLoCo on one process: N replicas,
    inner SGD, exact mean, outer Nesterov SGD; fragments as `fragment_masks`;
    ``sync_first`` synchronous SGD steps (mean gradient) before the rounds."""
    params = _params()
    names = sorted(params)  # flatten order of a dict
    masks = transforms.fragment_masks(params, fragments)
    frag = {name: next(f for f in range(fragments) if masks[f][i])
            for i, name in enumerate(names)}
    reps = [dict(params) for _ in range(N)]
    anchor, pending = dict(params), dict(params)
    outer = optax.sgd(outer_lr, momentum=0.9, nesterov=True)
    outer_state = [outer.init({n: params[n] for n in names if frag[n] == f})
                   for f in range(fragments)]
    for t in range(steps):
        grads = [jax.grad(_loss)(reps[i], x[t][4 * i:4 * i + 4], y[t][4 * i:4 * i + 4])
                 for i in range(N)]
        if t < sync_first:
            grads = [{n: sum(g[n] for g in grads) / N for n in names}] * N
        for i in range(N):
            reps[i] = {n: reps[i][n] - inner_lr * grads[i][n] for n in names}
        if t + 1 == sync_first:
            anchor = {n: sum(r[n] for r in reps) / N for n in names}
        if t < sync_first:
            continue
        phase = (t + 1 - sync_first) % every
        for f in range(fragments):
            part = [n for n in names if frag[n] == f]
            if phase == ((f + 1) * every // fragments) % every:
                delta = {n: anchor[n] - sum(r[n] for r in reps) / N for n in part}
                steps_, outer_state[f] = outer.update(delta, outer_state[f], {
                    n: anchor[n] for n in part})
                new = {n: anchor[n] + steps_[n] for n in part}
                if delay:
                    pending.update(new)
                else:
                    anchor.update(new)
                    for r in reps:
                        r.update(new)
            lands = (phase == (((f + 1) * every // fragments) % every + delay) % every
                     and t + 1 - sync_first > delay)
            if delay and lands:
                for r in reps:
                    r.update({n: mix * r[n] + (1 - mix) * pending[n] for n in part})
                anchor.update({n: pending[n] for n in part})
    return reps


@pytest.mark.parametrize("fragments,delay,sync_first",
                         [(1, 0, 0), (2, 0, 0), (2, 1, 0), (1, 0, 3), (2, 1, 2)])
def test_streaming_rounds_follow_the_reference(fragments, delay, sync_first):
    """Plain, streaming, delayed and warm-started DiLoCo against a
    per-replica reference of the papers' algorithm (sync offsets, outer
    Nesterov steps, mixing, synchronous steps first)."""
    steps, every, mix = 9 + sync_first, 4, 0.5
    x, y = _data(steps)
    tx = transforms.diloco(AXIS, inner=optax.sgd(0.05), every=every, fragments=fragments,
                           delay=delay, mix=mix, sync_first=sync_first)
    replicas, state, _ = _train(tx, steps, x, y)
    reference = _reference(steps, every, fragments, delay, mix, x, y, sync_first=sync_first)
    for name in replicas:
        want = np.stack([np.asarray(r[name]) for r in reference])
        np.testing.assert_allclose(np.asarray(replicas[name]), want, rtol=2e-5, atol=2e-6)
    assert int(state.count) == steps


def _bytes_of_reduce(reduce, tree, mesh):
    """Bytes per device of ``reduce.update`` alone on ``tree``'s leaves."""
    state = transforms.init_sharded(reduce, tree, mesh, AXIS)
    specs = transforms.state_specs(state, AXIS)
    fn = jax.jit(jax.shard_map(
        lambda g, s: reduce.update(jax.lax.pcast(g, AXIS, to="varying"), s),
        mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs)))
    return qc.wire_bytes(fn, jax.device_put(tree, NamedSharding(mesh, P())), state)


def test_inner_steps_send_nothing_and_a_sync_sends_one_fragment():
    """Only synchronising steps communicate; with fragments the costliest
    step is the largest fragment's exchange, and the fragments together
    send what one whole-model sync sends."""
    x, y = _data(1)
    mesh = _mesh()
    batch = jax.device_put((x[0], y[0]), NamedSharding(mesh, P(AXIS)))
    four_bits = transforms.compressed_all_reduce(  # small buckets: bytes follow sizes
        AXIS, compressor=qc.qsgd(bits=4, bucket_size=16), key=jax.random.key(0))
    params = _params()
    peaks = {}
    for fragments in (1, 3):
        tx = transforms.diloco(AXIS, inner=optax.adam(1e-2), every=6, reduce=four_bits,
                               fragments=fragments)
        replicas, state = _replicas(params, mesh), transforms.init_sharded(
            tx, params, mesh, AXIS)
        step = _trainer(tx, mesh, state)
        assert qc.wire_bytes(step, replicas, state, *batch, branches="min") == 0
        peaks[fragments] = qc.wire_bytes(step, replicas, state, *batch, branches="max")
    masks = transforms.fragment_masks(params, 3)
    assert [sum(m) for m in masks] == [1, 1, 1]  # b, v, w: one leaf each
    leaves, treedef = jax.tree.flatten(params)
    each = [_bytes_of_reduce(four_bits, treedef.unflatten(
        [leaf if keep else None for leaf, keep in zip(leaves, m, strict=True)]), mesh)
        for m in masks]
    assert peaks[3] == max(each) < peaks[1]
    assert peaks[1] == _bytes_of_reduce(four_bits, params, mesh)


def _expected_schedule(t, every, fragments, delay, sync_first):
    """Step ``t`` of the papers' schedule, spelled out: (synchronous,
    begins_rounds, syncing fragment, landing fragment), -1 for none."""
    syncs = lands = -1
    done = t + 1 - sync_first  # inner steps of the rounds after step t
    for f in range(fragments):
        offset = (f + 1) * every // fragments  # fragment f syncs at this inner step of a round
        if done > 0 and done % every == offset % every:
            syncs = f
        if delay and done > delay and (done - delay) % every == offset % every:
            lands = f
    return t < sync_first, sync_first > 0 and t == sync_first - 1, syncs, lands


@pytest.mark.parametrize("every,fragments,delay,sync_first",
                         [(1, 1, 0, 0), (4, 1, 0, 0), (4, 2, 0, 0), (4, 2, 1, 0), (6, 3, 1, 2),
                          (5, 2, 1, 3), (7, 7, 0, 1)])
def test_schedule_is_a_function_of_the_step_count(every, fragments, delay, sync_first):
    """`diloco_schedule` against the schedule spelled out step by step, on
    Python ints and on a traced count alike."""
    settings = {"every": every, "fragments": fragments, "delay": delay,
                "sync_first": sync_first}
    traced = jax.jit(lambda t: transforms.diloco_schedule(t, **settings))
    for t in range(sync_first + 3 * every + 1):
        want = _expected_schedule(t, every, fragments, delay, sync_first)
        for step in (transforms.diloco_schedule(t, **settings),
                     traced(jnp.asarray(t, jnp.int32))):
            got = (bool(step.synchronous), bool(step.begins_rounds), int(step.syncs),
                   int(step.lands))
            assert got == want, (t, got, want)


def test_schedule_rounds_sync_every_fragment_once():
    """Each round of H steps syncs every fragment exactly once, the last
    fragment on the round's last step; with a delay each lands once."""
    every, fragments, delay, sync_first = 6, 3, 1, 2
    steps = [transforms.diloco_schedule(t, every=every, fragments=fragments, delay=delay,
                                        sync_first=sync_first) for t in range(2 + 4 * every)]
    assert [bool(s.synchronous) for s in steps[:3]] == [True, True, False]
    assert [t for t, s in enumerate(steps) if bool(s.begins_rounds)] == [sync_first - 1]
    for start in range(sync_first, sync_first + 4 * every, every):
        round_ = steps[start:start + every]
        assert sorted(int(s.syncs) for s in round_ if int(s.syncs) >= 0) == [0, 1, 2]
        assert int(round_[-1].syncs) == fragments - 1
    assert sorted(int(s.lands) for s in steps[sync_first + every:sync_first + 2 * every]
                  if int(s.lands) >= 0) == [0, 1, 2]
    for kwargs, match in (({"every": 0}, "every"), ({"every": 2, "fragments": 3}, "fragments"),
                          ({"every": 4, "fragments": 2, "delay": 2}, "delay"),
                          ({"every": 4, "sync_first": -1}, "sync_first")):
        with pytest.raises(ValueError, match=match):
            transforms.diloco_schedule(0, **kwargs)


def test_default_fragments_are_balanced_runs():
    sizes = {"a": 40, "b": 10, "c": 10, "d": 10, "e": 10, "f": 40}
    tree = {k: jnp.zeros(v) for k, v in sizes.items()}
    masks = transforms.fragment_masks(tree, 3)
    runs = [[k for k, keep in zip(sorted(sizes), m, strict=True) if keep] for m in masks]
    assert runs == [["a"], ["b", "c", "d", "e"], ["f"]]
    assert [sum(m) for m in transforms.fragment_masks(tree, 6)] == [1] * 6
    with pytest.raises(ValueError, match="fragments"):
        transforms.fragment_masks(tree, 7)


def test_non_finite_inner_gradients_on_one_worker_skip_its_step():
    x, y = _data(4)
    x = x.at[1, 0].set(jnp.inf)  # worker 0's batch at step 1
    four_bits = transforms.compressed_all_reduce(AXIS, compressor=qc.qsgd(bits=4),
                                                 key=jax.random.key(0))
    tx = transforms.diloco(AXIS, inner=optax.adam(1e-2), every=4, reduce=four_bits)
    replicas, state, _ = _train(tx, 4, x, y)
    for name, leaf in replicas.items():
        leaf = np.asarray(leaf)
        assert np.isfinite(leaf).all(), name
        # synced: the replicas agree up to the rounding of params + (global - params)
        np.testing.assert_allclose(leaf, np.broadcast_to(leaf[0], leaf.shape), rtol=1e-6,
                                   atol=1e-7)
    assert all(np.isfinite(np.asarray(r)).all() for r in jax.tree.leaves(state.reduce)
               if jnp.issubdtype(r.dtype, jnp.floating))
    # The bad worker's Adam took 3 steps, the others 4.
    counts = np.asarray(state.inner[0].count)
    assert counts.tolist() == [3, 4, 4, 4]


def test_orbax_resume_is_bit_identical(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    four_bits = transforms.compressed_all_reduce(AXIS, compressor=qc.qsgd(bits=4),
                                                 key=jax.random.key(0))
    tx = transforms.diloco(AXIS, inner=optax.adamw(1e-2), every=3, reduce=four_bits,
                           fragments=3, delay=0)
    x, y = _data(7)
    replicas, state, _ = _train(tx, 4, x, y)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", {"replicas": replicas, "state": state})
    ckpt.wait_until_finished()
    expected, expected_state, _ = _train(tx, 3, x, y, first=4, start=(replicas, state))
    mesh = _mesh()
    target = {"replicas": _replicas(_params(), mesh),
              "state": transforms.init_sharded(tx, _params(), mesh, AXIS)}
    restored = transforms.restore_sharded(ckpt, tmp_path / "ckpt", target, AXIS)
    got, got_state, _ = _train(tx, 3, x, y, first=4,
                               start=(restored["replicas"], restored["state"]))
    for a, b in zip(jax.tree.leaves((expected, expected_state)),
                    jax.tree.leaves((got, got_state)), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_state_specs_say_what_is_per_device():
    tx = transforms.diloco(AXIS, inner=optax.adam(1e-2), every=4, reduce=(
        transforms.compressed_all_reduce(AXIS, compressor=qc.onebit(), key=jax.random.key(0))))
    specs = transforms.state_specs(jax.eval_shape(tx.init, _params()), AXIS)
    assert all(s == P(AXIS) for s in jax.tree.leaves(specs.inner))
    assert all(s == P() for s in jax.tree.leaves((specs.anchor, specs.outer, specs.count)))
    assert specs.reduce[0].feedback.residual["w"] == P(AXIS) and specs.reduce[0].key == P()


def test_bad_settings_name_themselves():
    sgd = optax.sgd(0.1)
    for kwargs, match in (({"every": 0}, "every"), ({"every": 4, "fragments": 5}, "fragments"),
                          ({"every": 4, "fragments": 2, "delay": 2}, "delay"),
                          ({"every": 4, "mix": 1.5}, "mix"),
                          ({"every": 4, "sync_first": -1}, "sync_first"),
                          ({"every": 4, "outer": "sgd"}, "outer")):
        with pytest.raises(ValueError, match=match):
            transforms.diloco(AXIS, inner=sgd, **kwargs)
    with pytest.raises(ValueError, match="fragment_of"):
        transforms.fragment_masks(_params(), 2, lambda path, leaf: 2)
    with pytest.raises(ValueError, match="params"):
        transforms.diloco(AXIS, inner=sgd, every=2).update(_params(), None)


def test_sparse_outer_gradients_with_error_feedback_train():
    """SparseLoCo's recipe: the top values of each column (`qc.adaptive`)
    with error feedback in place of outer momentum (plain outer SGD): the
    loss falls, fewer bytes than 4-bit QSGD, and the residuals hold what
    the sparse payloads left out."""
    x, y = _data(12)
    sparse = transforms.compressed_all_reduce(AXIS, compressor=qc.adaptive(8),
                                              key=jax.random.key(0))
    tx = transforms.diloco(AXIS, inner=optax.adam(1e-2), every=4, reduce=sparse,
                           outer=optax.sgd(1.0))
    replicas, state, step = _train(tx, 12, x, y)
    before = float(np.mean([_loss(_params(), x[t], y[t]) for t in range(12)]))
    after = float(np.mean([_loss(jax.tree.map(lambda a: a[0], replicas), x[t], y[t])
                           for t in range(12)]))
    assert after < 0.9 * before
    assert np.abs(np.asarray(state.reduce[0].feedback.residual["w"])).max() > 0
    mesh = _mesh()
    batch = jax.device_put((x[0], y[0]), NamedSharding(mesh, P(AXIS)))
    four_bits = transforms.compressed_all_reduce(AXIS, compressor=qc.qsgd(bits=4),
                                                 key=jax.random.key(0))
    assert (qc.wire_bytes(step, replicas, state, *batch)
            < _bytes_of_reduce(four_bits, _params(), mesh))
