"""qc.memory_report: the bytes each compiled kernel reads and writes."""

import json
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
from qcollect.bench import passes
from tests.helpers import mesh_of


def _big(report):
    """The kernels of at least 1 KiB, (op, read, written, multiplicity)."""
    return [(k.op, k.read, k.written, k.multiplicity) for k in report
            if k.read + k.written >= 1024]


def test_an_elementwise_pass_reads_and_writes_its_array_once():
    x = jnp.ones(4096)
    assert _big(qc.memory_report(lambda v: 2 * v + 1, x)) == [("fusion", 16384, 16384, 1)]
    assert qc.memory_bytes(lambda v, w: v + 1.5 * w, x, x) == 3 * 16384


def test_a_slice_reads_only_what_it_takes():
    x = jnp.ones(4096)
    (kernel,) = [k for k in qc.memory_report(lambda v: v[:1024] * 2, x) if k.traffic]
    assert (kernel.read, kernel.written) == (4096, 4096)


def test_an_update_in_place_moves_only_the_update():
    def update(buffer, row, i):
        return lax.dynamic_update_index_in_dim(buffer, row * 2, i, 0)

    buffer, row = jnp.zeros((64, 1024)), jnp.ones(1024)
    step = jax.jit(update, donate_argnums=0)
    report = qc.memory_report(step, buffer, row, 3)
    assert sum(k.traffic for k in report) <= 3 * 4096  # not the 256 KiB buffer


def test_loops_count_once_per_iteration_and_a_conditional_by_its_cheaper_branch():
    x = jnp.ones(4096)
    looped = qc.memory_report(
        lambda v: lax.fori_loop(0, 5, lambda i, a: jnp.sin(a) * 1.01 + i, v), x)
    assert sum(k.multiplicity for k in looped if k.read >= 16384) >= 5

    def branchy(v, p):
        return lax.cond(p, lambda: jnp.sum(jnp.sin(v)), lambda: v[3] * 2)

    cheap, costly = (qc.memory_bytes(branchy, x, True, branches=b) for b in ("min", "max"))
    assert costly >= 16384 > cheap  # a floor counts the branch that moves least
    with pytest.raises(ValueError, match="branches"):
        qc.memory_report(branchy, x, True, branches="all")


def test_a_loop_whose_trip_count_depends_on_data_raises_naming_it():
    """A lax.while_loop bounded by an argument: XLA knows no trip count, so its
    traffic would depend on data; the report names the loop, as wire_bytes
    does, rather than count one trip. With the bound static every trip counts."""

    def repeat(v, bound):
        return lax.while_loop(lambda c: c[0] < bound,
                              lambda c: (c[0] + 1, jnp.sin(c[1])), (0, v))[1]

    x, bound = jnp.ones(4096), jnp.int32(3)
    hlo = jax.jit(repeat).lower(x, bound).compile().as_text()
    (loop,) = re.findall(r"%(while[\w.\-]*) = .* while\(", hlo)
    for measure in (qc.memory_report, qc.memory_bytes):
        with pytest.raises(ValueError, match=rf"while loop %{re.escape(loop)} in computation "
                                             r"%\S+ \(body %\S+\) has no known trip count"):
            measure(repeat, x, bound)
    static = qc.memory_report(lambda v: repeat(v, 3), x)
    assert {k.multiplicity for k in static if k.op == "fusion" and k.read >= 16384} == {3}


def test_the_codec_of_a_compressed_all_reduce_reads_the_gradient_and_writes_the_sum():
    """Through compressed_all_reduce on 4 devices: 1-bit reads each device's gradient
    (encode) and writes the whole sum (final decode); both exchanges move the
    same chunks, the all-to-all adding copies of the small payload and of the
    bucket means (under 30% of the gradient: 73,736 bytes of 262,144 here)."""
    n, values = 4, 1 << 16
    mesh = mesh_of(n)
    x = jax.device_put(jnp.ones((n, values)), NamedSharding(mesh, P("d")))

    def program(exchange):
        return jax.jit(jax.shard_map(lambda v: qc.compressed_all_reduce(
            v[0], "d", qc.onebit(), algorithm="pairwise", exchange=exchange).value[None],
            mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    gradient = 4 * values
    for exchange in ("permute", "all_to_all"):
        report = qc.memory_report(program(exchange), x)
        assert any(k.read >= gradient for k in report), exchange  # encode
        assert any(k.written >= gradient for k in report), exchange  # decode
    shifts, one = (qc.memory_bytes(program(e), x) for e in ("permute", "all_to_all"))
    assert 2 * gradient <= shifts <= one <= shifts + 0.3 * gradient


def test_passes_benchmark_reports_every_method_against_the_bandwidth(tmp_path, capsys):
    out = tmp_path / "passes.json"
    assert passes.main(["--values", "16384", "--devices", "2", "--repeats", "1",
                        "--methods", "psum,onebit", "--json", str(out), "--kernels"]) == 0
    report = json.loads(out.read_text())
    assert report["bandwidth"]["triad"] > 1e8 and report["bandwidth"]["copy"] > 1e8
    rows = {(r["method"], r["path"]): r for r in report["rows"]}
    assert set(rows) == {("psum", "collective"), ("onebit", "collective"),
                         ("onebit", "transform")}
    for r in rows.values():
        assert r["median_ms"] > 0 and 0 < r["efficiency"] and r["floor_ms"] > 0
    assert rows[("onebit", "collective")]["passes"] >= 2  # encode, final decode
    # Error feedback adds the residual: read before the encode, written after.
    assert (rows[("onebit", "transform")]["traffic_gradients"]
            > rows[("onebit", "collective")]["traffic_gradients"] + 1)
    assert "gradient-sized passes" in capsys.readouterr().out


def test_passes_benchmark_rejects_unknown_names(capsys):
    for flag, value in (("--methods", "gzip"), ("--paths", "ring"), ("--exchange", "mail")):
        with pytest.raises(SystemExit):
            passes.main([flag, value])
        assert flag in capsys.readouterr().err
