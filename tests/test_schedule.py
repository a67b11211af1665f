"""The phase schedules: `transforms.CompressAfter` (exact steps first) for
`compressed_all_reduce` and `powersgd`, GradiVeQ's phase names, the
deprecated spellings, and the timing model that reads the schedules."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms
from tests.helpers import mesh_of, sharded_update
from transforms import CompressAfter, PhaseSpan

ROOT = pathlib.Path(__file__).resolve().parents[1]
N = 2
# Leaves of several shapes: a matrix PowerSGD compresses, a conv kernel, a vector.
SHAPES = {"w": (24, 16), "k": (3, 3, 2, 4), "b": (16,)}


def _template():
    return {k: jnp.zeros(s) for k, s in SHAPES.items()}


def _grads(seed, n=N):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((n,) + s).astype(np.float32) for k, s in SHAPES.items()}


def _lowered(tx):
    """The text of one jitted, unoptimised step of ``tx`` on ``N`` devices."""
    state = transforms.init_sharded(tx, _template(), mesh_of(N), "d")
    grads = jax.device_put(_grads(0), NamedSharding(mesh_of(N), P("d")))
    return sharded_update(tx, N, state).mapped.lower(grads, state).as_text()


def test_compress_after_spans_and_at():
    warm = CompressAfter(3)
    assert warm.spans(8) == (PhaseSpan("exact", 0, 3), PhaseSpan("compressed", 3, 8))
    assert [bool(warm.at(t)) for t in range(5)] == [True, True, True, False, False]
    # K = 0: every step compressed; K >= steps: every step exact.
    assert CompressAfter(0).spans(4) == (PhaseSpan("compressed", 0, 4),)
    assert not bool(CompressAfter(0).at(0))
    assert CompressAfter(5).spans(5) == CompressAfter(9).spans(5) == (PhaseSpan("exact", 0, 5),)
    assert CompressAfter(3).spans(0) == ()
    assert transforms.steps_per_phase(CompressAfter(10).spans(300)) == {
        "exact": 10, "compressed": 290}
    # ``at`` of a traced count, under jit: the step's branch flag.
    at = jax.jit(warm.at)
    assert [bool(at(jnp.int32(t))) for t in range(5)] == [True, True, True, False, False]
    assert at(jnp.int32(0)).dtype == jnp.bool_
    np.testing.assert_array_equal(jax.jit(warm.at)(jnp.arange(5)), [1, 1, 1, 0, 0])
    assert CompressAfter(np.int64(3)) == warm and hash(CompressAfter(3)) == hash(warm)
    with pytest.raises(ValueError, match="steps"):
        warm.spans(-1)


@pytest.mark.parametrize("bad", [-1, 1.5])
def test_compress_after_is_checked_by_name(bad):
    with pytest.raises(ValueError, match="compress_after"):
        CompressAfter(bad)
    with pytest.raises(ValueError, match="compress_after"):
        transforms.powersgd("d", rank=2, key=jax.random.key(0), compress_after=bad)
    with pytest.raises(ValueError, match="compress_after"):
        transforms.compressed_all_reduce("d", compressor=qc.qsgd(bits=4), key=jax.random.key(0),
                                         compress_after=bad)


def test_deprecated_spellings_warn_and_mean_the_new_ones():
    """``powersgd(start_iter=)``, ``powersgd_phases`` and ``warm_up_phases``:
    each warns and gives what ``compress_after`` and `CompressAfter` give;
    neither function is in ``transforms.__all__``."""
    key = jax.random.key(0)
    with pytest.warns(DeprecationWarning, match="compress_after"):
        old = transforms.powersgd("d", rank=2, key=key, start_iter=5)
    new = _lowered(transforms.powersgd("d", rank=2, key=key, compress_after=5))
    assert _lowered(old) == new
    assert _lowered(transforms.powersgd("d", rank=2, key=key,
                                        compress_after=CompressAfter(5))) == new
    assert _lowered(transforms.powersgd("d", rank=2, key=key, compress_after=7)) != new
    for given in (5, 7, 10):   # both given, even equal or the default: which one?
        with pytest.warns(DeprecationWarning), pytest.raises(
                ValueError, match=f"start_iter=5 and compress_after={given}"):
            transforms.powersgd("d", rank=2, key=key, start_iter=5, compress_after=given)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="start_iter"):
        transforms.powersgd("d", rank=2, key=key, start_iter=-1)

    for call, want in [
            (lambda: transforms.powersgd_phases(300), CompressAfter(10).spans(300)),
            (lambda: transforms.powersgd_phases(300, start_iter=30), CompressAfter(30).spans(300)),
            (lambda: transforms.warm_up_phases(600, compress_after=120),
             CompressAfter(120).spans(600)),
            (lambda: transforms.warm_up_phases(5, compress_after=0), CompressAfter(0).spans(5))]:
        with pytest.warns(DeprecationWarning, match=r"CompressAfter\(K\)\.spans"):
            assert call() == want
    assert not {"powersgd_phases", "warm_up_phases"} & set(transforms.__all__)


def test_gradiveq_phases_are_lead_in_sampling_and_compressed():
    spans = transforms.gradiveq_phases(10, warmup_steps=2, sample_steps=1, compressed_steps=3)
    assert spans == (PhaseSpan("lead-in", 0, 2), PhaseSpan("sampling", 2, 3),
                     PhaseSpan("compressed", 3, 6), PhaseSpan("sampling", 6, 7),
                     PhaseSpan("compressed", 7, 10))
    assert transforms.steps_per_phase(spans) == {"lead-in": 2, "sampling": 2, "compressed": 6}
    # No lead-in steps, no lead-in phase.
    assert {s.name for s in transforms.gradiveq_phases(
        10, warmup_steps=0, sample_steps=1, compressed_steps=3)} == {"sampling", "compressed"}


def test_compressed_all_reduce_takes_the_schedule_or_its_count():
    """``compress_after=CompressAfter(3)`` is ``compress_after=3``: the same
    updates and state over 5 steps (3 exact, 2 compressed), on leaves of
    several shapes."""
    n = 4

    def run(compress_after):
        tx = transforms.compressed_all_reduce("d", compressor=qc.qsgd(bits=4),
                                              key=jax.random.key(1),
                                              compress_after=compress_after)
        state = transforms.init_sharded(tx, _template(), mesh_of(n), "d")
        step = sharded_update(tx, n, state)
        outs = []
        for t in range(5):
            out, state = step(_grads(10 + t, n), state)
            outs.append(out)
        return outs, state

    (counted, s1), (scheduled, s2) = run(3), run(CompressAfter(3))
    unkeyed = lambda tree: jax.tree.map(  # noqa: E731
        lambda a: jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a,
        tree)
    for a, b in zip(jax.tree.leaves(unkeyed((counted, s1))),
                    jax.tree.leaves(unkeyed((scheduled, s2))), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    grads = _grads(12, n)   # step 2: still exact; step 3: compressed
    np.testing.assert_allclose(counted[2]["w"], grads["w"].mean(0), rtol=1e-5, atol=1e-6)
    assert not np.allclose(counted[3]["w"], _grads(13, n)["w"].mean(0), rtol=1e-3)


@pytest.fixture
def time_to_target():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from lm import time_to_target
        yield time_to_target
    finally:
        sys.path.remove(str(ROOT / "examples"))


def test_time_to_target_seconds_follow_each_point_s_schedule(time_to_target):
    """A point's seconds: its ``"exact"`` steps at ``none``'s step time,
    the rest at its own compressed step's (GradiVeQ's lead-in and sampling
    steps included), a part of the last step by its share."""
    t = {"none": 1.0, "powersgd-r4": 0.4, "qsgd-4": 0.5, "qsgd-8": 0.7, "gradiveq": 0.6}
    seconds = time_to_target.seconds
    powersgd = {"compressors": ["powersgd"], "powersgd_rank": 4, "powersgd_start": 5}
    assert seconds(powersgd, 12.5, t) == pytest.approx(5 * 1.0 + 7.5 * 0.4)
    assert seconds(powersgd, 3.5, t) == pytest.approx(3.5 * 1.0)      # all exact
    # compress_after replaces powersgd_start
    assert seconds({**powersgd, "compress_after": 8}, 12.5, t) == pytest.approx(8 + 4.5 * 0.4)
    qsgd = {"compressors": ["qsgd-4"], "compress_after": 10}
    assert seconds(qsgd, 25.5, t) == pytest.approx(10 * 1.0 + 15.5 * 0.5)
    assert seconds(qsgd, 10, t) == pytest.approx(10 * 1.0)
    assert seconds({"compressors": ["qsgd-8"]}, 20, t) == pytest.approx(20 * 0.7)
    assert seconds({"compressors": ["none"]}, 20, t) == pytest.approx(20 * 1.0)
    gradiveq = {"compressors": ["gradiveq"], "gradiveq_warmup": 4, "gradiveq_sample_steps": 2,
                "gradiveq_compressed_steps": 3}
    assert seconds(gradiveq, 11, t) == pytest.approx(11 * 0.6)
