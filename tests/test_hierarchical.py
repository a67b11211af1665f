"""Hierarchical compressed all-reduce over ("node", "local") meshes, and its
transforms: exactness, invariance, per-leaf groups, error feedback, bytes per axis."""

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

AXES = ("node", "local")
SPEC = P(AXES)


@functools.cache
def _mesh(nodes: int, local: int):
    devices = np.asarray(jax.devices()[:nodes * local]).reshape(nodes, local)
    return jax.sharding.Mesh(devices, AXES)


def _placed(mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, SPEC))


def _per_device(tree, n):
    """The ``(n, ...)`` leaves as float32 numpy: row ``d`` is device ``d``'s value."""
    assert all(a.shape[0] == n for a in jax.tree.leaves(tree))
    return jax.tree.map(lambda a: np.asarray(a, np.float32), tree)


def _reduce(mesh, compressor, algorithm="auto", mean=False, **kw):
    """``compressed_all_reduce`` over both axes; outputs with one row per device
    (value, contributed, owner_error) and the value as returned with ``P()``."""
    pairwise = algorithm == "pairwise" or (algorithm == "auto" and not compressor.linear)

    def body(tree, key):
        r = qc.compressed_all_reduce(tree, AXES, compressor, key, algorithm=algorithm,
                                     mean=mean, **kw)
        rows = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731
        owner = rows(r.owner_error) if pairwise else None
        return r.value, rows(r.value), rows(r.contributed), owner

    def run(tree):
        out_specs = (P(), SPEC, SPEC, SPEC if pairwise else None)
        fn = jax.jit(jax.shard_map(
            lambda t, k: body(jax.tree.map(lambda a: a[0], t), k), mesh=mesh,
            in_specs=(SPEC, P()), out_specs=out_specs))
        return fn(_placed(mesh, tree), jax.random.key(1))

    return run


def _tree(n, rng, dtype=jnp.float32, length=7):
    """Leaves of different shapes and scales, one row per device."""
    return {"big": jnp.asarray(rng.normal(size=(n, 16, 5)) * 1e3, dtype),
            "small": jnp.asarray(rng.normal(size=(n, length)) * 1e-3, dtype),
            "one": jnp.asarray(rng.normal(size=(n, 1)), dtype),
            "empty": jnp.zeros((n, 0), dtype)}


IDENTITY_CASES = (
    [(2, 4, jnp.float32, a) for a in qc.ALGORITHMS]
    + [(4, 2, jnp.float32, "pairwise"), (2, 3, jnp.float32, "ring"),
       (1, 4, jnp.float32, "pairwise"), (4, 1, jnp.float32, "ring_requantize"),
       (2, 3, jnp.bfloat16, "pairwise"), (2, 4, jnp.float16, "ring")])


@pytest.mark.parametrize("nodes, local, dtype, algorithm", IDENTITY_CASES,
                         ids=lambda v: getattr(v, "__name__", v))
def test_identity_equals_psum_over_both_axes(nodes, local, dtype, algorithm):
    n = nodes * local
    mesh = _mesh(nodes, local)
    tree = _tree(n, np.random.default_rng(n), dtype, length=2 * n + 3)
    tree["odd"] = jnp.asarray(np.random.default_rng(1).integers(-9, 9, (n, 1, 3)), dtype)
    value, rows, contributed, _ = _reduce(mesh, qc.identity(), algorithm)(tree)
    x = _per_device(tree, n)
    tol = 1e-6 if dtype == jnp.float32 else 2e-2   # of the sum of magnitudes
    for name in tree:
        assert value[name].dtype == dtype and value[name].shape == tree[name].shape[1:]
        np.testing.assert_allclose(np.asarray(value[name], np.float32), x[name].sum(0),
                                   rtol=0, atol=tol * np.abs(x[name]).sum(0).max(initial=0),
                                   err_msg=name)
        got = np.asarray(rows[name], np.float32)
        assert (got == got[:1]).all(), name   # the same on every device
        np.testing.assert_array_equal(np.asarray(contributed[name]), np.asarray(tree[name]))


