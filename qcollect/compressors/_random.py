"""A cheap counter-based uniform generator for stochastic rounding.

`jax.random.uniform` (threefry) costs many elementwise passes per element,
which would make stochastic rounding the bottleneck of a quantizer (measured
in docs/compressors.md#stochastic-rounding). Here the JAX key is expanded (one
tiny threefry call) into two 32-bit words ``(s0, s1)``; element ``i`` gets
``mix(i * (s1 | 1) + s0)`` where ``mix`` is the "lowbias32" integer finaliser
(two multiplies, three xor-shifts, full avalanche). The affine pre-step is a
bijection of the counter, and an odd multiplier taken from the key keeps
streams of different keys from being shifts of one another. The top 24 bits
become a float in [0, 1) on a grid of 2**-24, so
``P(u < p) = ceil(p * 2**24) / 2**24``: stochastic rounding with it is
unbiased up to 2**-24 of one quantization level, far below float32 rounding
of the scale. Counters wrap beyond 2**32 elements per call.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def _mix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def hash_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 words, one per element of ``shape``, from ``key``."""
    seeds = jax.random.bits(key, (2,), jnp.uint32)
    counter = lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
    return _mix32(counter * (seeds[1] | jnp.uint32(1)) + seeds[0])


def hash_uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 uniforms in [0, 1) on a 2**-24 grid, one per element of ``shape``."""
    return (hash_bits(key, shape) >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
