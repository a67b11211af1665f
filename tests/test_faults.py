"""Bad and extreme input: every compressor keeps finite input finite over the whole
float32 range (and non-finite input non-finite), alone and through the collective."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcollect as qc
from tests.helpers import mesh_of, per_device, sharded_update

F32_MAX = float(np.finfo(np.float32).max)


def _orthonormal(rows, cols, seed):
    a = np.random.default_rng(seed).standard_normal((rows, cols))
    return np.linalg.qr(a)[0].astype(np.float32)


# PCA slices of K = 24: the 4096 test values are 170 slices and a 16-value tail.
BASIS = _orthonormal(24, 4, 0)
MEAN = np.random.default_rng(1).standard_normal(24).astype(np.float32)
# PowerSGD factors of the (64, 64) test matrix, rank 4.
Q, P = _orthonormal(64, 4, 2), _orthonormal(64, 4, 3)


def _compressors():
    return {
        "identity": qc.identity(), "bf16": qc.cast("bfloat16"), "f16": qc.cast("float16"),
        "onebit": qc.onebit(), "onebit-column": qc.onebit(grouping="column"),
        "onebit-sampled": qc.onebit(sample=16), "qsgd-4": qc.qsgd(bits=4),
        "qsgd-8-l2": qc.qsgd(bits=8, norm="l2"), "threshold": qc.threshold(1e30),
        "golomb": qc.threshold(1e30, coding="golomb_rice"),
        "adaptive": qc.adaptive(proportion=8), "adaptive-sampled": qc.adaptive(proportion=8,
                                                                             sample=64),
        "entropy": qc.entropy(),
        "pca": qc.pca(BASIS, MEAN, num_workers=2), "pca-no-mean": qc.pca(BASIS, num_workers=1),
        "powersgd": qc.powersgd(Q), "powersgd-left": qc.powersgd(P, side="left"),
    }


def _inputs():
    rng = np.random.default_rng(0)
    sign = rng.choice([-1.0, 1.0], 4096)
    return {
        "near the maximum": sign * rng.uniform(0.5, 1.0, 4096) * F32_MAX,
        "exactly the maximum": sign * F32_MAX,
        "1e37": rng.normal(size=4096) * 1e37,
        "mixed 1e-30 / 1e30": rng.choice([1e-30, 1e30], 4096) * rng.normal(size=4096),
    }


@functools.cache
def _jitted_round_trip(c):
    return jax.jit(lambda v, key: c.decode(c.encode(v, key)))


def _round_trip(c, x):
    key = jax.random.key(1)
    if isinstance(c, qc.EntropyCompressor):
        c = c.with_plan(c.plan(x, key))
    return _jitted_round_trip(c)(x, key)


COMPRESSORS = _compressors()


@pytest.mark.parametrize("name", list(COMPRESSORS))
@pytest.mark.parametrize("case", list(_inputs()))
def test_finite_input_decodes_finite_over_the_float32_range(name, case):
    c = COMPRESSORS[name]
    x = jnp.asarray(_inputs()[case], jnp.float32).reshape(64, 64)
    out = np.asarray(_round_trip(c, x))
    assert np.isfinite(out).all(), f"{name} on {case}: {np.sum(~np.isfinite(out))} non-finite"
    if name in ("identity", "bf16"):
        np.testing.assert_allclose(out, np.asarray(x), rtol=1e-2)


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_non_finite_input_stays_non_finite(name):
    c = COMPRESSORS[name]
    x = np.asarray(_inputs()["1e37"], np.float32).reshape(64, 64)
    for bad in (np.nan, np.inf):
        y = x.copy()
        y[5, 7] = bad
        if isinstance(c, qc.EntropyCompressor):  # plan on finite values, encode the bad
            c = c.with_plan(c.plan(jnp.asarray(x), jax.random.key(1)))
        out = np.asarray(_jitted_round_trip(c)(jnp.asarray(y), jax.random.key(1)))
        assert not np.isfinite(out).all(), f"{name} made {bad} finite"


@jax.jit
def _powersgd_steps(m):
    """Two PowerSGD steps on one worker: P = M Q, orthogonalize, Q = M^T P, M^ = P Q^T,
    the second warm-started from the first's Q (which has the scale of M)."""
    q, outs = jnp.asarray(Q[:, :2]), []
    for _ in range(2):
        p = qc.orthogonalize(qc.powersgd_p(m, q))
        q = qc.powersgd_q(m, p)
        outs.append((p, q, qc.powersgd_reconstruct(p, q)))
    return outs


