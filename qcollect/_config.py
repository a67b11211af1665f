"""Validation of static compressor settings: every error names its argument."""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np


def check_choice(name: str, value, allowed):
    """The option of ``allowed`` that ``value`` names, as that option itself.

    Matching keeps kinds apart (``1`` is not ``True``, ``4.0`` is not ``4``)
    and returns the canonical option (``np.int64(4)`` gives ``4``), so the
    settings a compressor records compare and print alike however they were
    spelled.
    """
    for option in allowed:
        if _same_choice(value, option):
            return option
    raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def _same_choice(value, option) -> bool:
    if isinstance(option, bool) or isinstance(value, (bool, np.bool_)):
        return (isinstance(option, bool) and isinstance(value, (bool, np.bool_))
                and bool(value) is option)
    if isinstance(option, numbers.Integral):
        return isinstance(value, numbers.Integral) and int(value) == option
    if isinstance(option, str):
        return isinstance(value, str) and value == option
    return type(value) is type(option) and value == option


def check_int(name: str, value, *, low: int = 1, high: int | None = None, allow_none=False):
    if value is None and allow_none:
        return None
    bad = isinstance(value, bool) or not isinstance(value, numbers.Integral)
    if bad or value < low or (high is not None and value > high):
        upper = "inf" if high is None else str(high)
        raise ValueError(f"{name} must be an integer in [{low}, {upper}], got {value!r}")
    return int(value)


def check_float(name: str, value, *, low: float = 0.0, high: float | None = None,
                low_inclusive: bool = False):
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and np.isfinite(value)
    if ok:
        ok = value >= low if low_inclusive else value > low
        ok = ok and (high is None or value <= high)
    if not ok:
        bracket = "[" if low_inclusive else "("
        upper = "inf)" if high is None else f"{high}]"
        raise ValueError(
            f"{name} must be a finite number in {bracket}{low}, {upper}, got {value!r}")
    return float(value)


def check_floating_input(x) -> None:
    """Encoders take floating-point arrays only (float16, bfloat16, float32, float64)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating-point array, got dtype {x.dtype}")


def require_key(key, compressor: str):
    if key is None:
        raise ValueError(
            f"{compressor} is stochastic: encode(x, key) needs a PRNG key, got key=None")
    return key
