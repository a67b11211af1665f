"""transforms.gradiveq: phase schedule, PCA fit, compressed ring, wire bytes, NaN policy."""

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
from tests.helpers import (
    count_primitives,
    mesh_of,
    placed,
    sharded_step,
    sharded_update,
    stacked,
)
from transforms._gradiveq_cycle import GradiVeQCycle
from transforms._gradiveq_sums import sum_on_pca_ring, sum_sampled

N = 8
K = 10


def _host(tree):
    """The state on the host (PRNG keys are left as they are); per-device leaves
    keep their leading device axis, the rest is replicated."""
    def one(a):
        return a if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else np.asarray(a)
    return jax.tree.map(one, tree)


def _init(tx, params):
    return transforms.init_sharded(tx, params, mesh_of(N), "d")


def _grads(seed):
    """NumPy's draws (a `jax.random` draw compiles a program per shape)."""
    rng = np.random.default_rng(seed)
    # w: 24 slices of K; v: 9 full slices and a 1-value tail; b: uncompressed.
    return {name: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
            for name, shape in (("w", (N, 24, K)), ("v", (N, 13, 7)), ("b", (N, K)))}


def _slices(x):
    flat = x.reshape(-1)
    full = flat.shape[0] // K
    return flat[:full * K].reshape(full, K), flat[full * K:]


