"""Guards and probes of the register in `qcollect._backend`.

Every entry of ``qcollect._backend.ENTRIES`` names one test here. A *probe*
asserts first that the backend still misbehaves, then that qcollect's
workaround repairs it: when its first assertion fails the backend has been
fixed, and the workaround (its entry says where it lives) can go with the
probe. A *guard* asserts that the code still has the shape the workaround
gave it (a product where a reduction was slow, a loop where a vmap was), so
that it is not undone by accident while the backend still needs it.
"""

import ast
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
from qcollect import _backend

ROOT = pathlib.Path(__file__).resolve().parents[1]
cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU behaviours")


def _sharded_hlo(fn, x, n: int = 4, compiled: bool = False) -> str:
    mesh = jax.make_mesh((n,), ("d",))
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    lowered = f.lower(jax.device_put(x, NamedSharding(mesh, P("d"))))
    return lowered.compile().as_text() if compiled else lowered.as_text()


def _lowered(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


# The register itself.

def _test_names() -> set[str]:
    tree = ast.parse(pathlib.Path(__file__).read_text())
    return {node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_entry_names_a_test_here_and_every_probe_an_entry():
    names = _test_names()
    missing = {name: e.test for name, e in _backend.ENTRIES.items() if e.test not in names}
    assert not missing, missing
    assert all(isinstance(e, _backend.Entry) and all(e) for e in _backend.ENTRIES.values())
    assert {name for name, value in vars(_backend).items()
            if isinstance(value, _backend.Entry)} == set(_backend.ENTRIES)
    register = {e.test for e in _backend.ENTRIES.values()}
    own = {"test_every_entry_names_a_test_here_and_every_probe_an_entry",
           "test_only_the_register_looks_at_the_backend"}
    assert names - own <= register, sorted(names - own - register)


def test_only_the_register_looks_at_the_backend():
    """``jax.default_backend()`` and ``jax.process_count()`` are read by
    `qcollect._backend` alone (the benchmarks and the launcher, programs on
    top of the library, print them)."""
    readers = []
    for path in sorted((ROOT / "qcollect").rglob("*.py")):
        rel = path.relative_to(ROOT / "qcollect")
        if rel.parts[0] in ("bench", "launch") or rel == pathlib.Path("_backend.py"):
            continue
        if re.search(r"\b(default_backend|process_count)\b", path.read_text()):
            readers.append(str(rel))
    assert not readers, readers


# WIDE_16_BIT

@cpu_only
def test_xla_cpu_widens_bfloat16_collective_permutes():
    """Probe: ``lax.ppermute`` of bfloat16 moves float32 on XLA:CPU;
    `qc.permute` moves the 16-bit words, half the bytes."""
    dtype = jnp.bfloat16
    perm = [(i, (i + 1) % 4) for i in range(4)]
    x = jnp.arange(4 * 64).astype(dtype)

    def permutes(fn):
        text = _sharded_hlo(fn, x, compiled=True)
        return [line for line in text.splitlines() if " collective-permute(" in line]

    plain = permutes(lambda v: lax.ppermute(v, "d", perm))
    assert plain and all("= f32[" in line for line in plain), \
        "XLA:CPU no longer widens bfloat16 permutes: remove WIDE_16_BIT of qcollect/_backend.py"
    ours = permutes(lambda v: qc.permute(v, "d", perm))
    assert ours and all("= u16[" in line for line in ours)
    assert _backend.narrow_word(jnp.float16) == _backend.narrow_word(dtype) == jnp.uint16
    assert _backend.narrow_word(jnp.float32) is None


# SLOW_SWAPS

def test_swaps_split_across_processes_on_cpu_only(monkeypatch):
    """Guard of the table: a swap is split across processes on cpu, never in
    one process, never on gpu or tpu; a ring has no swap."""
    swap, ring = [(0, 1), (1, 0)], [(0, 1), (1, 2), (2, 0)]
    assert _backend.has_swap(swap) and not _backend.has_swap(ring)
    assert jax.process_count() == 1 and not _backend.split_swaps(swap)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for platform, split in [("cpu", True), ("gpu", False), ("tpu", False)]:
        monkeypatch.setattr(jax, "default_backend", lambda platform=platform: platform)
        assert _backend.split_swaps(swap) is split
        assert not _backend.split_swaps(ring)
    assert _backend.SPLIT_SWAPS == {"cpu": True, "gpu": False, "tpu": False}


# MESSAGE_PER_ARRAY

def test_a_pytree_moves_as_one_message():
    """Guard: ``lax.ppermute`` of a tree is one collective per leaf;
    `qc.permute` packs the leaves into one."""
    tree = {"a": jnp.ones((4, 8)), "b": jnp.ones((4, 3), jnp.int32), "c": jnp.ones((4, 5))}
    perm = [(i, (i + 1) % 4) for i in range(4)]
    plain = _sharded_hlo(lambda t: lax.ppermute(t, "d", perm), tree)
    ours = _sharded_hlo(lambda t: qc.permute(t, "d", perm), tree)
    assert plain.count("stablehlo.collective_permute") == 3
    assert ours.count("stablehlo.collective_permute") == 1


# MAX_DROPS_NAN

@cpu_only
@pytest.mark.parametrize("width", [4096, 8192, 100_000])
def test_xla_cpu_max_can_drop_a_nan(width):
    """Probe: a vectorised max over a row with one NaN returns a number on
    XLA:CPU; `propagate_nonfinite` gives NaN."""
    rows = np.ones((4, width), np.float32)
    rows[1, width // 2] = np.nan
    plain = jax.jit(lambda v: jnp.max(v, axis=1))(rows)
    assert not np.isnan(plain[1]), \
        "XLA:CPU's max keeps NaN now: remove MAX_DROPS_NAN of qcollect/_backend.py"
    fixed = jax.jit(lambda v: _backend.propagate_nonfinite(jnp.max(v, axis=1), v, 1))(rows)
    assert np.isnan(fixed[1]) and np.array_equal(np.asarray(fixed)[[0, 2, 3]], np.ones(3))


# CONSTANT_OFFSETS, LITERAL_OPERANDS

def test_runtime_offsets_are_not_constants():
    """Guard: the slices' offsets survive compilation as the outputs of a
    sort, read by dynamic slices, not folded into constants (which would
    compile a kernel per leaf; ``tests/test_buckets.py`` counts the kernels)."""
    from qcollect.collectives._offsets import runtime_slices

    x = jnp.arange(16.0)
    compiled = jax.jit(lambda a: runtime_slices(a, [0, 8], [8, 8])).lower(x).compile().as_text()
    assert " sort(" in compiled and " dynamic-slice(" in compiled
    assert [np.asarray(s).tolist() for s in runtime_slices(x, [0, 8], [8, 8])] == \
        [list(range(8)), list(range(8, 16))]


def test_runtime_offsets_hold_no_array_literals():
    """Guard: the offsets are broadcast scalars; no array literal (which
    ``shard_map`` would make an operand of its body) enters the program."""
    from qcollect.collectives._offsets import runtime_offsets

    text = _lowered(lambda a: list(runtime_offsets(a, [3, 5, 9]).values()), jnp.arange(16.0))
    assert "stablehlo.sort" in text
    assert not re.search(r"stablehlo\.constant .*: tensor<\d+x", text), text


# STACKED_FLAGS_COPIED

def _flag_ands(leaves: int, gather: bool) -> int:
    def step(tree):
        flags = jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in tree])
        if gather:  # as transforms/_finite.py reads them
            flags = flags.at[jnp.arange(len(tree))].get(
                mode="promise_in_bounds", indices_are_sorted=True, unique_indices=True)
        ok = jnp.all(flags)
        return [jnp.where(ok, 2 * leaf, leaf) for leaf in tree]

    tree = [jnp.full((16,), float(i)) for i in range(leaves)]
    return len(re.findall(r"pred\[\] and\(", jax.jit(step).lower(tree).compile().as_text()))


@cpu_only
def test_xla_copies_a_reduction_of_stacked_flags():
    """Probe: ``all(stack(flags))`` is copied into every consumer, a program
    quadratic in the leaves; read through an identity gather it is reduced
    once."""
    small, large = _flag_ands(8, False), _flag_ands(32, False)
    assert large > 8 * small, \
        "XLA no longer copies the and-chain: remove STACKED_FLAGS_COPIED of qcollect/_backend.py"
    small, large = _flag_ands(8, True), _flag_ands(32, True)
    assert large <= 4 * small + 8, (small, large)


# RING_IN_NODES

def test_ring_inside_nodes_across_processes_on_cpu_only(monkeypatch):
    """Guard of the table, and of the ring's sums: across processes on cpu
    the reduce-scatter inside a node is the ``ppermute`` ring, which sums
    what ``psum_scatter`` does (`tests/test_hierarchical.py` checks the whole
    all-reduce with it); one process, gpu and tpu use ``psum_scatter``."""
    from qcollect.collectives._hierarchical import reduce_scatter_inside_node

    assert jax.process_count() == 1 and not _backend.ring_inside_nodes()
    x = jax.random.normal(jax.random.key(0), (4, 3, 5))  # a (L, M, ...) grid, L = 4

    def scatter(v):
        return reduce_scatter_inside_node(v[0], "d")[None]

    psum = _run_per_device(scatter, x)
    with monkeypatch.context() as patch:
        patch.setattr(jax, "process_count", lambda: 2)
        for platform, ring in [("cpu", True), ("gpu", False), ("tpu", False)]:
            patch.setattr(jax, "default_backend", lambda platform=platform: platform)
            assert _backend.ring_inside_nodes() is ring
    monkeypatch.setattr(_backend, "ring_inside_nodes", lambda: True)
    ringed = _run_per_device(scatter, x)
    np.testing.assert_allclose(ringed, psum, rtol=1e-6, atol=1e-6)
    assert _backend.RING_INSIDE_NODES == {"cpu": True, "gpu": False, "tpu": False}


def _run_per_device(fn, x, n: int = 4) -> np.ndarray:
    mesh = jax.make_mesh((n,), ("d",))
    x = jnp.broadcast_to(x[None], (n,) + x.shape) + jnp.arange(n, dtype=x.dtype).reshape(
        (n,) + (1,) * x.ndim)
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    return np.asarray(f(jax.device_put(x, NamedSharding(mesh, P("d")))))


# BATCH_OF_ONE_MISCOMPILED

@cpu_only
def test_xla_cpu_miscompiles_a_batch_of_one_matrix():
    """Probe: the Gram-Schmidt loop on a ``(1, 1000, 8)`` stack differs from
    the same loop on its one matrix (a batch of two agrees); the
    orthogonalisation, which drops the size-1 axis, agrees."""
    from qcollect.compressors._power_iteration import _gram_schmidt_loop, gram_schmidt

    p = jnp.asarray(np.random.default_rng(0).normal(size=(2, 1000, 8)), jnp.float32)
    loop = jax.jit(_gram_schmidt_loop, static_argnums=1)
    one = np.asarray(loop(p[0], 1e-8))
    assert np.max(np.abs(np.asarray(loop(p, 1e-8))[0] - one)) < 1e-5
    off = np.nanmax(np.abs(np.asarray(loop(p[:1], 1e-8))[0] - one))
    assert off > 1e-3, \
        "XLA:CPU compiles a batch of one right: remove BATCH_OF_ONE_MISCOMPILED of _backend.py"
    np.testing.assert_allclose(np.asarray(gram_schmidt(p[:1], 1e-8))[0], one, atol=1e-5)


# COLUMN_BLOCKS_IN_A_LOOP

def test_column_chunks_are_coded_in_a_loop():
    """Guard: a column segment's chunks are coded in a loop (a scan) read
    from the side-by-side matrix, a row segment's in one vmap (no loop)."""
    from qcollect.collectives._algorithms import Chunks, Codec
    from qcollect.collectives._layout import plan_segments

    x = jnp.ones((6, 8))
    keys = jax.random.split(jax.random.key(0), 4)
    loops = {}
    for grouping in ("column", "element"):
        (segment,) = plan_segments([x], grouping, 1, 4)
        jaxpr = jax.make_jaxpr(
            lambda data, segment=segment: Codec(qc.identity(), None).round_trip_all(
                Chunks(data, segment), keys))(segment.laid_out([x]))
        loops[grouping] = str(jaxpr).count("scan[")
    assert loops == {"column": 1, "element": 0}


# DECODES_ADDED_ONE_BY_ONE

@pytest.mark.parametrize("collective", ["pairwise", "reduce_scatter"])
def test_decodes_are_added_one_by_one(collective):
    """Guard: the owner adds the N decoded payloads one at a time, never as a
    sum over a stack of them."""
    mesh = jax.make_mesh((4,), ("d",))

    def run(v):
        if collective == "pairwise":
            return qc.compressed_all_reduce(v[0], "d", qc.identity(), algorithm="pairwise",
                                            fuse=False).value[None]
        return qc.compressed_reduce_scatter(v[0], "d", qc.identity()).value[None]

    f = jax.shard_map(run, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    jaxpr = str(jax.make_jaxpr(f)(jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P("d")))))
    assert "reduce_sum" not in jaxpr and len(re.findall(r"= add ", jaxpr)) >= 3


