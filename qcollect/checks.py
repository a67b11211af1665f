"""Validation of static settings, shared by the compressors and the transforms.

Each check returns the setting in its canonical Python type (``np.int64(4)``
gives ``4``) or raises a ValueError that names the argument and its allowed
range, so that every factory reports a bad setting the same way.

Example:
  >>> import numpy as np
  >>> from qcollect.checks import check_choice, check_float, check_int, check_key
  >>> check_int("bits", np.int64(4), low=1, high=8)
  4
  >>> check_float("tau", 0.5, high=1.0)
  0.5
  >>> check_choice("norm", "max", ("max", "l2"))
  'max'
  >>> check_int("bits", 0, low=1, high=8)
  Traceback (most recent call last):
  ...
  ValueError: bits must be an integer in [1, 8], got 0
  >>> check_key("key", 0)
  Traceback (most recent call last):
  ...
  ValueError: key must be one PRNG key, jax.random.key(seed) ... got 0
"""

from __future__ import annotations

import numbers

import jax
import numpy as np

__all__ = ["check_choice", "check_float", "check_int", "check_key"]


def check_choice(name: str, value, allowed):
    """The option of ``allowed`` that ``value`` names, as that option itself.

    Matching keeps kinds apart (``1`` is not ``True``, ``4.0`` is not ``4``)
    and returns the canonical option (``np.int64(4)`` gives ``4``), so the
    settings a compressor records compare and print alike however they were
    spelled.

    Raises:
      ValueError: ``value`` is none of ``allowed``; the message names ``name``
        and lists the options.
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
    """``value`` as an ``int`` in ``[low, high]`` (``high=None``: no upper bound).

    Any integral type passes (``int``, ``np.int64``); ``bool`` and floats do
    not. With ``allow_none``, None passes through.

    Raises:
      ValueError: ``value`` is not an integer in range; the message names
        ``name`` and the range.
    """
    if value is None and allow_none:
        return None
    bad = isinstance(value, bool) or not isinstance(value, numbers.Integral)
    if bad or value < low or (high is not None and value > high):
        upper = "inf" if high is None else str(high)
        raise ValueError(f"{name} must be an integer in [{low}, {upper}], got {value!r}")
    return int(value)


def check_float(name: str, value, *, low: float = 0.0, high: float | None = None,
                low_inclusive: bool = False, high_inclusive: bool = True, allow_none=False):
    """``value`` as a finite ``float`` above ``low`` and up to ``high``.

    The bounds are ``(low`` or ``[low`` (``low_inclusive``) and ``high]`` or
    ``high)`` (``high_inclusive=False``); ``high=None``: no upper bound. Any
    real type passes (``int``, ``float``, ``np.float32``); ``bool``, NaN and
    infinities do not. With ``allow_none``, None passes through.

    Raises:
      ValueError: ``value`` is not a finite number in range; the message
        names ``name`` and the range.
    """
    if value is None and allow_none:
        return None
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and bool(np.isfinite(float(value))))
    if ok:
        ok = value >= low if low_inclusive else value > low
        if high is not None:
            ok = ok and (value <= high if high_inclusive else value < high)
    if not ok:
        bracket = "[" if low_inclusive else "("
        upper = "inf)" if high is None else f"{high}{']' if high_inclusive else ')'}"
        raise ValueError(
            f"{name} must be a finite number in {bracket}{low}, {upper}, got {value!r}")
    return float(value)


def check_key(name: str, value):
    """``value`` if it is one PRNG key: a typed key array of shape ``()``
    (``jax.random.key(seed)``) or a legacy ``uint32`` key array
    (``jax.random.PRNGKey(seed)``, or its data as saved by ``np.savez``).

    Raises:
      ValueError: anything else (None, an int seed, a float array, a batch of
        keys); the message names ``name`` and what was passed.
    """
    dtype = getattr(value, "dtype", None)
    shape = tuple(getattr(value, "shape", None) or ())
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    if typed and shape == ():
        return value
    legacy = jax.eval_shape(jax.random.PRNGKey, 0).shape  # of the default implementation
    if not typed and dtype is not None and np.dtype(dtype) == np.uint32 and shape == legacy:
        return value
    got = f"an array of {dtype} and shape {shape}" if dtype is not None else repr(value)
    raise ValueError(f"{name} must be one PRNG key, jax.random.key(seed) (or a legacy uint32 "
                     f"key of shape {legacy}, jax.random.PRNGKey(seed)), got {got}")
