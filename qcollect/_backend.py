"""The register of what qcollect does only because a backend needs it.

Every backend-specific branch and every compiler workaround of the package
is an entry here: an `Entry` constant (in `ENTRIES`) saying which backend
behaves so, what it does, what qcollect does about it and why, what each
platform gets, and the test of ``tests/test_backend.py`` that guards it (it
fails if the workaround is removed while it is still needed) or probes it
(it fails once the backend no longer needs it: then the workaround can go).
Code elsewhere that applies a workaround carries a one-line pointer to its
entry, and this is the only module of the library that looks at the backend
(``jax.default_backend()``, ``jax.process_count()``); a choice that differs
by platform is a table from platform name to the choice (`SPLIT_SWAPS`,
`RING_INSIDE_NODES`), ``"cpu"`` as measured and ``"gpu"``/``"tpu"`` what
they get instead.

Measured with jaxlib 0.10 on CPU, in one process and across processes
(Gloo); GPU and TPU were not measured, and get the CPU's program wherever
the workaround is harmless to them (bit-identical views, the same bytes).
The measurements are in ``docs/collectives.md#backend-workarounds``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["ENTRIES", "RING_INSIDE_NODES", "SPLIT_SWAPS", "SWAP_PIECE_BYTES", "Entry",
           "Platform", "has_swap", "narrow_word", "ppermute_in_pieces", "propagate_nonfinite",
           "ring_inside_nodes", "split_swaps"]

#: The platforms a choice is keyed by (``jax.default_backend()``'s names).
Platform = Literal["cpu", "gpu", "tpu"]


class Entry(NamedTuple):
    """One backend behaviour that qcollect works around.

    Attributes:
      backend: the compiler or runtime that behaves so, and on which platform.
      behaviour: what it does, as measured.
      workaround: what qcollect does instead, why, and the code that does it.
      platforms: what each platform gets (``"cpu"`` as measured).
      test: the guard or probe, a test function of ``tests/test_backend.py``.
    """

    backend: str
    behaviour: str
    workaround: str
    platforms: str
    test: str


_EVERYWHERE = "every platform (measured on cpu; gpu and tpu get the same program, unmeasured)"

WIDE_16_BIT = Entry(
    backend="XLA:CPU",
    behaviour="a bfloat16 collective-permute or all-gather is converted to float32 for the "
              "transfer, doubling its bytes (float16 is not)",
    workaround="16-bit floats travel as their bit-identical uint16 words (`narrow_word`: "
               "qc.permute, qc.exchange_chunks, qc.all_gather_invariant, qc.ring_all_gather, "
               "which gathers the words hop by hop so no float view is fused into the buffer "
               "update)",
    platforms=_EVERYWHERE,
    test="test_xla_cpu_widens_bfloat16_collective_permutes",
)

SLOW_SWAPS = Entry(
    backend="Gloo (the CPU backend across processes)",
    behaviour="a permutation in which two devices send to each other moves one large buffer "
              "at well under the link rate, as if the two directions took turns",
    workaround="such a permutation moves buffers over `SWAP_PIECE_BYTES` in pieces of that "
               "size, which keep up with psum (`split_swaps`, `ppermute_in_pieces`, used by "
               "qc.permute); a ring of three or more devices has no swap",
    platforms="`SPLIT_SWAPS`: cpu across processes splits; one process never does",
    test="test_swaps_split_across_processes_on_cpu_only",
)

MESSAGE_PER_ARRAY = Entry(
    backend="Gloo (the CPU backend across processes)",
    behaviour="every operand of a collective (a tuple all-reduce, one ppermute per leaf) is "
              "an exchange of its own, about 6 ms each whatever its size",
    workaround="each exchange packs its arrays into one buffer of words, bit for bit "
               "(`send_packed` of the collectives, qc.fused_psum); the bytes are the same",
    platforms=_EVERYWHERE,
    test="test_a_pytree_moves_as_one_message",
)

MAX_DROPS_NAN = Entry(
    backend="XLA:CPU's vectorised reduce",
    behaviour="a max over a row of 4096 or more float32 values holding one NaN can reduce "
              "to a number (1.0 or -inf)",
    workaround="`propagate_nonfinite` adds sum(v - v) (zero, or NaN when a value is not "
               "finite) to such a reduction: QSGD's bucket scales and the entropy "
               "quantizer's range",
    platforms=_EVERYWHERE,
    test="test_xla_cpu_max_can_drop_a_nan",
)

CONSTANT_OFFSETS = Entry(
    backend="XLA's fusion (every platform)",
    behaviour="a static slice offset is a constant inside its fusion, so two leaves of one "
              "shape compile two kernels, and the program's code grows with the leaves",
    workaround="the collectives cut their results at offsets computed at run time (a sort "
               "of constant pairs keyed on a value of the array; `runtime_offsets`, "
               "`runtime_slices` of the collectives)",
    platforms=_EVERYWHERE,
    test="test_runtime_offsets_are_not_constants",
)

LITERAL_OPERANDS = Entry(
    backend="jax.shard_map and XLA's sharding propagation (every platform)",
    behaviour="every array literal inside a shard_map body becomes an operand of the body, "
              "and the sharding propagation is quadratic in those operands",
    workaround="the runtime offsets are broadcast scalars (`lax.full`), never array "
               "literals (`runtime_offsets`)",
    platforms=_EVERYWHERE,
    test="test_runtime_offsets_hold_no_array_literals",
)

STACKED_FLAGS_COPIED = Entry(
    backend="XLA's algebraic simplifier (every platform)",
    behaviour="all(stack(flags)) becomes a chain of ands, copied into each consumer: a "
              "program quadratic in the leaves",
    workaround="the transforms' finite check (`all_finite` of transforms/_finite.py) reads "
               "the flags through an identity gather, which XLA never copies",
    platforms=_EVERYWHERE,
    test="test_xla_copies_a_reduction_of_stacked_flags",
)

RING_IN_NODES = Entry(
    backend="Gloo (the CPU backend across processes)",
    behaviour="Gloo carries every collective, those inside a process too, and its "
              "reduce-scatter of 4 devices' 64 MiB ran in 785 ms where a ppermute ring of "
              "the same bytes ran in 275 ms",
    workaround="the uncompressed reduce-scatter inside a node of the hierarchical "
               "collectives (qc.compressed_all_reduce and qc.compressed_reduce_scatter over "
               "(outer, inner)) is the ppermute ring there (`ring_inside_nodes`)",
    platforms="`RING_INSIDE_NODES`: cpu across processes rings; one process, gpu and tpu "
              "use psum_scatter",
    test="test_ring_inside_nodes_across_processes_on_cpu_only",
)

BATCH_OF_ONE_MISCOMPILED = Entry(
    backend="XLA:CPU (jaxlib 0.10)",
    behaviour="Gram-Schmidt's fused projection rest - sum(col * rest) col is miscompiled on "
              "a stack with a size-1 batch axis ((1, 1000, 8): columns off by 0.1), while "
              "one matrix or a batch of two or more is right",
    workaround="the orthogonalisation of the PowerSGD compressors folds the leading axes "
               "into one and drops it when it holds a single matrix (`gram_schmidt` of the "
               "compressors)",
    platforms=_EVERYWHERE,
    test="test_xla_cpu_miscompiles_a_batch_of_one_matrix",
)

COLUMN_BLOCKS_IN_A_LOOP = Entry(
    backend="XLA:CPU",
    behaviour="a vmapped column codec over the side-by-side matrix runs over a transposed "
              "copy, several times slower than a loop over the column blocks",
    workaround="a column segment's chunks are coded one after the other (`lax.map`), each "
               "read straight from the side-by-side matrix; row segments' contiguous chunks "
               "are vmapped (the segments' chunk coding)",
    platforms=_EVERYWHERE,
    test="test_column_chunks_are_coded_in_a_loop",
)

DECODES_ADDED_ONE_BY_ONE = Entry(
    backend="XLA:CPU",
    behaviour="a sum over the major axis of stacked decodes runs many times slower than "
              "the same adds one after the other",
    workaround="the owner of a chunk decodes and adds one payload at a time, one fused "
               "elementwise pass (the pairwise all-reduce, qc.compressed_reduce_scatter)",
    platforms=_EVERYWHERE,
    test="test_decodes_are_added_one_by_one",
)

REDUCTION_INPUTS_WRITTEN = Entry(
    backend="XLA:CPU",
    behaviour="an intermediate that feeds a reduction is written out in full when it is "
              "shared with another consumer, a broadcast scalar operand, or fused with the "
              "broadcast of the reduction's own result; sibling reductions of one array "
              "read it once each",
    workaround="the codecs shape their statistics: group sums as products with ones "
               "(`group_sums`, 1-bit's bucket statistics), 1-bit's words and two sums as "
               "one variadic reduce (one pass instead of three), only unary and same-shape "
               "ops feeding 1-bit's counts, QSGD's max norm as max(max v, -min v) rather "
               "than max |v|",
    platforms=_EVERYWHERE,
    test="test_statistics_are_shaped_for_xla_cpu",
)

TOP_K_ON_FLOATS = Entry(
    backend="XLA:CPU",
    behaviour="top_k is about 10 times faster on float32 keys than on int32 keys",
    workaround="the adaptive quantizer selects on the bit patterns of |v| viewed as float32",
    platforms=_EVERYWHERE,
    test="test_adaptive_selects_on_float_keys",
)

SEPARATE_OUTER_PRODUCTS = Entry(
    backend="XLA:CPU",
    behaviour="k separate outer products run faster than one batched product",
    workaround="qc.powersgd_reconstruct(stacked=False) forms each matrix as a product of "
               "its own (also no consumer reads a slice of a (k, n, m) stack)",
    platforms=_EVERYWHERE,
    test="test_unstacked_reconstruction_is_separate_products",
)

PREFIX_SUMS_PER_WORD = Entry(
    backend="XLA:CPU",
    behaviour="an element-wise prefix sum over n values costs about ten passes over them",
    workaround="the sparse coding packs the candidate mask into words and prefix-sums the "
               "n / 32 word counts (`compact_words` of the coding: threshold's, adaptive's "
               "and Golomb-Rice's index lists)",
    platforms=_EVERYWHERE,
    test="test_sparse_selection_prefix_sums_words",
)

STACKED_BUCKETS = Entry(
    backend="XLA:CPU (one process, and Gloo across processes)",
    behaviour="a class of equal buckets run as one batch (one vmapped program) is first "
              "copied into one stack: for buckets over 4 MiB the copies cost more than the "
              "per-bucket hops they save (a transformer block at width 1024, 4 and 16 MiB "
              "leaves, one process: qsgd-4 batching every class 149.9 ms per step, traced "
              "bucket by bucket 75.1 ms)",
    workaround="batch_buckets='auto' (qc.BATCH_BUCKETS) batches classes of buckets of at "
               "most qc.AUTO_BATCH_BYTES (4 MiB) and traces larger ones, unless a class has "
               "more than qc.AUTO_TRACE_LIMIT of them (`runs_batched` of the collectives)",
    platforms="cpu as measured; gpu and tpu get the same thresholds, unmeasured (a guess "
              "either way: a kernel launch per bucket favours batching there, and their "
              "memory bandwidth makes the stack's copies cheaper)",
    test="test_auto_batches_small_buckets_and_traces_large_ones",
)

SHIFTS_EXCHANGE = Entry(
    backend="Gloo (the CPU backend across processes) and XLA:CPU in one process",
    behaviour="one all-to-all of the stacked payloads was never faster beyond noise than "
              "N - 1 ppermute shifts (Gloo moves a large all-to-all well under the link "
              "rate; in one process it adds two copies of the payload)",
    workaround="exchange='permute' is the default of every collective that takes "
               "`exchange` (qc.compressed_all_reduce, qc.compressed_reduce_scatter, "
               "qc.fsdp_gather); exchange='all_to_all' is one lax.all_to_all",
    platforms="cpu as measured; gpu and tpu get the shifts too, unmeasured (NCCL's and the "
              "TPU's all-to-all move every pair at once and may well win: a guess until "
              "measured, docs/collectives.md#one-all-to-all-or-n---1-shifts)",
    test="test_the_shifts_are_the_default_exchange",
)

#: Every entry, by name.
ENTRIES: dict[str, Entry] = {
    "WIDE_16_BIT": WIDE_16_BIT,
    "SLOW_SWAPS": SLOW_SWAPS,
    "MESSAGE_PER_ARRAY": MESSAGE_PER_ARRAY,
    "MAX_DROPS_NAN": MAX_DROPS_NAN,
    "CONSTANT_OFFSETS": CONSTANT_OFFSETS,
    "LITERAL_OPERANDS": LITERAL_OPERANDS,
    "STACKED_FLAGS_COPIED": STACKED_FLAGS_COPIED,
    "RING_IN_NODES": RING_IN_NODES,
    "BATCH_OF_ONE_MISCOMPILED": BATCH_OF_ONE_MISCOMPILED,
    "COLUMN_BLOCKS_IN_A_LOOP": COLUMN_BLOCKS_IN_A_LOOP,
    "DECODES_ADDED_ONE_BY_ONE": DECODES_ADDED_ONE_BY_ONE,
    "REDUCTION_INPUTS_WRITTEN": REDUCTION_INPUTS_WRITTEN,
    "TOP_K_ON_FLOATS": TOP_K_ON_FLOATS,
    "SEPARATE_OUTER_PRODUCTS": SEPARATE_OUTER_PRODUCTS,
    "PREFIX_SUMS_PER_WORD": PREFIX_SUMS_PER_WORD,
    "STACKED_BUCKETS": STACKED_BUCKETS,
    "SHIFTS_EXCHANGE": SHIFTS_EXCHANGE,
}

_NARROW_FLOATS = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float16): jnp.uint16}

#: Pieces of a swap between two processes (`SLOW_SWAPS`).
SWAP_PIECE_BYTES = 1 << 18

#: Whether a swap across processes moves in pieces, per platform (`SLOW_SWAPS`):
#: measured on cpu (Gloo); gpu and tpu (NCCL, ICI) move it whole.
SPLIT_SWAPS: dict[str, bool] = {"cpu": True, "gpu": False, "tpu": False}

#: Whether the reduce-scatter inside a node is a ppermute ring across
#: processes, per platform (`RING_IN_NODES`): measured on cpu (Gloo); gpu and
#: tpu use their own ``psum_scatter``.
RING_INSIDE_NODES: dict[str, bool] = {"cpu": True, "gpu": False, "tpu": False}


def narrow_word(dtype: jnp.dtype | type) -> type | None:
    """The unsigned word type that carries a 16-bit float dtype through a
    collective bit for bit (`WIDE_16_BIT`); None for every other dtype."""
    return _NARROW_FLOATS.get(jnp.dtype(dtype))


def has_swap(perm: Sequence[tuple[int, int]]) -> bool:
    """Whether two devices of the permutation ``perm`` send to each other."""
    pairs = {(src, dst) for src, dst in perm if src != dst}
    return any((dst, src) in pairs for src, dst in pairs)


def _across_processes(table: dict[str, bool]) -> bool:
    """``table``'s choice for this backend when several processes run, else False."""
    return jax.process_count() > 1 and table.get(jax.default_backend(), False)


