"""Oland & Raj's statistics of one array: its range, its min-max bins and
the entropy estimate that sets the bit-width (Algorithm 1: QUANTIZE and the
sampled entropy ``H``; `qcollect.entropy` builds the compressor on them).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from qcollect._backend import propagate_nonfinite
from qcollect._config import check_floating_input
from qcollect.coding import _huffman as hf
from qcollect.compressors._random import hash_bits

__all__ = ["MAX_BITS", "ROUND_TOL", "entropy_bits", "extremes", "flat_values", "quantize",
           "real_count", "sample_indices"]

#: Tolerance subtracted before rounding ``H + c`` up, so an entropy that is an
#: integer up to float32 error (e.g. a uniform histogram) is not bumped a bit.
ROUND_TOL = 1e-4
#: The longest code (and widest bin index) the codec handles.
MAX_BITS = hf.MAX_CODE_LENGTH


def flat_values(x: jax.Array) -> jax.Array:
    """``x`` flattened to float32, checked (floating, few enough values)."""
    x = jnp.asarray(x)
    check_floating_input(x)
    if x.size * MAX_BITS >= 2**32:
        raise ValueError(f"x has {x.size} values; entropy() encodes at most {2**32 // 15}")
    return x.reshape(-1).astype(jnp.float32)


def real_count(valid: jax.Array | None) -> jax.Array | None:
    """The real count of a ``valid`` array of one group (None: all real)."""
    if valid is None:
        return None
    valid = jnp.asarray(valid, jnp.int32).reshape(-1)
    if valid.shape != (1,):
        raise ValueError(f"entropy() codes an array as one group: valid must hold one "
                         f"count, got shape {valid.shape}")
    return valid[0]


def extremes(flat: jax.Array,
             real: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``w_min, w_max`` of the real values (the first ``real``; 0, 0 if none)."""
    if flat.shape[0] == 0:
        return jnp.float32(0.0), jnp.float32(0.0)
    # NaN and Inf reach the range however the min and max reduce
    # (_backend.MAX_DROPS_NAN).
    if real is None:
        return (propagate_nonfinite(jnp.min(flat), flat, axis=0),
                propagate_nonfinite(jnp.max(flat), flat, axis=0))
    inside = jnp.arange(flat.shape[0]) < real
    real_values = jnp.where(inside, flat, 0.0)
    w_min = propagate_nonfinite(jnp.min(jnp.where(inside, flat, jnp.inf)), real_values, axis=0)
    w_max = propagate_nonfinite(jnp.max(jnp.where(inside, flat, -jnp.inf)), real_values, axis=0)
    none = real <= 0
    return jnp.where(none, 0.0, w_min), jnp.where(none, 0.0, w_max)


def quantize(values: jax.Array, w_min: jax.Array, w_max: jax.Array,
             bits: jax.Array | int) -> jax.Array:
    """Algorithm 1, QUANTIZE (with ``w - w_min``): uint32 bin indices."""
    levels = jnp.left_shift(jnp.uint32(1), jnp.asarray(bits, jnp.uint32))
    # Halves: w_max - w_min can overflow float32 while its half cannot; the
    # halving is exact, so t is the same as from the full span.
    half = 0.5 * w_max - 0.5 * w_min
    scale = jnp.where(half > 0, levels.astype(jnp.float32) / half, 0.0)
    t = (0.5 * values - 0.5 * w_min) * scale
    t = jnp.where(t > 0, t, 0.0)  # also maps NaN to bin 0; the range carries the NaN
    return jnp.minimum(jnp.floor(t).astype(jnp.uint32), levels - 1)


def sample_indices(key: jax.Array | None, n: int, fraction: float,
                   real: jax.Array | None = None) -> jax.Array:
    """Indices of the entropy sample: ``ceil(F n)`` uniform draws with
    replacement, from the first ``real`` values when given (traced)."""
    m = min(n, math.ceil(fraction * n))
    if fraction >= 1.0 or m == 0:
        index = jnp.arange(n, dtype=jnp.uint32)
        return index if real is None else index % jnp.maximum(real, 1).astype(jnp.uint32)
    bound = jnp.uint32(n) if real is None else jnp.maximum(real, 1).astype(jnp.uint32)
    return hash_bits(key, (m,)) % bound


def entropy_bits(codes: jax.Array, bins: int) -> jax.Array:
    """Entropy in bits of the histogram of ``codes`` over ``bins`` bins."""
    count = jnp.bincount(codes, length=bins).astype(jnp.float32)
    p = count / jnp.maximum(jnp.sum(count), 1.0)
    return -jnp.sum(p * jnp.log2(jnp.where(count > 0, p, 1.0)))
