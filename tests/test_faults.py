"""Bad and extreme input: every compressor keeps finite input finite over the whole
float32 range (and non-finite input non-finite), alone and through the collective."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcollect as qc
from tests.helpers import per_device

F32_MAX = float(np.finfo(np.float32).max)


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
    }


def _inputs():
    rng = np.random.default_rng(0)
    sign = rng.choice([-1.0, 1.0], 4096)
    return {
        "near the maximum": sign * rng.uniform(0.5, 1.0, 4096) * F32_MAX,
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


def test_update_on_another_tree_names_the_first_difference():
    """tx.update on a tree other than the one tx.init saw: a ValueError naming the
    first leaf path where they part, or the leaf whose shape changed."""
    import transforms

    tx = transforms.compressed_all_reduce("d", compressor=qc.onebit(), key=jax.random.key(0))
    state = tx.init({"a": jnp.zeros((8, 8)), "b": jnp.zeros((4, 4))})

    def update(grads):
        run = per_device(lambda g: tx.update(g, state)[0], 2)
        return run(jax.tree.map(lambda a: jnp.stack([a, a]), grads))

    with pytest.raises(ValueError, match=r"not the one init saw.*\['c'\]"):
        update({"a": jnp.zeros((8, 8)), "c": jnp.zeros((4, 4))})
    with pytest.raises(ValueError, match=r"not the one init saw"):
        update({"a": jnp.zeros((8, 8))})
    with pytest.raises(ValueError, match=r"residual of \['b'\] has shape \(4, 4\), expected "
                                         r"\(4, 5\)"):
        update({"a": jnp.zeros((8, 8)), "b": jnp.zeros((4, 5))})
    assert update({"a": jnp.ones((8, 8)), "b": jnp.ones((4, 4))})["b"].shape == (2, 4, 4)
