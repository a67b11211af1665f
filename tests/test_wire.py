"""wire_bytes reads what the compiled program sends."""

import re
import warnings

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


def _mesh2d(nodes=2, local=4):
    return jax.make_mesh((nodes, local), ("node", "local"),
                         devices=jax.devices()[:nodes * local])


def _placed(mesh, length):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rows = mesh.devices.size
    x = jax.random.normal(jax.random.key(0), (rows, length))
    return jax.device_put(x, NamedSharding(mesh, P(("node", "local"))))


def _mapped(mesh, fn):
    from jax.sharding import PartitionSpec as P

    spec = P(("node", "local"))
    return jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=spec,
                                 out_specs=spec))


@pytest.mark.parametrize("nodes, local", [(2, 4), (4, 2)])
def test_bytes_by_axis_are_the_analytic_bytes_of_each_axis(nodes, local):
    """psum over each axis, over both, and the ring over one: the bandwidth-optimal
    bytes of each, under the axes it runs over; together they are wire_bytes."""
    mesh = _mesh2d(nodes, local)
    length = 1000
    x = _placed(mesh, length)
    bytes_ = 4 * length
    fn = _mapped(mesh, lambda v: lax.psum(v, "local") + lax.psum(v, "node")
                 + lax.psum(v, ("node", "local")))
    split = qc.wire_bytes_by_axis(fn, x)
    assert split == pytest.approx({
        "local": 2 * (local - 1) / local * bytes_, "node": 2 * (nodes - 1) / nodes * bytes_,
        ("node", "local"): 2 * (nodes * local - 1) / (nodes * local) * bytes_}, abs=1)
    assert sum(split.values()) == pytest.approx(qc.wire_bytes(fn, x), abs=2)
    ring = _mapped(mesh, lambda v: qc.ring_all_reduce(v, "local"))
    assert qc.wire_bytes_by_axis(ring, x) == {
        "local": qc.ring_bytes_per_device(length, 4, local)}


@pytest.mark.parametrize("compressor", [qc.onebit(), qc.qsgd(bits=4)], ids=lambda c: c.name)
def test_compressed_all_reduce_across_nodes_counts_under_node(compressor):
    """A compressed all-reduce over "node" of a 2 x 4 mesh sends what it sends on a
    2-device mesh, all of it under "node"."""
    mesh = _mesh2d()
    x = _placed(mesh, 4096)
    fn = _mapped(mesh, lambda v: qc.compressed_all_reduce(
        v, "node", compressor, jax.random.key(0)).value)
    alone = _wire(lambda v: qc.compressed_all_reduce(v, "d", compressor, jax.random.key(0)).value,
                  2, jnp.zeros((2, 4096)))
    split = qc.wire_bytes_by_axis(fn, x)
    assert split == {"node": alone}
    assert qc.bytes_along(split, "node") == alone and qc.bytes_along(split, "local") == 0
    assert qc.bytes_along({"node,local": 3, "local": 5, ("node", "local"): 7}, "node") == 10


def test_bytes_by_axis_on_one_axis_and_without_a_mesh():
    n = 4
    run = per_device(lambda v: qc.ring_all_reduce(v, "d"), n)
    args = run.shard(jnp.zeros((n, 100)))
    assert qc.wire_bytes_by_axis(run.mapped, *args) == {"d": qc.wire_bytes(run.mapped, *args)}
    with pytest.raises(ValueError, match="mesh"):
        qc.wire_bytes_by_axis(lambda v: v * 2, jnp.zeros(3))


def test_iota_replica_groups_are_read():
    from qcollect.measure._wire import _device_groups

    line = "all-reduce(%p), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%sum"
    assert _device_groups(line) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert _device_groups("all-gather(%p), replica_groups=[2,4]<=[8]") == (
        (0, 1, 2, 3), (4, 5, 6, 7))
    assert _device_groups("all-reduce(%p), replica_groups={{0,2},{1,3}}") == ((0, 2), (1, 3))
    assert _device_groups("collective-permute(%p), source_target_pairs={{0,1},{1,0}}") == (
        (0, 1), (1, 0))


def _halve_until_small(u):
    """A data-dependent loop (no known trip count) that runs no collective."""
    return lax.while_loop(lambda c: jnp.abs(c).sum() > 1.0, lambda c: c * 0.5, u)


