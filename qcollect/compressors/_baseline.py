"""Baselines: send the array as it is, or cast to a 16-bit float."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

from qcollect._config import check_floating_input
from qcollect._payload import Compressor, Payload, check_format
from qcollect.checks import check_choice

__all__ = ["CastCompressor", "identity", "cast"]

CAST_DTYPES = ("bfloat16", "float16")
#: The wire dtypes of `cast`, by name.
CastDtype = Literal["bfloat16", "float16"]


@dataclasses.dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class CastCompressor(Compressor):
    """What `cast` returns: a `Compressor` whose setting is a typed field.

    Attributes:
      dtype: the wire dtype's name, ``"bfloat16"`` or ``"float16"``.
    """

    dtype: CastDtype

    setting_names: ClassVar[tuple[str, ...]] = ("dtype",)


def identity() -> Compressor:
    """The uncompressed baseline: the payload is the array itself.

    Linear (payloads sum exactly as the arrays do), deterministic, any dtype.
    It is the reference every compressor is measured against, and
    `compressed_all_reduce` with it equals ``lax.psum``.

    Returns:
      A linear, deterministic `Compressor` whose wire format is ``identity``
      (``n * itemsize`` bytes for ``n`` values).

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> c = qc.identity()
      >>> qc.payload_bytes(c.encode(jnp.ones(10)))
      40
    """
    return Compressor("identity", _identity_encode, _identity_decode, linear=True,
                      stochastic=False)


def _identity_encode(x: jax.Array, key: jax.Array | None = None) -> Payload:
    x = jnp.asarray(x)
    return Payload({"x": x}, tuple(x.shape), x.dtype, "identity")


def _identity_decode(payload: Payload) -> jax.Array:
    check_format(payload, "identity")
    return payload["x"]


def cast(dtype: CastDtype | Any) -> CastCompressor:
    """Round to a 16-bit float on the wire; decode casts back.

    Halves the bytes of float32 gradients at the cost of one rounding (8
    significant bits for bfloat16, 11 for float16). Finite values beyond
    float16's range (65504) are saturated to it, not sent as inf; NaN and
    Inf pass as they are. The compressor is linear: payloads may be summed
    in the narrow dtype, with one rounding per addition.

    Args:
      dtype: ``"bfloat16"`` or ``"float16"``, or the matching jnp dtype.

    Returns:
      A linear, deterministic `CastCompressor` (``2 n`` bytes for ``n``
      values); its ``dtype`` setting is the name.

    Raises:
      ValueError: another dtype.

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


def _cast_encode(x: jax.Array, key: jax.Array | None = None, *, name: str,
                 wire_name: str) -> Payload:
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


def _cast_decode(payload: Payload, *, name: str) -> jax.Array:
    check_format(payload, name)
    return payload["x"].astype(payload.dtype)