@pytest.mark.parametrize("compressor, algorithm", [
    (qc.onebit(), "pairwise"), (qc.qsgd(bits=4), "pairwise"), (qc.qsgd(bits=8), "pairwise"),
    (qc.cast("bfloat16"), "ring"), (qc.onebit(grouping="column"), "pairwise"),
    (qc.threshold(1e-2), "pairwise"), (qc.adaptive(proportion=8), "pairwise"),
    (qc.qsgd(bits=4), "ring_requantize")], ids=lambda v: getattr(v, "name", v))
def test_every_compressor_agrees_on_every_device_and_telescopes(compressor, algorithm):
    """value the same everywhere; value + the devices' residuals + owner errors = the
    exact sum (error feedback loses nothing) whatever the compressor."""
    nodes, local = 2, 4
    n = nodes * local
    tree = _tree(n, np.random.default_rng(0))
    value, rows, contributed, owner = _reduce(_mesh(nodes, local), compressor, algorithm)(tree)
    x = _per_device(tree, n)
    for name in tree:
        got = np.asarray(rows[name])
        assert (got == got[:1]).all(), name
        np.testing.assert_array_equal(got[0], np.asarray(value[name]))
        if algorithm == "ring_requantize":
            continue   # later hops' re-encoding errors belong to no device
        kept = (x[name] - np.asarray(contributed[name])).sum(0)
        if owner is not None:
            kept += np.asarray(owner[name]).sum(0)
        scale = np.abs(x[name]).sum(0).max(initial=0) + 1e-30
        tol = 1e-2 if compressor.name.startswith("cast") else 2e-6  # ring sums round in bf16
        np.testing.assert_allclose((np.asarray(value[name]) + kept) / scale,
                                   x[name].sum(0) / scale, atol=tol, err_msg=name)


@pytest.mark.parametrize("compressor, algorithm", [
    (qc.qsgd(bits=4), "pairwise"), (qc.cast("bfloat16"), "ring")],
    ids=lambda v: getattr(v, "name", v))