def test_loop_without_collectives_counts_nothing_whatever_its_trips():
    n = 4
    x = jnp.ones((n, 100))
    psum_only = _wire(lambda v: lax.psum(v, "d"), n, x)
    assert psum_only == pytest.approx(2 * (n - 1) / n * 400, abs=1)
    mixed = _wire(lambda v: _halve_until_small(lax.psum(v, "d")) + v, n, x)
    assert mixed == psum_only  # the psum outside the loop, nothing for the loop


def test_loop_with_nested_control_flow_but_no_collective_counts_nothing():
    def nested(u):
        def body(c):
            c = lax.cond(c[0] > 0, lambda w: w * 0.5, lambda w: -w, c)
            return lax.fori_loop(0, 3, lambda i, w: w * 0.9, c)
        return lax.while_loop(lambda c: jnp.abs(c).sum() > 1.0, body, u)

    assert _wire(nested, 4, jnp.ones((4, 100))) == 0
    assert _wire(_halve_until_small, 4, jnp.ones((4, 100))) == 0
    assert qc.wire_bytes(jax.jit(_halve_until_small), jnp.ones(100)) == 0
    assert qc.wire_report(_halve_until_small, jnp.ones(100)) == []


def test_collective_in_a_data_dependent_loop_raises_naming_the_loop():
    n = 4

    def converge(u):
        step = lambda c: lax.pcast(lax.psum(c, "d"), "d", to="varying") * 0.5  # noqa: E731
        return lax.while_loop(lambda c: jnp.abs(c).sum() > 1.0, step, u)

    run = per_device(converge, n)
    args = run.shard(jnp.ones((n, 100)))
    hlo = run.mapped.lower(*args).compile().as_text()
    loops = re.findall(r"%(while[\w.\-]*) = .* while\(", hlo)
    assert len(loops) == 1
    for measure in (qc.wire_bytes, qc.wire_report, qc.wire_bytes_by_axis):
        with pytest.raises(ValueError, match=re.escape(f"%{loops[0]} ")):
            measure(run.mapped, *args)


def test_collective_deep_inside_a_data_dependent_loop_raises():
    n = 2

    def converge(u):
        def body(c):
            return lax.cond(c[0] > 0, lambda w: lax.ppermute(w, "d", [(0, 1), (1, 0)]),
                            lambda w: w * 0.5, c)
        return lax.while_loop(lambda c: jnp.abs(c).sum() > 1.0, body, u)

    with pytest.raises(ValueError, match="while loop .*no known trip count"):
        _wire(converge, n, jnp.ones((n, 10)))


def test_collective_in_a_fori_loop_counts_every_trip():
    n = 4

    def repeated(u):
        return lax.fori_loop(0, 5, lambda i, c: lax.pcast(lax.psum(c, "d"), "d",
                                                           to="varying") * 0.5, u)

    once = _wire(lambda v: lax.psum(v, "d"), n, jnp.ones((n, 100)))
    assert _wire(repeated, n, jnp.ones((n, 100))) == pytest.approx(5 * once, abs=1)


_LOOP_HLO = """HloModule loop, num_partitions=4

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]) parameter(0)
  %v = f32[8]{0} get-tuple-element(%c), index=1
  %r = f32[8]{0} all-reduce(%v), replica_groups={{0,1,2,3}}, to_apply=%sum
  ROOT %p = pred[] constant(true)
}

%body (c.1: (s32[], f32[8])) -> (s32[], f32[8]) {
  ROOT %c.1 = (s32[], f32[8]) parameter(0)
}

ENTRY %main (x: (s32[], f32[8])) -> (s32[], f32[8]) {
  %x = (s32[], f32[8]) parameter(0)
  ROOT %while.7 = (s32[], f32[8]) while(%x), condition=%cond, body=%body, TRIP
}
"""


def test_a_loop_condition_counts_once_more_than_the_body():
    from qcollect.measure._wire import report_from_hlo

    known = _LOOP_HLO.replace("TRIP", 'backend_config={"known_trip_count":{"n":"3"}}')
    (op,) = report_from_hlo(known)
    assert (op.op, op.computation, op.multiplicity) == ("all-reduce", "cond", 4)
    with pytest.raises(ValueError, match="while loop %while.7 "):
        report_from_hlo(_LOOP_HLO.replace(", TRIP", ""))
    silent = _LOOP_HLO.replace("all-reduce(%v), replica_groups={{0,1,2,3}}, to_apply=%sum",
                               "negate(%v)").replace(", TRIP", "")
    assert report_from_hlo(silent) == []