@pytest.mark.parametrize("case", list(_inputs()))
def test_powersgd_steps_stay_finite_and_scale_free(case):
    """Products of values near 2**100 overflow; the power-of-two rescaling keeps every
    factor finite and P orthonormal, and where no true entry passes the float32
    maximum the result is that of the input scaled down by 2**-100, scaled back."""
    x = np.asarray(_inputs()[case], np.float32).reshape(64, 64)
    steps = _powersgd_steps(jnp.asarray(x))
    for p, q, m_hat in steps:
        for a in (p, q, m_hat):
            assert np.isfinite(np.asarray(a)).all(), case
        np.testing.assert_allclose(np.asarray(p).T @ np.asarray(p), np.eye(2), atol=1e-4)
    if case not in ("near the maximum", "exactly the maximum"):
        # Not the warm-started step: there M Q has the scale of M**2 and saturates at
        # the float32 maximum (P keeps a direction, not the one of the small input).
        got = np.asarray(steps[0][2], np.float64)
        want = np.asarray(_powersgd_steps(jnp.asarray(x * np.float32(2.0 ** -100)))[0][2],
                          np.float64) * 2.0 ** 100
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


def test_orthogonalize_of_huge_columns_is_orthonormal():
    """Squares of 1e30 overflow: the columns used to come out as zeros."""
    a = np.random.default_rng(4).standard_normal((32, 3)).astype(np.float32)
    for scale in (1e30, 1e38):
        p = np.asarray(qc.orthogonalize(jnp.asarray(a * np.float32(scale))))
        np.testing.assert_allclose(p.T @ p, np.eye(3), atol=1e-5)
        np.testing.assert_allclose(p, np.asarray(qc.orthogonalize(jnp.asarray(a))), atol=1e-5)


@pytest.mark.parametrize("case", ["1e37", "mixed 1e-30 / 1e30"])
def test_full_rank_pca_round_trip_of_huge_values_is_close(case):
    """A full-rank basis decodes huge values to themselves: the rescaling is exact."""
    x = jnp.asarray(_inputs()[case], jnp.float32)
    c = qc.pca(_orthonormal(24, 24, 5), MEAN * np.float32(1e30), num_workers=3)
    out = np.asarray(_jitted_round_trip(c)(x, jax.random.key(0)), np.float64)
    x = np.asarray(x, np.float64)
    np.testing.assert_allclose(out, x, atol=1e-5 * np.abs(x).max())


@pytest.mark.parametrize("case", list(_inputs()))
def test_pca_fit_of_extreme_samples_is_finite(case):
    """The covariance of samples near the float32 maximum overflowed (NaN basis)."""
    samples = jnp.asarray(_inputs()[case], jnp.float32).reshape(16, 256)
    fit = qc.pca_fit(samples, slice_size=16, rank=4, slices="all")
    basis, mean = np.asarray(fit.basis, np.float64), np.asarray(fit.mean, np.float64)
    assert np.isfinite(np.asarray(fit.energy)).all() and np.isfinite(mean).all()
    np.testing.assert_allclose(basis.T @ basis, np.eye(4), atol=1e-5)
    rows = np.asarray(samples, np.float64).reshape(-1, 16)
    np.testing.assert_allclose(mean, rows.mean(0), atol=1e-6 * np.abs(rows).max())
    capped = qc.pca_fit(samples, slice_size=16, loss_threshold=0.1, max_rank=4, slices="all")
    assert np.isfinite(np.asarray(capped.basis)).all() and 1 <= int(capped.rank) <= 16


def test_float16_cast_saturates_instead_of_overflowing():
    c = qc.cast("float16")
    out = np.asarray(c.decode(c.encode(jnp.array([1e30, -1e30, 3.0, np.inf, np.nan]))))
    assert out[0] == 65504.0 and out[1] == -65504.0 and out[2] == 3.0
    assert out[3] == np.inf and np.isnan(out[4])


@pytest.mark.parametrize("compressor", [qc.onebit(), qc.qsgd(bits=4), qc.cast("bfloat16"),
                                        qc.adaptive(proportion=8)], ids=lambda c: c.name)