def split_swaps(perm: Sequence[tuple[int, int]]) -> bool:
    """Whether ``perm``'s large transfers go in pieces (`SLOW_SWAPS`): across
    processes where `SPLIT_SWAPS` says so, and a swap in the permutation."""
    return _across_processes(SPLIT_SWAPS) and has_swap(perm)


def ring_inside_nodes() -> bool:
    """Whether the uncompressed reduce-scatter inside a node is a
    ``ppermute`` ring rather than ``lax.psum_scatter`` (`RING_IN_NODES`):
    across processes where `RING_INSIDE_NODES` says so."""
    return _across_processes(RING_INSIDE_NODES)


def ppermute_in_pieces(leaf: jax.Array, axis_name: Hashable,
                       perm: Sequence[tuple[int, int]], pieces: bool) -> jax.Array:
    """`lax.ppermute` of ``leaf``; with ``pieces``, a leaf over
    `SWAP_PIECE_BYTES` moves as that many bytes per collective-permute (the
    same values and bytes on the wire; `SLOW_SWAPS`)."""
    nbytes = leaf.size * jnp.dtype(leaf.dtype).itemsize
    if not pieces or nbytes <= SWAP_PIECE_BYTES:
        return lax.ppermute(leaf, axis_name, perm)
    count = -(-nbytes // SWAP_PIECE_BYTES)
    flat = leaf.reshape(-1)
    bounds = [flat.size * i // count for i in range(count + 1)]
    moved = [lax.ppermute(flat[bounds[i]:bounds[i + 1]], axis_name, perm) for i in range(count)]
    return jnp.concatenate(moved).reshape(leaf.shape)


def propagate_nonfinite(reduced: jax.Array, values: jax.Array | np.ndarray,
                        axis: int) -> jax.Array:
    """``reduced`` (a max or min of ``values`` along ``axis``) made NaN where
    any of its values is NaN or infinite (`MAX_DROPS_NAN`): a sum always
    propagates them, a vectorised max may not."""
    return reduced + jnp.sum(values - values, axis=axis)
