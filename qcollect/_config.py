"""Validation of static compressor settings and encoder inputs.

The setting checks are `qcollect.checks`'s (one definition, re-exported here
for the compressors); this module adds the checks of what ``encode`` receives.
"""

from __future__ import annotations

import jax.numpy as jnp

from qcollect.checks import check_choice, check_float, check_int

__all__ = ["check_choice", "check_float", "check_floating_input", "check_int", "require_key"]


def check_floating_input(x) -> None:
    """Encoders take floating-point arrays only (float16, bfloat16, float32, float64)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating-point array, got dtype {x.dtype}")


def require_key(key, compressor: str):
    if key is None:
        raise ValueError(
            f"{compressor} is stochastic: encode(x, key) needs a PRNG key, got key=None")
    return key