def test_compressed_all_reduce_of_huge_finite_leaves_is_finite(compressor):
    """Leaves near F32_MAX / n beside 1e-30-scale ones: the sum is finite and so is
    every device's result and contribution."""
    n = 4
    rng = np.random.default_rng(3)
    tree = {"huge": jnp.asarray(rng.choice([-1, 1], (n, 512)) * (F32_MAX / n) * 0.9,
                                jnp.float32),
            "tiny": jnp.asarray(rng.normal(size=(n, 8, 16)) * 1e-30, jnp.float32)}
    run = per_device(lambda t, k: tuple(qc.compressed_all_reduce(t, "d", compressor, k)[:2]),
                     n)
    value, contributed = run(tree, jnp.stack([jax.random.key(0)] * n))
    for leaf in jax.tree.leaves((value, contributed)):
        assert np.isfinite(np.asarray(leaf, np.float32)).all()
    exact = np.asarray(tree["tiny"], np.float64).sum(0)   # squares of 1e-30 underflow float32
    got = np.asarray(value["tiny"], np.float64)[0]
    assert np.linalg.norm(got - exact) < np.linalg.norm(exact)


@pytest.mark.parametrize("algorithm", ["ring", "pairwise"])
def test_pca_all_reduce_of_huge_finite_leaves_is_finite(algorithm):
    """PCA through the collective (encodes run under vmap inside shard_map): a leaf
    whose projections sum to near the float32 maximum, beside a 1e-30-scale one,
    stays finite, and the tiny leaf's projection survives. (A projection can be
    sqrt(K) times a slice's largest entry: the huge leaf is scaled so that the
    exact coefficients and their sum are representable, as a psum's must be.)"""
    n, k = 4, BASIS.shape[0]
    rng = np.random.default_rng(4)
    huge = F32_MAX / (n * np.sqrt(k)) * 0.9
    tree = {"huge": jnp.asarray(rng.choice([-1, 1], (n, k * 32)) * huge, jnp.float32),
            "tiny": jnp.asarray(rng.normal(size=(n, 24, 8)) * 1e-30, jnp.float32)}
    c = qc.pca(BASIS, num_workers=n)
    run = per_device(lambda t, k: qc.compressed_all_reduce(t, "d", c, k,
                                                           algorithm=algorithm).value, n)
    value = run(tree, jnp.stack([jax.random.key(0)] * n))
    for leaf in jax.tree.leaves(value):
        assert np.isfinite(np.asarray(leaf)).all()
    assert np.abs(np.asarray(value["tiny"])).max() > 0


def test_powersgd_transform_of_huge_finite_gradients_is_finite():
    """transforms.powersgd on huge gradients: products of values near 2**64 overflowed
    (a warm-start Q has the gradients' scale, so M Q squares it) and turned every
    later step into NaN, and squares near 2**64 in Gram-Schmidt zeroed P (a zero
    update). Every update, error and Q memory stays finite, the update is a real
    approximation, and error feedback keeps its books: update + mean error = mean of
    M_i = g_i + e_i. (The scales keep the exact factors representable: P = M Q can
    be sqrt(m) times M's entries.)"""
    import transforms

    n = 2
    tx = transforms.powersgd("d", rank=2, key=jax.random.key(0), compress_after=0)
    template = {"w": jnp.zeros((16, 8)), "v": jnp.zeros((8,))}
    state = transforms.init_sharded(tx, template, mesh_of(n), "d")
    run = sharded_update(tx, n, state)
    rng = np.random.default_rng(5)
    for scale in (1e20, 1e36, 1e30, 1e-30):
        grads = {"w": jnp.asarray(rng.choice([-1, 1], (n, 16, 8)) * scale, jnp.float32),
                 "v": jnp.asarray(rng.uniform(-1, 1, (n, 8)) * scale, jnp.float32)}
        m = np.asarray(grads["w"], np.float64) + np.asarray(state.residuals["w"], np.float64)
        updates, state = run(grads, state)
        for leaf in jax.tree.leaves((updates, state)):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                assert np.isfinite(np.asarray(leaf)).all(), scale
        update = np.asarray(updates["w"], np.float64)
        booked = update + np.asarray(state.residuals["w"], np.float64).mean(0)
        np.testing.assert_allclose(booked, m.mean(0), atol=1e-5 * np.abs(m).max())
        assert np.linalg.norm(update) > 0.1 * np.linalg.norm(m.mean(0)), scale


