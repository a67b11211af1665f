"""Power-of-two scaling that keeps float32 products finite.

Sums take a static power-of-two scale set by their length (the group
statistics' ``overflow_safe_scale``); products (PCA projections, PowerSGD's
factors) cannot: a product of two values near ``2**100`` overflows whatever
the length. They take a data-dependent power of
two ``2**e`` instead, chosen from the operands' binary exponents so that every
partial sum stays below ``2**OVERFLOW_EXPONENT`` (a quarter of the float32
maximum). Scaling by a power of two is exact (barring underflow), so the
result scaled back is the product's, up to rounding.

The scaled computation runs only where the plain one overflowed
(`unless_overflow`), so every other result is the plain one, bit for bit,
for the cost of one finiteness check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qcollect.varying import varying_like

OVERFLOW_EXPONENT = 126
_F32_MAX = float(np.finfo(np.float32).max)


def binary_exponent(a: jax.Array) -> jax.Array:
    """int32 ``E`` with ``|a| < 2**E`` for finite ``a``, read from the float32 bits.

    ``E`` is frexp's exponent for normal numbers and -126 for zero and
    subnormals. Non-finite ``a`` gives 0, so a scale computed from it is 1
    and inf and NaN pass through unscaled.
    """
    bits = jax.lax.bitcast_convert_type(jnp.asarray(a, jnp.float32), jnp.int32)
    biased = (bits >> 23) & 0xFF
    return jnp.where(biased == 0xFF, 0, biased - 126)


def exact_pow2(e: jax.Array) -> jax.Array:
    """float32 ``2**e`` built from its bits, exact for int32 ``e`` in [-126, 127]."""
    e = jnp.asarray(e, jnp.int32)
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def downscale_exponent(bound: jax.Array) -> jax.Array:
    """``e`` in [-126, 0] that brings a result below ``2**bound`` under
    ``2**OVERFLOW_EXPONENT``: 0 when it already is."""
    return jnp.clip(OVERFLOW_EXPONENT - bound, -126, 0)


def rescale(x: jax.Array, e: jax.Array) -> jax.Array:
    """``x * 2**e``, exact barring underflow."""
    return x * exact_pow2(e)


def unscale(scaled: jax.Array, *exponents: jax.Array) -> jax.Array:
    """Undoes `rescale` by each ``e``, saturating at the float32 maximum.

    A result that only the unscaling pushes past the float32 range (its true
    value is not representable) becomes ``+-F32_MAX``, as the float16 cast
    saturates; a non-finite ``scaled`` (from non-finite input) stays as it is.
    """
    out = scaled
    for e in exponents:
        out = out * exact_pow2(-e)
    return jnp.where(jnp.isfinite(scaled), jnp.clip(out, -_F32_MAX, _F32_MAX), out)


def unless_overflow(plain: Any, rescaled: Callable[..., Any], *operands: Any,
                    overflowed: jax.Array | None = None) -> Any:
    """``plain`` (an array or a pytree of them), or ``rescaled(*operands)`` where
    it overflowed.

    A float32 sum that overflows never comes back to finite, so by default
    ``overflowed`` is "``plain`` has a non-finite entry"; a caller whose
    overflow shows otherwise (or more cheaply) passes its own test. Only then
    does `lax.cond` run ``rescaled`` (a power-of-two scaled computation;
    non-finite input takes it too and stays non-finite). Under `jax.vmap` the
    cond becomes a select and both run. ``rescaled`` must take every traced
    array it reads as an operand (none from a closure): they are cast to vary
    as ``plain`` does (`varying_like`).
    """
    if overflowed is None:
        overflowed = jnp.logical_not(jnp.all(jnp.stack(
            [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(plain)])))
    operands = varying_like(operands, plain)
    return jax.lax.cond(overflowed, lambda plain, ops: rescaled(*ops),
                        lambda plain, ops: plain, plain, operands)


def max_exponent(a: jax.Array) -> jax.Array:
    """``E`` with ``max |a| < 2**E`` (`binary_exponent`)."""
    return binary_exponent(jnp.max(jnp.abs(a)))


def bit_length(n: int) -> int:
    """``b`` with ``n < 2**b``: a sum of ``n`` terms below ``2**a`` stays below
    ``2**(a + b)``."""
    return int(n).bit_length()