def test_a_batch_of_equal_buckets_computes_what_the_unrolled_program_computes(compressor,
                                                                              algorithm):
    """Equal leaves reduced alone (64-byte buckets) form one batch across nodes:
    the same values, residuals and owner errors as traced bucket by bucket."""
    nodes, local = 2, 2
    n = nodes * local
    rng = np.random.default_rng(1)
    tree = {name: jnp.asarray(rng.normal(size=(n, 16, 5)) * scale, jnp.float32)
            for name, scale in (("a", 1e3), ("b", 1e-3), ("c", 1.0))}
    batch, unrolled = (_reduce(_mesh(nodes, local), compressor, algorithm, bucket_bytes=64,
                               batch_buckets=u)(tree) for u in ("always", "never"))
    for got, want in zip(jax.tree.leaves(batch), jax.tree.leaves(unrolled), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("compressor", [qc.onebit(), qc.qsgd(bits=4, stochastic=False),
                                        qc.onebit(grouping="column")], ids=lambda c: c.name)
def test_each_leaf_keeps_its_own_groups(compressor):
    """A 1e-3-scale leaf fused beside a 1e3-scale one decodes to what it decodes to
    reduced alone: no group spans two leaves or two devices' shares."""
    nodes, local = 2, 4
    n = nodes * local
    tree = _tree(n, np.random.default_rng(3), length=64 * n + 5)
    mesh = _mesh(nodes, local)
    together = _reduce(mesh, compressor)(tree)[0]
    for name in ("big", "small"):
        alone = _reduce(mesh, compressor)({name: tree[name]})[0][name]
        np.testing.assert_allclose(np.asarray(together[name]), np.asarray(alone), rtol=1e-5,
                                   atol=1e-6 * float(np.abs(np.asarray(alone)).max()),
                                   err_msg=name)
        exact = _per_device(tree, n)[name].sum(0)
        assert np.linalg.norm(np.asarray(together[name]) - exact) < np.linalg.norm(exact)


def test_mean_divides_by_every_device_and_errors_name_the_argument():
    nodes, local = 2, 2
    tree = {"w": jnp.ones((4, 6))}
    value = _reduce(_mesh(nodes, local), qc.identity(), mean=True)(tree)[0]
    np.testing.assert_allclose(np.asarray(value["w"]), np.ones(6))
    mesh = _mesh(nodes, local)
    for axes, match in [(("node", "local", "node"), "axis_name"),
                        (("node", "node"), "axis_name")]:
        fn = jax.shard_map(lambda v, a=axes: qc.compressed_all_reduce(
            v, a, qc.identity()).value, mesh=mesh, in_specs=SPEC, out_specs=SPEC)
        with pytest.raises(ValueError, match=match):
            jax.jit(fn)(_placed(mesh, jnp.ones((4, 3))))
    fn = jax.shard_map(lambda v: qc.compressed_all_reduce(
        v, AXES, qc.identity(), pipeline=2).value, mesh=mesh, in_specs=SPEC, out_specs=SPEC)
    with pytest.raises(ValueError, match="pipeline"):
        jax.jit(fn)(_placed(mesh, jnp.ones((4, 3))))


def test_one_tuple_is_the_single_axis():
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    x = jax.device_put(jnp.arange(12.0), NamedSharding(mesh, P("d")))
    f = lambda axes: jax.jit(jax.shard_map(  # noqa: E731
        lambda v: qc.compressed_all_reduce(v, axes, qc.onebit()).value,
        mesh=mesh, in_specs=P("d"), out_specs=P()))
    np.testing.assert_array_equal(np.asarray(f(("d",))(x)), np.asarray(f("d")(x)))


@pytest.mark.parametrize("compressor", [qc.onebit(), qc.qsgd(bits=4), qc.identity()],
                         ids=lambda c: c.name)
def test_bytes_by_axis_are_the_analytic_bytes(compressor):
    """Inside a node the buffer moves uncompressed (reduce-scatter and all-gather,
    2 (L - 1) / L of it); across nodes each device sends its 1/L share compressed,
    the bytes of a 1-D compressed all-reduce of K / L values over M devices."""
    nodes, local, length = 2, 4, 1 << 14
    mesh = _mesh(nodes, local)
    x = _placed(mesh, jnp.zeros((nodes * local, length)))
    fn = jax.jit(jax.shard_map(lambda v: qc.compressed_all_reduce(
        v[0], AXES, compressor, jax.random.key(0)).value, mesh=mesh, in_specs=SPEC,
        out_specs=P()))
    split = qc.wire_bytes_by_axis(fn, x)
    chunk = length // (nodes * local)
    payload = qc.payload_bytes(compressor.encode(jnp.zeros(chunk), jax.random.key(0)))
    assert split == {"local": 2 * (local - 1) * length // local * 4,
                     "node": 2 * (nodes - 1) * payload}
    psum = jax.jit(jax.shard_map(lambda v: lax.psum(v[0], AXES), mesh=mesh, in_specs=SPEC,
                                 out_specs=P()))
    flat = qc.wire_bytes_by_axis(psum, x)[AXES]
    assert flat == 2 * (nodes * local - 1) * length // (nodes * local) * 4
    ratio = 4 * chunk / payload
    assert split["node"] <= flat / (local * ratio)


def _train(axis_name, mesh, tx, params, grads_of_step, steps):
    state = transforms.init_sharded(tx, params, mesh, axis_name)
    specs = transforms.state_specs(state, axis_name)

    def body(params, state, g):
        u, state = tx.update(jax.tree.map(lambda a: a[0], g), state, params)
        return optax.apply_updates(params, u), state

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(axis_name)),
                                 out_specs=(P(), specs)))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    for t in range(steps):
        params, state = step(params, state, jax.device_put(
            grads_of_step(t), NamedSharding(mesh, P(axis_name))))
    return params, state