def test_update_on_another_tree_names_the_first_difference():
    """tx.update on a tree other than the one tx.init saw: a ValueError naming the
    first leaf path where they part, or the leaf whose shape changed."""
    import transforms

    tx = transforms.compressed_all_reduce("d", compressor=qc.onebit(), key=jax.random.key(0))
    state = tx.init({"a": jnp.zeros((8, 8)), "b": jnp.zeros((4, 4))})

    def update(grads):   # the state stacked per device, as init_sharded places it
        run = per_device(lambda g, s: tx.update(g, s)[0], 2)
        return run(*jax.tree.map(lambda a: jnp.stack([a, a]), (grads, state)))

    with pytest.raises(ValueError, match=r"not the one init saw.*\['c'\]"):
        update({"a": jnp.zeros((8, 8)), "c": jnp.zeros((4, 4))})
    with pytest.raises(ValueError, match=r"not the one init saw"):
        update({"a": jnp.zeros((8, 8))})
    with pytest.raises(ValueError, match=r"residual of \['b'\] has shape \(4, 4\), expected "
                                         r"\(4, 5\)"):
        update({"a": jnp.zeros((8, 8)), "b": jnp.zeros((4, 5))})
    with pytest.raises(ValueError, match=r"residual of \['b'\] has shape \(4, 4\), expected "
                                         r"\(2, 8\)"):   # the same size, transposed
        update({"a": jnp.zeros((8, 8)), "b": jnp.zeros((2, 8))})
    assert update({"a": jnp.ones((8, 8)), "b": jnp.ones((4, 4))})["b"].shape == (2, 4, 4)


def test_a_state_not_placed_by_init_sharded_names_init_sharded():
    """A ``tx.init`` state in a multi-device step: `state_specs` refuses it
    before ``shard_map`` sees it (whose errors name no fix, or none of the
    leaves); with specs from ``eval_shape`` instead, the update names it."""
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import transforms

    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    params = {"w": jnp.zeros((8, 4)), "odd": jnp.zeros((7, 3))}
    tx = optax.chain(transforms.compressed_all_reduce("d", compressor=qc.qsgd(bits=4),
                                                      key=jax.random.key(0)), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"\['odd'\].*init_sharded.*restore_sharded"):
        transforms.state_specs(tx.init(params), "d")
    assert transforms.state_specs(transforms.init_sharded(tx, params, mesh, "d"), "d")

    even = {"w": jnp.zeros((8, 4))}
    specs = transforms.state_specs(jax.eval_shape(tx.init, even), "d")
    step = jax.jit(jax.shard_map(
        lambda p, s: tx.update(jax.lax.pcast(p, "d", to="varying"), s, p),
        mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs)))
    with pytest.raises(ValueError, match=r"not placed per device.*init_sharded"):
        step(jax.device_put(even, NamedSharding(mesh, P())), tx.init(even))


def _transforms_on(axis):
    """Every transformation of ``transforms`` that takes a data axis, on ``axis``."""
    import optax

    import transforms

    key = jax.random.key(0)
    return {
        "compressed_all_reduce": transforms.compressed_all_reduce(
            axis, compressor=qc.onebit(), key=key),
        "compressed_all_reduce min_size": transforms.compressed_all_reduce(
            axis, compressor=qc.onebit(), key=key, min_size=100),
        "powersgd exact steps": transforms.powersgd(axis, rank=2, key=key),
        "powersgd": transforms.powersgd(axis, rank=2, key=key, compress_after=0),
        "gradiveq": transforms.gradiveq(axis, key=key, slice_size=16, rank=2),
        "compressed_model_averaging": optax.chain(optax.sgd(0.1),
                                                  transforms.compressed_model_averaging(
                                                      axis, every_k=2, key=key)),
        "clip_by_global_norm": transforms.clip_by_global_norm(1.0, axis),
    }


@pytest.mark.parametrize("name", list(_transforms_on("d")) + ["fsdp", "hierarchical"])
def test_an_unbound_axis_name_is_named_with_the_bound_ones(name):
    """A transformation made for another axis than the step maps over: one
    ValueError naming the axis and the axes that are bound (before: a NameError,
    an AssertionError without a message from lax.pmean inside, or for the global
    norm a silently local one)."""
    import transforms

    params = {"w": jnp.ones((16, 8)), "b": jnp.ones((8,))}
    grads = jax.tree.map(lambda a: jnp.stack([a, -a]), params)
    if name == "fsdp":
        f = transforms.fsdp("data", dimension={"w": 0, "b": None}, key=jax.random.key(0))

        def step(g):
            value_and_grad = f.value_and_grad(lambda p: sum(jnp.sum(a) for a in jax.tree.leaves(p)))
            return value_and_grad(g, f.init(g))[0][0]
    else:
        tx = (transforms.compressed_all_reduce(("d", "data"), compressor=qc.onebit(),
                                               key=jax.random.key(0))
              if name == "hierarchical" else _transforms_on("data")[name])

        def step(g):
            return tx.update(g, tx.init(params), params)[0]

    missing = "'data'"
    with pytest.raises(ValueError, match=rf"axis_name .*{missing} is not a bound axis: "
                                         r"the mapped axes here are 'd'"):
        per_device(step, 2)(grads)


