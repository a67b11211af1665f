"""Probes of the backend behaviours that `qcollect._backend` works around.

Each probe asserts that the backend still misbehaves, and that qcollect's
workaround repairs it. When a probe's first assertion fails, the backend has
been fixed: remove the workaround (its entry in ``qcollect/_backend.py``
says where it lives) and this probe.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
from qcollect import _backend

cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU behaviours")


def _permute_hlo(fn, x, mesh) -> list[str]:
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    x = jax.device_put(x, NamedSharding(mesh, P("d")))
    text = f.lower(x).compile().as_text()
    return [line for line in text.splitlines() if " collective-permute(" in line]


@cpu_only
def test_xla_cpu_widens_bfloat16_collective_permutes():
    """Entry 1: ``lax.ppermute`` of bfloat16 moves float32 on XLA:CPU;
    `qc.permute` moves the 16-bit words, half the bytes."""
    dtype = jnp.bfloat16
    mesh = jax.make_mesh((4,), ("d",))
    perm = [(i, (i + 1) % 4) for i in range(4)]
    x = jnp.arange(4 * 64).astype(dtype)
    plain = _permute_hlo(lambda v: lax.ppermute(v, "d", perm), x, mesh)
    assert plain and all("= f32[" in line for line in plain), \
        "XLA:CPU no longer widens bfloat16 permutes: remove entry 1 of qcollect/_backend.py"
    ours = _permute_hlo(lambda v: qc.permute(v, "d", perm), x, mesh)
    assert ours and all("= u16[" in line for line in ours)
    assert _backend.narrow_word(jnp.float16) == _backend.narrow_word(dtype) == jnp.uint16
    assert _backend.narrow_word(jnp.float32) is None


@cpu_only
@pytest.mark.parametrize("width", [4096, 8192, 100_000])
def test_xla_cpu_max_can_drop_a_nan(width):
    """Entry 4: a vectorised max over a row with one NaN returns a number
    on XLA:CPU; `propagate_nonfinite` gives NaN."""
    rows = np.ones((4, width), np.float32)
    rows[1, width // 2] = np.nan
    plain = jax.jit(lambda v: jnp.max(v, axis=1))(rows)
    assert not np.isnan(plain[1]), \
        "XLA:CPU's max keeps NaN now: remove entry 4 of qcollect/_backend.py"
    fixed = jax.jit(lambda v: _backend.propagate_nonfinite(jnp.max(v, axis=1), v, 1))(rows)
    assert np.isnan(fixed[1]) and np.array_equal(np.asarray(fixed)[[0, 2, 3]], np.ones(3))


def test_pieces_split_large_swaps_only():
    """Entry 2's split: whole below `SWAP_PIECE_BYTES`, equal pieces above,
    and only where a swap runs across processes on the CPU backend."""
    assert _backend.has_swap([(0, 1), (1, 0)]) and not _backend.has_swap([(0, 1), (1, 2), (2, 0)])
    assert jax.process_count() == 1 and not _backend.split_swaps([(0, 1), (1, 0)])
