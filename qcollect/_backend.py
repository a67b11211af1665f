"""What qcollect does only because a backend needs it: every workaround, in one list.

Each entry names the backend that needs it (as measured with jaxlib 0.10 on
CPU), where the workaround lives, the *guard* (a test that fails if the
workaround is removed while it is still needed) and the *probe* (a check
that fails, or a benchmark that shows it, once the backend no longer needs
it: then the workaround can go). The probes that are unit tests live in
``tests/test_backend.py``.

1. **bfloat16 collectives travel widened** (XLA:CPU): a bfloat16
   collective-permute or all-gather is converted to float32 for the
   transfer, doubling its bytes (float16 is not). qcollect sends the
   bit-identical uint16 words of both 16-bit floats instead (`narrow_word`;
   `qcollect.collectives._ring.permute`, `qcollect.collectives._ring.all_gather_invariant`). Guard:
   ``tests/test_ring.py::test_ring_all_gather_of_16_bit_floats_equals_all_gather_at_16_bits``
   and the 16-bit wire-byte tests of ``tests/test_wire.py``. Probe:
   ``tests/test_backend.py::test_xla_cpu_widens_16_bit_collective_permutes``.
2. **A swap between two processes crawls in one piece** (Gloo, the CPU
   backend across processes): a permutation in which two devices send to
   each other moves one large buffer at well under the link rate, as if
   the two directions took turns; in pieces of `SWAP_PIECE_BYTES` it keeps
   up with ``psum`` (`split_swaps`, `ppermute_in_pieces`). Guard:
   ``tests/test_ring.py::test_swaps_in_pieces_move_what_one_ppermute_moves``
   (same values) and ``tests/launch_worker.py`` (across processes). Probe:
   ``python -m qcollect.bench network --nproc 2 --bandwidth 1gbit
   --swap-probe`` (timing, see docs/multiprocess.md).
3. **Every array of a collective is a message of its own** (Gloo): across
   processes each operand of a tuple all-reduce or permute costs about 6 ms
   whatever its size, so a tree of small leaves pays per leaf.
   `qcollect.collectives._messages` packs each exchange into one buffer of words
   (`qcollect.fused_psum`, `qcollect.collectives._messages.send_packed`). Guard:
   ``tests/test_messages.py`` (one operand per collective). Probe:
   ``python -m qcollect.bench network --nproc 4 --message-probe``.
4. **A max reduction can drop a NaN** (XLA:CPU's vectorised reduce: a row
   of 4096 or more float32 values holding one NaN can reduce to 1.0 or
   -inf). `propagate_nonfinite` adds ``sum(v - v)`` (zero, or NaN when
   any value is not finite) to such a reduction; QSGD's scales and the
   entropy quantizer's range (`qcollect.compressors._entropy_stats.extremes`) use it.
   Guard: ``tests/test_contract.py::test_shapes_dtypes_zeros_and_non_finite_inputs``.
   Probe: ``tests/test_backend.py::test_xla_cpu_max_can_drop_a_nan``.
5. **Constant slice offsets compile a kernel per leaf** (XLA's fusion,
   every backend): the offset of a static slice is a constant inside its
   fusion, so two leaves of one shape compile two kernels.
   `qcollect.collectives._offsets` computes the offsets at run time. Guard and probe:
   ``tests/test_buckets.py::test_leaves_of_one_shape_share_their_kernels``.
6. **A reduction of stacked scalars is copied into every consumer** (XLA's
   algebraic simplifier): ``all(stack(flags))`` becomes a chain of ands,
   duplicated into each leaf's update, a program quadratic in the leaves.
   ``transforms._sharding.all_finite`` reads the flags through an identity
   gather, which XLA never copies. Guard:
   ``tests/test_tx_allreduce.py::test_finite_flag_is_reduced_once``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["SWAP_PIECE_BYTES", "narrow_word", "ppermute_in_pieces", "propagate_nonfinite",
           "split_swaps"]

_NARROW_FLOATS = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float16): jnp.uint16}

#: Pieces of a swap between two processes on the CPU backend (entry 2).
SWAP_PIECE_BYTES = 1 << 18


def narrow_word(dtype):
    """The unsigned word type that carries a 16-bit float dtype through a
    collective bit for bit (entry 1); None for every other dtype."""
    return _NARROW_FLOATS.get(jnp.dtype(dtype))


def has_swap(perm) -> bool:
    """Whether two devices of the permutation ``perm`` send to each other."""
    pairs = {(src, dst) for src, dst in perm if src != dst}
    return any((dst, src) in pairs for src, dst in pairs)


def split_swaps(perm) -> bool:
    """Whether ``perm``'s large transfers go in pieces (entry 2): several
    processes on the CPU backend and a swap in the permutation. A ring of
    three or more devices has no swap."""
    return jax.process_count() > 1 and jax.default_backend() == "cpu" and has_swap(perm)


def ppermute_in_pieces(leaf: jax.Array, axis_name, perm, pieces: bool) -> jax.Array:
    """`lax.ppermute` of ``leaf``; with ``pieces``, a leaf over
    `SWAP_PIECE_BYTES` moves as that many bytes per collective-permute (the
    same values and bytes on the wire)."""
    nbytes = leaf.size * jnp.dtype(leaf.dtype).itemsize
    if not pieces or nbytes <= SWAP_PIECE_BYTES:
        return lax.ppermute(leaf, axis_name, perm)
    count = -(-nbytes // SWAP_PIECE_BYTES)
    flat = leaf.reshape(-1)
    bounds = [flat.size * i // count for i in range(count + 1)]
    moved = [lax.ppermute(flat[bounds[i]:bounds[i + 1]], axis_name, perm) for i in range(count)]
    return jnp.concatenate(moved).reshape(leaf.shape)


def propagate_nonfinite(reduced: jax.Array, values: jax.Array, axis: int) -> jax.Array:
    """``reduced`` (a max or min of ``values`` along ``axis``) made NaN where
    any of its values is NaN or infinite (entry 4): a sum always propagates
    them, a vectorised max may not."""
    return reduced + jnp.sum(values - values, axis=axis)