def test_transform_error_feedback_over_both_axes():
    """transforms.compressed_all_reduce over ("node", "local"): residuals P(both axes);
    with error feedback the parameters after T steps of plain SGD differ from the
    exact ones by the final residuals only (telescoping), far less than without."""
    nodes, local, steps = 2, 4, 6
    n = nodes * local
    mesh = _mesh(nodes, local)
    rng = np.random.default_rng(7)
    grads = [{"w": jnp.asarray(rng.normal(size=(n, 32, 8)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(n, 8)) * 1e-2, jnp.float32)}
             for _ in range(steps)]
    params = {"w": jnp.zeros((32, 8)), "b": jnp.zeros(8)}
    exact = jax.tree.map(lambda *g: -sum(np.asarray(a).mean(0) for a in g), *grads)

    def run(error_feedback):
        tx = optax.chain(transforms.compressed_all_reduce(
            AXES, compressor=qc.onebit(), key=jax.random.key(0), algorithm="pairwise",
            error_feedback=error_feedback), optax.sgd(1.0))
        return _train(AXES, mesh, tx, params, lambda t: grads[t], steps)

    got, state = run(transforms.residual_feedback())
    assert transforms.state_specs(state, AXES)[0].feedback.residual["w"] == SPEC
    feedback = state[0].feedback
    assert feedback.residual["w"].shape == (n, 32, 8)
    for name in params:
        left = (np.asarray(feedback.residual[name]).sum(0)
                + np.asarray(feedback.owner_residual[name]).sum(0)) / n
        np.testing.assert_allclose(np.asarray(got[name]) - left, exact[name], atol=1e-4)
    plain, _ = run(None)
    err = lambda p: np.linalg.norm(np.asarray(p["w"]) - exact["w"])  # noqa: E731
    assert err(got) < 0.5 * err(plain)


def test_ring_reduce_scatter_inside_nodes_gives_the_same_sums(monkeypatch):
    """Across processes on CPU the reduce-scatter inside a node is a ppermute ring;
    it sums exactly what psum_scatter does (here forced on one process)."""
    from qcollect import _backend

    n = 8
    tree = _tree(n, np.random.default_rng(11), length=29)
    tree["ints"] = jnp.asarray(np.random.default_rng(2).integers(-9, 9, (n, 37)), jnp.float32)
    want = _reduce(_mesh(2, 4), qc.identity())(tree)[0]
    monkeypatch.setattr(_backend, "ring_inside_nodes", lambda: True)
    got, rows, _, _ = _reduce(_mesh(2, 4), qc.identity())(tree)
    for name in tree:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]),
                                   rtol=1e-6, atol=1e-6 * float(np.abs(want[name]).max(initial=1)))
    np.testing.assert_array_equal(np.asarray(got["ints"]), _per_device(tree, n)["ints"].sum(0))


def test_pca_ring_across_nodes_is_exact_in_the_span():
    """GradiVeQ's linear compressor through the hierarchical ring: one payload per
    node is summed, so num_workers is the node count; gradients in mu / N +
    span(U) then sum exactly (eq. 4-5)."""
    nodes, local, k, d = 2, 4, 16, 3
    n = nodes * local
    rng = np.random.default_rng(5)
    basis = np.linalg.qr(rng.normal(size=(k, d)))[0].astype(np.float32)
    mean = rng.normal(size=k).astype(np.float32)
    slices = 5
    coeffs = rng.normal(size=(n, slices, d)).astype(np.float32)
    g = (mean / n + coeffs @ basis.T).reshape(n, slices * k)
    c = qc.pca(jnp.asarray(basis), jnp.asarray(mean), num_workers=nodes)
    value = _reduce(_mesh(nodes, local), c, "ring")({"g": jnp.asarray(g)})[0]["g"]
    np.testing.assert_allclose(np.asarray(value), g.sum(0), rtol=1e-4, atol=1e-4)