_KNOWN_LOOP_HLO = _LOOP_HLO.replace("TRIP", 'backend_config={"known_trip_count":{"n":"3"}}')


def test_wire_bytes_and_memory_traffic_walk_the_program_alike():
    """One walk serves both readers: a psum in a fori_loop of 5 trips is one
    all-reduce that both count 5 times, a loop condition counts once more in
    both, and a loop without a known trip count stops both with one message."""
    from qcollect.measure import _traffic, _wire

    n = 4
    run = per_device(lambda u: lax.fori_loop(0, 5, lambda i, c: lax.pcast(
        lax.psum(c, "d"), "d", to="varying") * 0.5, u), n)
    args = run.shard(jnp.ones((n, 100)))
    (op,) = qc.wire_report(run.mapped, *args)
    (kernel,) = [k for k in qc.memory_report(run.mapped, *args) if k.op == "all-reduce"]
    assert op.multiplicity == kernel.multiplicity == 5
    assert op.computation == kernel.computation

    (op,) = _wire.report_from_hlo(_KNOWN_LOOP_HLO)
    (kernel,) = [k for k in _traffic.report_from_hlo(_KNOWN_LOOP_HLO) if k.op == "all-reduce"]
    assert op.multiplicity == kernel.multiplicity == 4
    unknown = _LOOP_HLO.replace(", TRIP", "")
    said = set()
    for read in (_wire.report_from_hlo, _traffic.report_from_hlo):
        with pytest.raises(ValueError, match=r"while loop %while\.7 in computation %main "
                                             r"\(body %body\) has no known trip count") as err:
            read(unknown)
        said.add(str(err.value).replace("wire bytes", "X").replace("memory traffic", "X"))
    assert len(said) == 1 and "lax.fori_loop" in said.pop()


def test_an_unknown_element_type_raises_naming_it():
    """A byte count is never guessed: an element type the reader has no size
    for stops every reader, naming the type."""
    from qcollect.measure import _hlo, _traffic, _wire

    assert _hlo.shape_bytes("(f32[4,8]{1,0}, s4[3], /*index=2*/token[])") == 128 + 1
    with pytest.raises(ValueError, match="unknown HLO element type 'f7e1m2' in the shape"):
        _hlo.shape_bytes("f7e1m2[8]{0}")
    odd = _KNOWN_LOOP_HLO.replace("f32[8]", "f7e1m2[8]")
    assert _hlo.parse(odd).shapes["v"] == "f7e1m2[8]{0}"  # parsing reads any type
    for read in (_wire.report_from_hlo, _traffic.report_from_hlo):
        with pytest.raises(ValueError, match="unknown HLO element type 'f7e1m2'"):
            read(odd)


# ------------------------------------------------------------------ phases

def _phased(count_limit=10):
    """A step that always psums 16 values, then in phase "warm-up" psums all
    64 and in phase "compressed" only the first 8 (a stand-in for a codec)."""

    def step(v):
        def warm_up(u):
            with qc.phase("warm-up"):
                return lax.psum(u, "d")

        def compressed(u):
            with qc.phase("compressed"):
                return jnp.tile(lax.psum(u[:8], "d"), 8)

        always = lax.psum(v[:16], "d")
        out = lax.cond(v[0] < count_limit, warm_up, compressed, v)
        return lax.pcast(out + always.sum(), "d", to="varying")

    return step


def _allreduce(n, values):
    return 2 * (n - 1) / n * 4 * values


def test_each_marked_phase_counts_its_branch_and_what_runs_always():
    n = 4
    run = per_device(_phased(), n)
    args = run.shard(jnp.zeros((n, 64)))
    by_phase = qc.wire_bytes_by_phase(run.mapped, *args)
    assert by_phase == {"compressed": round(_allreduce(n, 8 + 16)),
                        "warm-up": round(_allreduce(n, 64 + 16))}
    assert qc.wire_bytes(run.mapped, *args, branches="max") == by_phase["warm-up"]
    assert qc.wire_bytes(run.mapped, *args, branches="min") == by_phase["compressed"]
    with pytest.raises(ValueError, match="branches"):
        qc.wire_bytes_by_phase(run.mapped, *args, branches="mean")