def _pca_contribution(x, u, mu):
    """What one device's PCA payload decodes to: U U^T (g - mu/N) + mu/N per slice.

    The ring cuts the buffer into chunks of whole slices, zero-padded at the
    end, so a last partial slice is compressed with zeros after it.
    """
    flat = x.reshape(-1)
    padded = np.zeros(-(-flat.size // K) * K, np.float32)
    padded[:flat.size] = flat
    rec = (padded.reshape(-1, K) - mu / N) @ u @ u.T + mu / N
    return rec.reshape(-1)[:flat.size].reshape(x.shape)


def test_phases_updates_and_fit_match_reference():
    warmup, lt, lc, d = 2, 3, 3, 3
    tx = transforms.gradiveq("d", key=jax.random.key(0), slice_size=K, rank=d,
                             warmup_steps=warmup, sample_steps=lt, compressed_steps=lc,
                             sample_slices=2, sample_compressor=None)
    params = jax.tree.map(lambda a: a[0], _grads(0))
    st = _init(tx, params)
    step = sharded_update(tx, N, st)
    res = {k: np.zeros((N,) + params[k].shape, np.float32) for k in ("w", "v")}
    buf = {k: np.zeros((lt, 2 * K), np.float32) for k in ("w", "v")}
    basis = mean = None
    for t in range(12):  # second fit at step 10, step 11 uses it
        g = _grads(t + 1)
        u, st = step(g, st)
        u = jax.tree.map(np.asarray, u)
        since = t - warmup
        pos = since % (lt + lc) if since >= 0 else -1
        compressed = since >= 0 and pos >= lt
        s0 = _host(st)
        assert int(s0.count) == t + 1
        assert int(s0.cycle_start) == (warmup if t < 7 else 8)
        np.testing.assert_allclose(u["b"], np.mean(g["b"], 0), rtol=1e-5, atol=1e-6)
        for k in ("w", "v"):
            x = np.asarray(g[k]) + res[k]
            if compressed:
                contrib = np.stack([_pca_contribution(x[n], basis[k], mean[k]) for n in range(N)])
            else:
                contrib = x
            expected = contrib.mean(0)
            np.testing.assert_allclose(u[k], expected, rtol=1e-4, atol=1e-4)
            res[k] = x - contrib
            np.testing.assert_allclose(np.asarray(st.residual[k]), res[k], rtol=1e-4, atol=1e-4)
            if 0 <= pos < lt:  # sampled: slices 0 and num_slices // 2 of the sum
                rows, _ = _slices(x.sum(0))
                buf[k][pos] = np.concatenate([rows[0], rows[len(rows) // 2]])
            np.testing.assert_allclose(s0.samples[k], buf[k], rtol=1e-4, atol=1e-4)
        if pos == lt - 1:  # fitted at the end of the last sampling step
            assert bool(np.all(s0.valid))
            basis, mean = {}, {}
            for k in ("w", "v"):
                fit = qc.pca_fit(buf[k], slice_size=K, rank=d, slices="all")
                basis[k], mean[k] = np.asarray(s0.basis[k]), np.asarray(s0.mean[k])
                np.testing.assert_allclose(basis[k] @ basis[k].T,
                                           np.asarray(fit.basis @ fit.basis.T), atol=1e-4)
                np.testing.assert_allclose(mean[k], fit.mean, rtol=1e-5, atol=1e-5)
                assert int(s0.rank[k]) == d
        elif t < warmup + lt - 1:
            assert int(s0.rank["w"]) == 0 and not np.any(np.asarray(s0.basis["w"]))


@pytest.mark.parametrize("stop_loss", [None, 0.05])
def test_stop_early_on_local_compression_loss(stop_loss):
    # i.i.d. gradients: a rank-2 basis of 10-value slices loses most of them,
    # so every device votes to stop after one compressed step.
    tx = transforms.gradiveq("d", key=jax.random.key(0), slice_size=K, rank=2,
                             sample_steps=2, compressed_steps=5, sample_compressor=None,
                             stop_loss=stop_loss)
    st = _init(tx, jax.tree.map(lambda a: a[0], _grads(0)))
    step = sharded_update(tx, N, st)
    starts = []
    for t in range(8):
        _, st = step(_grads(t + 1), st)
        starts.append(int(_host(st).cycle_start))
    if stop_loss is None:
        assert starts == [0] * 6 + [7, 7]
    else:  # compressed at step 2, stop; sampling 3-4, compressed at 5, stop
        assert starts == [0, 0, 3, 3, 3, 6, 6, 6]


def test_compressed_branch_wire_bytes_match_rank():
    r, kk = 4, 64
    mesh = mesh_of(N)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (N, 256, kk)),
                       NamedSharding(mesh, P("d")))
    basis = jnp.eye(kk)[:, :r]
    spec = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("d"), out_specs=P("d"))

    @jax.jit
    @spec
    def compressed(x):
        sums, _, _ = sum_on_pca_ring([x[0]], [basis], [jnp.zeros(kk)], "d", jax.random.key(0))
        return sums[0][None]

    @jax.jit
    @spec
    def sampled(x):
        sums, _, _ = sum_sampled([x[0]], "d", qc.qsgd(bits=4), jax.random.key(0),
                                        "auto")
        return sums[0][None]

    @jax.jit
    @spec
    def exact(x):
        return lax.psum(x, "d")

    chunk_slices = 256 // N
    # ring: N - 1 reduce-scatter hops + N - 1 all-gather hops of one chunk payload
    # (r float32 coefficients per slice and the 4-byte weight).
    assert qc.wire_bytes(compressed, x) == 2 * (N - 1) * (4 * chunk_slices * r + 4)
    chunk = 256 * kk // N   # pairwise QSGD-4: N - 1 shifts + N - 1 all-gather hops
    assert qc.wire_bytes(sampled, x) == 2 * (N - 1) * (chunk // 2 + 4 * (chunk // 512))
    ratio = qc.wire_bytes(compressed, x) / qc.wire_bytes(exact, x)
    assert r / kk <= ratio < 1.01 * r / kk


def _class_and_alone(n, rows, kk, rank, count, scales):
    """``count`` leaves ``(rows, kk)`` (scaled apart) reduced by `sum_on_pca_ring`
    as one batched class (``batch="always"``) and each by its own PCA all-reduce
    (with their own bases, means and keys), on ``n`` devices: the two programs'
    (sums, contributions) and their ppermute counts."""
    mesh = mesh_of(n)
    xs = jax.random.normal(jax.random.key(2), (n, count, rows, kk))
    xs = jax.device_put(xs * jnp.asarray(scales)[:, None, None], NamedSharding(mesh, P("d")))
    bases = [jnp.linalg.qr(jax.random.normal(jax.random.key(10 + j), (kk, rank)))[0]
             for j in range(count)]
    means = [scales[j] * jax.random.normal(jax.random.key(20 + j), (kk,)) for j in range(count)]
    key = jax.random.key(3)
    spec = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("d"), out_specs=P("d"))

    @jax.jit
    @spec
    def together(x):
        sums, contributed, _ = sum_on_pca_ring(list(x[0]), bases, means, "d", key, batch="always")
        return jnp.stack(sums)[None], jnp.stack(contributed)[None]

    @jax.jit
    @spec
    def alone(x):
        results = [qc.compressed_all_reduce(x[0, j], "d", qc.pca(bases[j], means[j], num_workers=n),
                                            jax.random.fold_in(key, j), algorithm="ring")
                   for j in range(count)]
        return (jnp.stack([r.value for r in results])[None],
                jnp.stack([r.contributed for r in results])[None])

    shifts = [count_primitives(jax.make_jaxpr(f)(xs).jaxpr, "ppermute") for f in (together, alone)]
    return together(xs), alone(xs), shifts


def test_leaves_of_one_shape_run_as_one_ring():
    """Three (64, 64) leaves with their own bases, means and keys run as one
    batched ring (its shifts traced once, not three times), and each leaf's
    sum and contribution are bit for bit those of its own PCA all-reduce."""
    together, alone, shifts = _class_and_alone(N, 64, 64, 4, 3, [1.0, 1.0, 1.0])
    for got, want in zip(together, alone, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert 0 < 3 * shifts[0] == shifts[1], shifts


def test_a_batched_class_of_layer_sized_leaves_is_each_leaf_alone():
    """The MLP's two (2048, 2048) kernels at width 2048, scales 100x apart, with
    2048-value slices at rank 64 on 4 devices: the batched ring gives each
    leaf's own PCA all-reduce bit for bit."""
    together, alone, _ = _class_and_alone(4, 2048, 2048, 64, 2, [1e-2, 1e-4])
    for got, want in zip(together, alone, strict=True):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_classes_up_to_batch_buckets_run_leaf_by_leaf():
    """``batch_buckets``: a class of at most that many leaves is traced leaf
    by leaf (no stack of the leaves), a larger one as one batch."""
    mesh = mesh_of(N)
    xs = jax.device_put(jax.random.normal(jax.random.key(2), (N, 3, 64, 16)),
                        NamedSharding(mesh, P("d")))
    bases = [jnp.eye(16)[:, :4]] * 3
    means = [jnp.zeros(16)] * 3

    def shifts(batch):
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        def f(x):
            sums, _, _ = sum_on_pca_ring(list(x[0]), bases, means, "d", jax.random.key(0),
                                        batch=batch)
            return jnp.stack(sums)[None]
        return count_primitives(jax.make_jaxpr(f)(xs).jaxpr, "ppermute")

    assert shifts("never") == shifts(3) == 3 * shifts(2) == 3 * shifts("always") > 0


def _ls_problem():
    """Least squares whose gradients are rank-deficient: W* = A B with rank 3."""
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    dim, out, batch = 32, 16, 24
    w_true = jax.random.normal(k1, (dim, 3)) @ jax.random.normal(k2, (3, out)) / 2
    x = jax.random.normal(k3, (N, batch, dim))
    params = {"w": jnp.zeros((dim, out)), "b": jnp.zeros((out,))}
    return params, x, x @ w_true


def _ls_loss(p, x, y):
    return 0.5 * jnp.mean(jnp.sum((x @ p["w"] + p["b"] - y) ** 2, -1))


def _train(tx, steps, nan_at=()):
    """The shared data-parallel step; at the steps in ``nan_at`` device 3's targets
    are NaN, so all its gradients are."""
    params, x, y = _ls_problem()
    ps, st = placed(tx, params, N)
    step = sharded_step(tx, _ls_loss, N, st)
    x, y, y_nan = jax.device_put((x, y, y.at[3].set(jnp.nan)),
                                 NamedSharding(mesh_of(N), P("d")))
    losses, states = [], []
    for t in range(steps):  # block every step (XLA:CPU collectives)
        ps, st, loss, _ = jax.block_until_ready(step(ps, st, x, y_nan if t in nan_at else y))
        losses.append(float(loss))
        states.append(st)
    return losses, states


def _gq(**kw):
    settings = dict(key=jax.random.key(0), slice_size=16, loss_threshold=0.02, max_rank=6,
                    warmup_steps=3, sample_steps=8, compressed_steps=12)
    settings.update(kw)
    return transforms.gradiveq("d", **settings)


def test_least_squares_converges_close_to_uncompressed():
    steps = 60
    exact = optax.GradientTransformation(lambda p: optax.EmptyState(),
                                         lambda g, s, p=None: (lax.pmean(g, "d"), s))
    ref, _ = _train(optax.chain(exact, optax.sgd(0.2)), steps)
    # 8-bit sampling: with QSGD-4's one scale per 512-value bucket (the whole
    # 32x16 kernel here) the sampled sums are noisy enough that the fitted
    # rank (1 or 2) and the final loss depend on the draw.
    ours, states = _train(optax.chain(_gq(sample_compressor=qc.qsgd(bits=8)), optax.sgd(0.2)),
                          steps)
    gq = _host(states[-1][0])
    rank = int(gq.rank["w"])
    assert 1 <= rank <= 6
    assert ref[-1] < 1e-3 * ref[0]
    # 3 + 8 + 12 + 8 + 12 + 8 + 9: the run ends 9 steps into its third compressed phase.
    assert ours[-1] < 5 * ref[-1] + 1e-4 * ref[0], (ours[-1], ref[-1])
    # compressed steps keep descending, not just the sampled ones
    assert ours[33] < ours[23]


def test_nan_step_does_not_poison_state():
    # sampling step 5 (slot 2) and compressed step 13 get NaN on device 3
    _, poisoned = _train(optax.chain(_gq(), optax.sgd(0.2)), 15, nan_at=(5, 13))
    before, after = _host(poisoned[4][0]), _host(poisoned[5][0])
    assert not bool(after.valid[2]) and bool(after.valid[1])
    np.testing.assert_array_equal(after.samples["w"], before.samples["w"])
    np.testing.assert_array_equal(after.residual["w"], before.residual["w"])
    fitted = _host(poisoned[10][0])   # fit at step 10 skips the invalid slot
    for leaf in jax.tree.leaves((fitted.samples, fitted.basis, fitted.mean, fitted.residual)):
        assert np.all(np.isfinite(np.asarray(leaf)))
    assert 1 <= int(fitted.rank["w"]) <= 6
    b12, b13 = poisoned[12][0], poisoned[13][0]
    for a, b in zip(jax.tree.leaves(b12[:6]), jax.tree.leaves(b13[:6]), strict=True):  # not count
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(_host(b13).count) == 14


def test_chain_with_adam_keeps_state_types():
    tx = optax.chain(_gq(sample_steps=3, compressed_steps=3, warmup_steps=1), optax.adam(0.05))
    losses, states = _train(tx, 9)
    spec = lambda s: jax.tree.map(lambda a: (a.shape, a.dtype), s)  # noqa: E731
    first = states[0]
    for st in states[1:]:
        assert jax.tree.structure(st) == jax.tree.structure(first)
        assert spec(st) == spec(first)
    assert losses[-1] < losses[0]


def test_pmap_runs_the_same_schedule():
    tx = _gq(sample_steps=2, compressed_steps=2, warmup_steps=0, sample_compressor=None)
    g = _grads(0)
    params = jax.tree.map(lambda a: a[0], g)
    st = stacked(jax.jit(tx.init)(params), N)
    step = jax.pmap(tx.update, axis_name="d")
    for _ in range(3):
        u, st = jax.block_until_ready(step(g, st))
    assert int(st.count[0]) == 3 and int(st.rank["w"][0]) >= 1
    assert np.all(np.isfinite(np.asarray(u["w"])))


@pytest.mark.parametrize("kw, name", [
    (dict(rank=2, loss_threshold=0.1), "loss_threshold"),
    (dict(loss_threshold=0.1), "max_rank"),
    (dict(loss_threshold=1.0, max_rank=2), "loss_threshold"),
    (dict(rank=0), "rank"),
    (dict(rank=2, max_rank=3), "max_rank"),
    (dict(rank=2, sample_steps=0), "sample_steps"),
    (dict(rank=2, compressed_steps=0), "compressed_steps"),
    (dict(rank=2, warmup_steps=-1), "warmup_steps"),
    (dict(rank=2, slice_size=0), "slice_size"),
    (dict(rank=2, sample_compressor="qsgd"), "sample_compressor"),
    (dict(rank=2, stop_loss=0.0), "stop_loss"),
])
def test_invalid_settings_name_the_argument(kw, name):
    settings = dict(key=jax.random.key(0), slice_size=8)
    settings.update(kw)
    with pytest.raises(ValueError, match=name):
        transforms.gradiveq("d", **settings)


def test_numpy_integers_are_settings_like_ints():
    settings = dict(slice_size=8, rank=2, warmup_steps=1, sample_steps=3, compressed_steps=4,
                    sample_slices=2, min_size=16)
    params = {"w": jnp.zeros((16, 8)), "b": jnp.zeros(8)}
    python = transforms.gradiveq("d", key=jax.random.key(0), **settings).init(params)
    numpy = transforms.gradiveq("d", key=jax.random.key(0),
                                **{k: np.int64(v) for k, v in settings.items()}).init(params)
    assert jax.tree.map(jnp.shape, numpy) == jax.tree.map(jnp.shape, python)
    assert int(numpy.cycle_start) == 1


def test_schedule_phases():
    """Lead-in, then cycles of L_t sampling and L_c compressed steps: the fit
    after the last sampling step, the cycle's end at the last compressed one."""
    schedule = GradiVeQCycle(warmup_steps=2, sample_steps=2, compressed_steps=3)
    phases = [schedule.phase(jnp.int32(t), jnp.int32(2)) for t in range(10)]
    kinds = ["sample" if p.sampling else "compress" if p.compressing else "lead-in"
             for p in phases]
    assert kinds == ["lead-in"] * 2 + ["sample"] * 2 + ["compress"] * 3 + ["sample"] * 2 + [
        "compress"]
    assert [int(p.slot) for p in phases if p.sampling] == [0, 1, 0, 1]
    assert [t for t, p in enumerate(phases) if p.fits] == [3, 8]
    assert [t for t, p in enumerate(phases) if p.ends] == [6]
    # A cycle that starts early (stop-early vote at step 4) samples from step 5.
    assert [bool(schedule.phase(jnp.int32(t), jnp.int32(5)).sampling) for t in (4, 5, 6, 7)] == [
        False, True, True, False]


def test_phases_schedule_agrees_with_the_traced_schedule():
    """`transforms.gradiveq_phases` names each step as `GradiVeQCycle.phase`
    places it, and so does the cycle's own ``at`` and ``spans``."""
    for warmup, sample, compressed in ((2, 2, 3), (0, 1, 4), (5, 3, 1)):
        schedule = GradiVeQCycle(warmup, sample, compressed)
        traced = []
        for t in range(23):
            p = schedule.phase(jnp.int32(t), jnp.int32(warmup))
            traced.append("sampling" if p.sampling else "compressed" if p.compressing
                          else "lead-in")
            at = schedule.at(t)
            assert (bool(at.sampling), bool(at.compressing)) == (bool(p.sampling),
                                                                 bool(p.compressing))
        spans = transforms.gradiveq_phases(23, warmup_steps=warmup, sample_steps=sample,
                                           compressed_steps=compressed)
        assert [s.name for s in spans for _ in range(s.start, s.stop)] == traced
        assert spans == schedule.spans(23)
        assert spans[-1].stop == 23
    assert transforms.gradiveq_phases(0) == ()
    import inspect

    made, phases = (inspect.signature(f).parameters
                    for f in (transforms.gradiveq, transforms.gradiveq_phases))
    for name in ("warmup_steps", "sample_steps", "compressed_steps"):
        assert made[name].default == phases[name].default
    with pytest.raises(ValueError, match="sample_steps"):
        transforms.gradiveq_phases(10, sample_steps=0)


def test_each_phase_is_measured_by_name():
    """Leaves of several shapes and scales: lead-in and sampling steps send what
    the sample compressor's all-reduce of the compressed leaves and an exact
    one of the others send, the compressed steps the PCA rings (exactly:
    r coefficients per slice and a weight per chunk); without lead-in steps
    (``warmup_steps=0``) there is no lead-in phase."""
    rank = 2
    shapes = {"w": (24, K), "v": (13, 7), "b": (K,)}
    rng = np.random.default_rng(0)
    grads = jax.device_put({k: (10.0 ** (3 * i - 3) * rng.standard_normal((N,) + s))
                            .astype(np.float32) for i, (k, s) in enumerate(shapes.items())},
                           NamedSharding(mesh_of(N), P("d")))
    template = {k: jnp.zeros(s) for k, s in shapes.items()}

    def by_phase(**kwargs):
        tx = transforms.gradiveq("d", key=jax.random.key(0), slice_size=K, rank=rank,
                                 sample_steps=1, compressed_steps=2, **kwargs)
        state = _init(tx, template)
        return qc.wire_bytes_by_phase(sharded_update(tx, N, state).mapped, grads, state)

    def alone(fn):
        run = jax.jit(jax.shard_map(lambda g: fn(jax.tree.map(lambda a: a[0], g)),
                                    mesh=mesh_of(N), in_specs=P("d"), out_specs=P()))
        return qc.wire_bytes(run, grads)

    bias = alone(lambda g: lax.pmean(g["b"], "d"))
    sampled = alone(lambda g: qc.compressed_all_reduce(
        [g["w"], g["v"]], "d", qc.qsgd(bits=4), jax.random.key(0)).value) + bias
    exact = alone(lambda g: lax.pmean(g, "d"))
    # w: 24 slices, 3 per device's chunk; v: 91 values, 10 slices padded to 16, 2 per chunk.
    pca = 2 * (N - 1) * (4 * 3 * rank + 4) + 2 * (N - 1) * (4 * 2 * rank + 4)
    assert bias == 2 * (N - 1) / N * 4 * K
    assert exact == 2 * (N - 1) / N * 4 * (24 * K + 13 * 7 + K)
    assert by_phase(warmup_steps=2) == {"compressed": pca + bias, "sampling": sampled,
                                        "lead-in": sampled}
    assert by_phase() == {"compressed": pca + bias, "sampling": sampled}
    assert by_phase(warmup_steps=1, sample_compressor=None) == {
        "compressed": pca + bias, "sampling": exact, "lead-in": exact}


@pytest.mark.parametrize("kwargs, shapes, match", [
    ({}, {"w": (24, K), "v": (13, 7), "b": (K,), "z": (4,)}, r"not the one init saw.*\['z'\]"),
    ({}, {"w": (24, K), "b": (K,)}, r"not the one init saw.*\['v'\]"),       # missing leaf
    ({}, {"w": (24, 11), "v": (13, 7), "b": (K,)},
     r"residual of \['w'\] has shape \(1, 24, 10\), expected \(24, 11\)"),
    (dict(error_feedback=None), {"w": (1, K), "v": (13, 7), "b": (K,)},
     r"samples of \['w'\] has shape \(3, 20\), expected \(3, 10\)"),
    ({}, {"w": (24, K), "v": (13, 7), "b": (K, K)},
     r"leaf \['b'\] of shape \(10, 10\) is compressed, but init saw it uncompressed"),
])
def test_update_on_another_tree_names_the_leaf(kwargs, shapes, match):
    """An update on a tree other than init's raises at trace time, naming the leaf."""
    tx = transforms.gradiveq("d", key=jax.random.key(0), slice_size=K, rank=2, sample_steps=3,
                             compressed_steps=3, sample_slices=2, sample_compressor=None,
                             **kwargs)
    template = {"w": jnp.zeros((24, K)), "v": jnp.zeros((13, 7)), "b": jnp.zeros(K)}
    abstract = jax.eval_shape(tx.init, template)  # nothing compiles: all abstract
    mesh = mesh_of(2)
    state = jax.tree.map(lambda a, spec: jax.ShapeDtypeStruct(
        a.shape if spec == P() else (2,) + a.shape, a.dtype, sharding=NamedSharding(mesh, spec)),
        abstract, transforms.state_specs(abstract, "d"))
    grads = {k: jax.ShapeDtypeStruct((2,) + s, jnp.float32, sharding=NamedSharding(mesh, P("d")))
             for k, s in shapes.items()}
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(sharded_update(tx, 2, state).mapped, grads, state)
