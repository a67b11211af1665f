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
from collections.abc import Sequence
from typing import Any, Literal, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_choice", "check_float", "check_floating_leaves", "check_int", "check_key"]

T = TypeVar("T")


def check_choice(name: str, value: object, allowed: Sequence[T]) -> T:
    """The option of ``allowed`` that ``value`` names, as that option itself.

    Matching keeps kinds apart (``1`` is not ``True``, ``4.0`` is not ``4``)
    and returns the canonical option (``np.int64(4)`` gives ``4``), so the
    settings a compressor records compare and print alike however they were
    spelled.

    Args:
      name: the argument's name, for the error message.
      value: what the caller passed.
      allowed: the options, in the order the message lists them.

    Returns:
      The option of ``allowed`` equal to ``value`` and of its kind.

    Raises:
      ValueError: ``value`` is none of ``allowed``; the message names ``name``
        and lists the options.

    Example:
      >>> import numpy as np
      >>> from qcollect.checks import check_choice
      >>> check_choice("bits", np.int64(4), (2, 4, 8))
      4
      >>> check_choice("flag", 1, (True, False))
      Traceback (most recent call last):
      ...
      ValueError: flag must be one of (True, False), got 1
    """
    for option in allowed:
        if _same_choice(value, option):
            return option
    raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def _same_choice(value: object, option: object) -> bool:
    if isinstance(option, bool) or isinstance(value, (bool, np.bool_)):
        return (isinstance(option, bool) and isinstance(value, (bool, np.bool_))
                and bool(value) is option)
    if isinstance(option, numbers.Integral):
        return isinstance(value, numbers.Integral) and int(value) == option
    if isinstance(option, str):
        return isinstance(value, str) and value == option
    return type(value) is type(option) and value == option


@overload
def check_int(name: str, value: object, *, low: int = 1, high: int | None = None,
              allow_none: Literal[False] = False) -> int: ...


@overload
def check_int(name: str, value: object, *, low: int = 1, high: int | None = None,
              allow_none: bool) -> int | None: ...


def check_int(name: str, value: object, *, low: int = 1, high: int | None = None,
              allow_none: bool = False) -> int | None:
    """``value`` as an ``int`` in ``[low, high]`` (``high=None``: no upper bound).

    Any integral type passes (``int``, ``np.int64``); ``bool`` and floats do
    not, so that ``True`` or ``4.0`` never stand for a count by accident.

    Args:
      name: the argument's name, for the error message.
      value: what the caller passed.
      low: the smallest allowed value.
      high: the largest allowed value, or None for no upper bound.
      allow_none: let None pass through (an optional setting).

    Returns:
      ``int(value)``, or None when ``value`` is None and ``allow_none``.

    Raises:
      ValueError: ``value`` is not an integer in range; the message names
        ``name`` and the range.

    Example:
      >>> import numpy as np
      >>> from qcollect.checks import check_int
      >>> check_int("bits", np.int64(4), low=1, high=8), check_int("k", None, allow_none=True)
      (4, None)
    """
    if value is None and allow_none:
        return None
    number = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)
    if number is None or number < low or (high is not None and number > high):
        upper = "inf" if high is None else str(high)
        raise ValueError(f"{name} must be an integer in [{low}, {upper}], got {value!r}")
    return number


@overload
def check_float(name: str, value: object, *, low: float = 0.0, high: float | None = None,
                low_inclusive: bool = False, high_inclusive: bool = True,
                allow_none: Literal[False] = False) -> float: ...


@overload
def check_float(name: str, value: object, *, low: float = 0.0, high: float | None = None,
                low_inclusive: bool = False, high_inclusive: bool = True,
                allow_none: bool) -> float | None: ...


def check_float(name: str, value: object, *, low: float = 0.0, high: float | None = None,
                low_inclusive: bool = False, high_inclusive: bool = True,
                allow_none: bool = False) -> float | None:
    """``value`` as a finite ``float`` above ``low`` and up to ``high``.

    The bounds are ``(low`` or ``[low`` (``low_inclusive``) and ``high]`` or
    ``high)`` (``high_inclusive=False``); ``high=None``: no upper bound. Any
    real type passes (``int``, ``float``, ``np.float32``); ``bool``, NaN and
    infinities do not, so a threshold or a fraction is always a finite number.

    Args:
      name: the argument's name, for the error message.
      value: what the caller passed.
      low: the lower bound, excluded unless ``low_inclusive``.
      high: the upper bound, included unless ``high_inclusive=False``; None
        for no upper bound.
      low_inclusive: whether ``low`` itself is allowed.
      high_inclusive: whether ``high`` itself is allowed.
      allow_none: let None pass through (an optional setting).

    Returns:
      ``float(value)``, or None when ``value`` is None and ``allow_none``.

    Raises:
      ValueError: ``value`` is not a finite number in range; the message
        names ``name`` and the range.

    Example:
      >>> from qcollect.checks import check_float
      >>> check_float("proportion", 64, low=1.0, low_inclusive=True)
      64.0
    """
    if value is None and allow_none:
        return None
    number = None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    ok = number is not None and bool(np.isfinite(number))
    if number is not None and ok:
        ok = number >= low if low_inclusive else number > low
        if high is not None:
            ok = ok and (number <= high if high_inclusive else number < high)
    if number is None or not ok:
        bracket = "[" if low_inclusive else "("
        upper = "inf)" if high is None else f"{high}{']' if high_inclusive else ')'}"
        raise ValueError(
            f"{name} must be a finite number in {bracket}{low}, {upper}, got {value!r}")
    return number


def check_key(name: str, value: Any) -> jax.Array:
    """``value`` if it is one PRNG key: a typed key array of shape ``()``
    (``jax.random.key(seed)``) or a legacy ``uint32`` key array
    (``jax.random.PRNGKey(seed)``, or its data as saved by ``np.savez``).

    A seed or a batch of keys where one key belongs would otherwise fail
    deep inside a traced step, with a message that does not name it.

    Args:
      name: the argument's name, for the error message.
      value: what the caller passed.

    Returns:
      ``value`` itself.

    Raises:
      ValueError: anything else (None, an int seed, a float array, a batch of
        keys); the message names ``name`` and what was passed.

    Example:
      >>> import jax
      >>> from qcollect.checks import check_key
      >>> check_key("key", jax.random.key(0)).shape
      ()
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


def check_floating_leaves(tree: Any, name: str) -> None:
    """Raises ValueError naming the first leaf of ``tree`` whose dtype is not
    floating point.

    An average of integers is not the average of the values (the mean of
    0, 1000 and 2000 over four devices rounds to 0, 250, 500), and no
    compressor has a scale for them, so gradients and the trees the
    collectives reduce must be float16, bfloat16, float32 or float64.

    Example:
      >>> import jax.numpy as jnp
      >>> check_floating_leaves({"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)}, "grads")
      Traceback (most recent call last):
      ...
      ValueError: grads['step'] has dtype int32: ... floating-point leaves ...
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{name}{jax.tree_util.keystr(path)} has dtype {dtype}: the all-reduce averages "
                "floating-point leaves only (an integer mean rounds away the values). Keep "
                "integer and boolean leaves out of the gradient tree, for example with "
                "optax.masked, or cast them to a floating dtype.")