# REDUCTION_INPUTS_WRITTEN

def test_statistics_are_shaped_for_xla_cpu():
    """Guard: 1-bit's bucket statistics are one variadic reduce of three
    operands and sums as products with ones; column sums are a product;
    QSGD's max norm reads no shared ``|v|``."""
    from qcollect.compressors import _qsgd

    buckets = _lowered(qc.onebit(grouping="bucket", bucket_size=64).encode, jnp.ones(4096))
    variadic = [line for line in buckets.splitlines() if re.search(r"%\S+:3 = stablehlo\.reduce",
                                                                   line)]
    assert len(variadic) == 1 and "dot_general" in buckets
    columns = _lowered(qc.onebit(grouping="column").encode, jnp.ones((64, 32)))
    assert "dot_general" in columns
    scales = _lowered(lambda v: _qsgd._bucket_scales(v, "max"), jnp.ones((8, 64)))
    assert "stablehlo.abs" not in scales


# TOP_K_ON_FLOATS

def test_adaptive_selects_on_float_keys():
    """Guard: the adaptive quantizer's top_k runs on float32 keys."""
    text = _lowered(qc.adaptive(64).encode, jnp.ones((256, 8)))
    top_k = [line for line in text.splitlines() if "top_k" in line]
    assert top_k and all(re.search(r"top_k.*: tensor<[\dx]+xf32>", line) for line in top_k)