def test_wire_bytes_of_a_phased_step_says_each_phase_sends_differently():
    n = 4
    run = per_device(_phased(), n)
    args = run.shard(jnp.zeros((n, 64)))
    warm, compressed = round(_allreduce(n, 64 + 16)), round(_allreduce(n, 8 + 16))
    with pytest.warns(UserWarning, match=rf"compressed {compressed:,}, warm-up {warm:,}.*"
                                         "wire_bytes_by_phase"):
        assert qc.wire_bytes(run.mapped, *args) == warm
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert qc.wire_bytes(run.mapped, *args, branches="max") == warm
        unphased = per_device(lambda v: lax.pcast(lax.psum(v, "d"), "d", to="varying"), n)
        assert qc.wire_bytes(unphased.mapped, *args) == round(_allreduce(n, 64))


def test_unmarked_programs_have_no_phases_and_a_mark_outside_a_conditional_names_the_one():
    n = 2
    x = jnp.zeros((n, 64))
    plain = per_device(lambda v: qc.ring_all_reduce(v, "d"), n)
    assert qc.wire_bytes_by_phase(plain.mapped, *plain.shard(x)) == {}

    def marked(v):
        with qc.phase("compressed"):
            return qc.ring_all_reduce(v, "d")

    run = per_device(marked, n)
    assert qc.wire_bytes_by_phase(run.mapped, *run.shard(x)) == {
        "compressed": qc.wire_bytes(plain.mapped, *plain.shard(x))}


def test_nested_marks_name_the_innermost_phase():
    """A phased transformation inside the later branch of another (the examples'
    uncompressed start around PowerSGD): its own phases are named, and the
    outer branch that holds them counts in each."""
    n = 4
    inner = _phased(count_limit=20)

    def step(v):
        def exact(u):
            with qc.phase("uncompressed"):
                return lax.pcast(lax.psum(u, "d") + lax.psum(u[:16], "d").sum(), "d",
                                 to="varying")

        def after(u):
            with qc.phase("compressed"):
                return inner(u)

        return lax.cond(v[1] < 5, exact, after, v)

    run = per_device(step, n)
    by_phase = qc.wire_bytes_by_phase(run.mapped, *run.shard(jnp.zeros((n, 64))))
    assert by_phase == {"compressed": round(_allreduce(n, 8 + 16)),
                        "uncompressed": round(_allreduce(n, 64 + 16)),
                        "warm-up": round(_allreduce(n, 64 + 16))}


def test_one_mark_may_name_several_phases_and_unmarked_conditionals_follow_branches():
    n = 4

    def step(v):
        def sampled(u):
            with qc.phase("warm-up", "sampling"):
                return lax.psum(u, "d")

        def compressed(u):
            with qc.phase("compressed"):
                return jnp.tile(lax.psum(u[:8], "d"), 8)

        def big(u):
            return lax.pcast(lax.psum(u[:32], "d").sum() + u, "d", to="varying")

        def small(u):
            return lax.pcast(lax.psum(u[:4], "d").sum() + u, "d", to="varying")

        out = lax.cond(v[0] < 3, sampled, compressed, v)
        return lax.cond(v[2] < 3, big, small, out)  # no phase: the larger counts

    run = per_device(step, n)
    args = run.shard(jnp.zeros((n, 64)))
    assert qc.wire_bytes_by_phase(run.mapped, *args) == {
        "compressed": round(_allreduce(n, 8 + 32)), "sampling": round(_allreduce(n, 64 + 32)),
        "warm-up": round(_allreduce(n, 64 + 32))}
    assert qc.wire_bytes_by_phase(run.mapped, *args, branches="min")["compressed"] == round(
        _allreduce(n, 8 + 4))


@pytest.mark.parametrize("names", [(), ("",), ("warm up",), ("a/b",), ("a,b",), (3,)])
def test_phase_names_are_checked(names):
    with pytest.raises(ValueError, match="phase"):
        qc.phase(*names)