_CORE = {"core": qc.compressed_all_reduce, "reduce_scatter": qc.compressed_reduce_scatter,
         "all_gather": qc.compressed_all_gather}


@pytest.mark.parametrize("name", [*_transforms_on("d"), "accumulate", "diloco", *_CORE])
def test_an_integer_leaf_is_refused_by_name(name):
    """An int32 leaf among float ones: a ValueError naming the leaf from every
    transformation and from the compressed collectives (before: the transform
    returned zeros, the "mean" of integers, and the core named no leaf). The
    uncompressed ring collectives sum integers exactly, as lax.psum does."""
    import optax

    import transforms

    params = {"w": jnp.ones((16, 8)), "count": jnp.arange(4, dtype=jnp.int32) * 1000}
    grads = jax.tree.map(lambda a: jnp.stack([a, a]), params)
    txs = {**_transforms_on("d"),
           # alone: optax.sgd before it would turn the integers into floats
           "compressed_model_averaging": transforms.compressed_model_averaging(
               "d", every_k=2, key=jax.random.key(0)),
           "accumulate": transforms.accumulate("d", inner=optax.sgd(0.1), every=2),
           "diloco": transforms.diloco("d", inner=optax.sgd(0.1), every=2)}

    def step(g):
        if name in _CORE:
            return _CORE[name](g, "d", qc.qsgd(bits=4), jax.random.key(0)).value
        tx = txs[name]
        return jax.tree.leaves(tx.update(g, tx.init(params), params)[0])[0]

    where = {"core": "x", "reduce_scatter": "x", "all_gather": "shard"}.get(name, "(grads|updates)")
    with pytest.raises(ValueError, match=rf"{where}\['count'\] has dtype int32: .*floating-point"):
        per_device(step, 2)(grads)


_BAD_KEYS = {"None": None, "an int seed": 0, "a float array": np.ones(2, np.float32),
             "a batch of keys": jax.random.split(jax.random.key(0), 2),
             "int32 words": np.zeros(2, np.int32)}


@pytest.mark.parametrize("bad", list(_BAD_KEYS))
def test_a_bad_key_is_refused_when_the_transformation_is_made(bad):
    """key=None, 0 or a float array passed construction and failed in the first
    update without naming key; now every factory that takes a key refuses it."""
    import transforms

    key = _BAD_KEYS[bad]
    factories = [
        lambda: transforms.compressed_all_reduce("d", compressor=qc.onebit(), key=key),
        lambda: transforms.powersgd("d", rank=2, key=key),
        lambda: transforms.gradiveq("d", key=key, slice_size=16, rank=2),
        lambda: transforms.compressed_model_averaging("d", every_k=2, key=key),
        lambda: transforms.fsdp("d", dimension={"w": 0}, key=key),
    ]
    for make in factories:
        with pytest.raises(ValueError, match=r"^key must be one PRNG key"):
            make()


def test_typed_and_legacy_keys_are_accepted():
    import transforms

    for key in (jax.random.key(0), jax.random.PRNGKey(0), np.asarray(jax.random.PRNGKey(0))):
        tx = transforms.compressed_all_reduce("d", compressor=qc.qsgd(bits=4), key=key)
        state = jax.tree.map(lambda a: jnp.stack([a, a]), tx.init({"w": jnp.ones((4, 4))}))
        out = per_device(lambda g, s, tx=tx: tx.update(g, s)[0], 2)(
            {"w": jnp.ones((2, 4, 4))}, state)
        assert np.isfinite(np.asarray(out["w"])).all()


def test_a_folder_named_qcollect_that_shadows_the_package_is_named(tmp_path):
    """From a directory holding a folder named ``qcollect`` (a checkout, say),
    Python may take that folder for the package (a namespace package, with an
    editable install); ``import transforms`` then names the folder."""
    (tmp_path / "qcollect").mkdir()

    def run(code):
        return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})

    probe = run("import qcollect; print(getattr(qcollect, '__file__', None))")
    if probe.stdout.strip() != "None":
        pytest.skip("this install finds the installed package before the folder")
    out = run("import transforms")
    assert out.returncode == 1
    assert f"found the folder {tmp_path / 'qcollect'}, not the installed package" in out.stderr
