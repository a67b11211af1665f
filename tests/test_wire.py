"""wire_bytes reads what the compiled program sends."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import qcollect as qc
from tests.helpers import per_device


def _wire(fn, n, *args):
    run = per_device(fn, n)
    return qc.wire_bytes(run.mapped, *run.shard(*args))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("length", [1024, 1001])
def test_identity_ring_sends_2_n_minus_1_over_n(n, length):
    x = jnp.zeros((n, length))
    ring = _wire(lambda v: qc.ring_all_reduce(v, "d"), n, x)
    assert ring == qc.ring_bytes_per_device(length, 4, n)
    assert ring == 2 * (n - 1) * (-(-length // n)) * 4  # padding included
    psum = _wire(lambda v: lax.psum(v, "d"), n, x)
    assert psum == pytest.approx(2 * (n - 1) / n * 4 * length, abs=1)


def test_single_device_sends_nothing():
    assert _wire(lambda v: qc.ring_all_reduce(v, "d"), 1, jnp.zeros((1, 100))) == 0


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("compressor,ratio", [(qc.qsgd(bits=4), 1 / 8),
                                              (qc.onebit(bucket_size=1024), 1 / 32),
                                              (qc.cast("bfloat16"), 1 / 2)],
                         ids=["qsgd4", "onebit", "bf16"])
def test_compressed_bytes_are_payload_bytes(n, compressor, ratio):
    length = 1 << 16
    x = jnp.zeros((n, length))
    algorithm = "ring" if compressor.linear else "pairwise"
    sent = _wire(lambda v: qc.compressed_all_reduce(
        v, "d", compressor, jax.random.key(0), algorithm=algorithm).value, n, x)
    chunk = jax.eval_shape(compressor.encode, jnp.zeros(length // n), jax.random.key(0))
    assert sent == 2 * (n - 1) * qc.payload_bytes(chunk)
    uncompressed = qc.ring_bytes_per_device(length, 4, n)
    assert ratio <= sent / uncompressed <= ratio * 1.1  # plus the scales or means


def test_loops_count_their_trips():
    n = 8
    ops = qc.wire_report(per_device(lambda v: qc.ring_reduce_scatter(v, "d"), n).mapped,
                         *per_device(lambda v: v, n).shard(jnp.zeros((n, 800))))
    assert {op.multiplicity for op in ops} == {n - 1}
    assert all(op.op == "collective-permute" and op.operand_bytes == 400 for op in ops)


def test_all_gather_and_conditional_branches():
    n = 4
    x = jnp.zeros((n, 100))
    gathered = _wire(lambda v: lax.all_gather(v, "d"), n, x)
    assert gathered == (n - 1) * 400

    def either(v):
        return lax.cond(v[0] > 0, lambda u: lax.pcast(lax.psum(u, "d"), "d", to="varying"),
                        lambda u: qc.ring_all_reduce(u[:10], "d").sum() + u, v)

    assert _wire(either, n, x) == pytest.approx(2 * (n - 1) / n * 400, abs=1)  # larger branch
    run = per_device(either, n)
    smaller = qc.wire_bytes(run.mapped, *run.shard(x), branches="min")
    assert smaller == 2 * (n - 1) * 3 * 4  # the ring on 10 values: chunks of 3
    with pytest.raises(ValueError, match="branches"):
        qc.wire_bytes(run.mapped, *run.shard(x), branches="mean")