# SEPARATE_OUTER_PRODUCTS

def test_unstacked_reconstruction_is_separate_products():
    """Guard: ``powersgd_reconstruct(stacked=False)`` forms each matrix with a
    product of its own, no batched product."""
    p, q = jnp.ones((3, 10, 2)), jnp.ones((3, 7, 2))
    text = _lowered(lambda p, q: qc.powersgd_reconstruct(p, q, stacked=False), p, q)
    products = [line for line in text.splitlines() if "stablehlo.dot_general" in line
                and "tensor<10x7xf32>" in line.split("->")[-1]]
    assert len(products) == 3 and not any("batching_dims" in line for line in products)


# PREFIX_SUMS_PER_WORD

def test_sparse_selection_prefix_sums_words():
    """Guard: the sparse coding's compaction prefix-sums the n / 32 words of
    the packed mask, never the n mask bits."""
    from qcollect.coding._sparse import compact_words

    words = jnp.full((128,), 0x01010101, jnp.uint32)
    text = _lowered(lambda w: compact_words(w, 4096, 64), words)
    sums = re.findall(r"call @cumsum\S*\((?:[^)]*)\) : \(tensor<(\d+)x", text)
    assert sums and all(int(n) <= 128 for n in sums), sums


# STACKED_BUCKETS

