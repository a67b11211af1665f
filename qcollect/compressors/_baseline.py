"""Baselines: send the array as it is, or cast to a 16-bit float."""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from qcollect._config import check_choice, check_floating_input
from qcollect._payload import Compressor, Payload, check_format

__all__ = ["CastCompressor", "identity", "cast"]

CAST_DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class CastCompressor(Compressor):
    """What `cast` returns: a `Compressor` whose setting is a typed field.

    Attributes:
      dtype: the wire dtype's name, ``"bfloat16"`` or ``"float16"``.
    """

    dtype: str

    setting_names: ClassVar[tuple[str, ...]] = ("dtype",)


def identity() -> Compressor:
    """The uncompressed baseline: the payload is the array itself.

    Linear (payloads sum exactly as the arrays do), deterministic, any dtype.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> c = qc.identity()
      >>> qc.payload_bytes(c.encode(jnp.ones(10)))
      40
    """
    return Compressor("identity", _identity_encode, _identity_decode, linear=True,
                      stochastic=False)


def _identity_encode(x, key=None) -> Payload:
    x = jnp.asarray(x)
    return Payload({"x": x}, tuple(x.shape), x.dtype, "identity")


def _identity_decode(payload):
    check_format(payload, "identity")
    return payload["x"]


def cast(dtype) -> CastCompressor:
    """Round to a 16-bit float on the wire; decode casts back.

    Args:
      dtype: ``"bfloat16"`` or ``"float16"`` (or the jnp dtypes).

    float16 overflows to +/-inf above 65504: that is reported as non-finite
    output, never clipped. The compressor is linear: payloads may be summed in
    the narrow dtype, with one rounding per addition.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> qc.payload_bytes(qc.cast(jnp.bfloat16).encode(jnp.ones(10)))
      20
    """
    try:
        dtype_name = np.dtype(dtype).name
    except TypeError:
        dtype_name = str(dtype)
    check_choice("dtype", dtype_name, CAST_DTYPES)
    name = f"cast/{dtype_name}"
    return CastCompressor(name, functools.partial(_cast_encode, name=name, wire_name=dtype_name),
                          functools.partial(_cast_decode, name=name), linear=True,
                          stochastic=False, dtype=dtype_name)


def _cast_encode(x, key=None, *, name: str, wire_name: str) -> Payload:
    """``x`` rounded to the ``wire_name`` dtype, finite values saturated to its range."""
    wire = jnp.dtype(wire_name)
    x = jnp.asarray(x)
    check_floating_input(x)
    if jnp.finfo(wire).max < jnp.finfo(x.dtype).max:
        # Saturate finite values beyond the wire's range (float16 tops at
        # 65504) rather than send inf; NaN and Inf pass as they are.
        top = float(jnp.finfo(wire).max)
        x = jnp.where(jnp.isfinite(x), jnp.clip(x, -top, top), x)
    return Payload({"x": x.astype(wire)}, tuple(x.shape), x.dtype, name)


def _cast_decode(payload, *, name: str):
    check_format(payload, name)
    return payload["x"].astype(payload.dtype)