def test_auto_batches_small_buckets_and_traces_large_ones():
    """Guard: ``"auto"`` batches a class of buckets up to AUTO_BATCH_BYTES
    and traces larger ones (up to AUTO_TRACE_LIMIT of them); the default is
    ``"auto"``."""
    limit, many = qc.AUTO_BATCH_BYTES, qc.AUTO_TRACE_LIMIT
    assert qc.BATCH_BUCKETS == "auto" and limit == 4 << 20
    assert qc.runs_batched(2, limit) and not qc.runs_batched(2, limit + 1)
    assert not qc.runs_batched(many, 4 * limit) and qc.runs_batched(many + 1, 4 * limit)


# SHIFTS_EXCHANGE

def test_the_shifts_are_the_default_exchange():
    """Guard: every collective that takes ``exchange`` defaults to the N - 1
    shifts, and the default pairwise all-reduce compiles to
    collective-permutes, no all-to-all."""
    import inspect

    for fn in (qc.compressed_all_reduce, qc.compressed_reduce_scatter, qc.fsdp_gather):
        assert inspect.signature(fn).parameters["exchange"].default == "permute", fn
    n = 4
    x = jnp.ones((n, n * 64))
    hlo = _sharded_hlo(lambda v: qc.compressed_all_reduce(
        v[0], "d", qc.qsgd(bits=4), jax.random.key(0), algorithm="pairwise").value[None],
        x, n, compiled=True)
    assert "collective-permute" in hlo and "all-to-all" not in hlo
