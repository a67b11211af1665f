"""Strom's threshold quantization with sparse words or Golomb-Rice coded indices.

Dryden et al., "Communication Quantization for Data-parallel Training of Deep
Neural Networks", section 3.2 (after Strom, "Scalable distributed DNN training
using commodity GPU cloud computing").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from qcollect._config import check_floating_input
from qcollect._payload import Compressor, Payload, check_format
from qcollect.checks import check_float
from qcollect.coding._golomb import Coding, check_coding, decode_entries, encode_entries
from qcollect.coding._sparse import (
    check_capacity,
    check_size,
    compact_largest,
    header,
    header_count,
    magnitude_keys,
    resolve_capacity,
    scatter_decode,
)

__all__ = ["ThresholdCompressor", "threshold"]


@dataclasses.dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class ThresholdCompressor(Compressor):
    """What `threshold` returns: a `Compressor` whose settings are typed fields.

    Attributes:
      tau: the threshold.
      capacity: slots per payload, a count (int) or a fraction of the size.
      coding: ``"words"`` or ``"golomb_rice"``.
      rice_k: the Rice parameter, None for the automatic one.
    """

    tau: float
    capacity: int | float
    coding: Coding
    rice_k: int | None

    setting_names: ClassVar[tuple[str, ...]] = ("tau", "capacity", "coding", "rice_k")


def threshold(tau: float, *, capacity: int | float = 1 / 32, coding: Coding = "words",
              rice_k: int | None = None) -> ThresholdCompressor:
    """Threshold quantization: entries with ``|v| > tau`` travel as ``+-tau``.

    Values ``v > tau`` are sent with sign bit 1 and decode to ``+tau``,
    values ``v < -tau`` with sign bit 0 and decode to ``-tau``; the others are
    not sent and decode to 0 (Dryden section 3.2). Error feedback, which the
    paper relies on, lives in the optax layer. ``tau`` is static and known to
    both sides, so no reconstruction value travels.

    Static capacity (a deviation the static shapes force: the paper's message
    length is data-dependent): at most ``capacity`` entries are sent. When
    more entries exceed ``tau``, those of largest ``|v|`` are sent (ties: lower
    index first) and the rest decode to 0; with error feedback they stay in
    the residual. Selecting them costs a 31-pass bisection over the array,
    paid only when the capacity overflows.

    Wire formats (``n`` = ``x.size``, ``c`` = capacity in entries):
      * ``coding="words"``: one uint32 per slot, sign bit 31 and the 31-bit
        flat index (the paper's format), ``0xFFFFFFFF`` in empty slots, plus
        one uint32 header (sent count, non-finite flag). Payload:
        ``4 * c + 4`` bytes.
      * ``coding="golomb_rice"``: the sorted-index gaps Rice-coded with
        parameter ``k`` (Strom's suggestion, section 3.2; layout in
        docs/compressors.md#golomb-rice-coded-indices), the signs as
        ``ceil(c / 32)`` packed words and the header. The stream is sized
        for the worst case, ``c * (k + 1) + (n - c) >> k`` bits, so it never
        overflows and the round trip is exact. Payload:
        ``4 * (ceil(c*k/32) + ceil((c + (n - c) >> k)/32) + ceil(c/32) + 1)``
        bytes: 7.94 bits per slot at ``c = n / 32`` (``k = 4``), against 32
        for words.

    Non-finite input: a NaN never passes ``|v| > tau``, so the header carries
    a flag set when the input holds NaN or Inf, and decode then returns all
    NaN.

    Args:
      tau: threshold, a finite float > 0.
      capacity: slots per payload, an int ``>= 0`` (clipped to ``x.size``)
        or a float in (0, 1], a fraction of ``x.size`` rounded up. Default
        1/32, the data volume the paper's benchmark tunes ``tau`` for
        (section 4.2, ``tau = 3.875`` "chosen to leave 1/32 of the data").
      coding: ``"words"`` or ``"golomb_rice"``.
      rice_k: Rice parameter 0..30 for ``"golomb_rice"``; None picks the one
        minimising the worst-case stream size (about ``log2(ln 2 * n / c)``).

    Returns:
      A deterministic, non-linear `ThresholdCompressor`. Arrays of more than
      ``2**31 - 1`` entries raise ValueError (31 index bits).

    Raises:
      ValueError: a setting outside the values above.

    References:
      Strom, `Scalable distributed DNN training using commodity GPU cloud
      computing <https://doi.org/10.21437/Interspeech.2015-354>`_,
      INTERSPEECH 2015; Dryden et al., MLHPC 2016, section 3.2
      <https://doi.org/10.1109/MLHPC.2016.004>; Rice and Plaunt (1971).

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> c = qc.threshold(1.0, capacity=2)
      >>> c.decode(c.encode(jnp.array([0.5, -3.0, 2.0, 1.5])))
      Array([ 0., -1.,  1.,  0.], dtype=float32)
    """
    tau = check_float("tau", tau, low=0.0)
    capacity = check_capacity(capacity)
    rice_k = check_coding(coding, rice_k)
    name = f"threshold/{tau!r}/cap{capacity!r}/{coding}"
    name += "" if coding == "words" else f"/k{'auto' if rice_k is None else rice_k}"

    static: dict[str, Any] = {"name": name, "tau": tau, "capacity": capacity, "coding": coding,
              "rice_k": rice_k}
    return ThresholdCompressor(
        name, functools.partial(_encode, **static), functools.partial(_decode, **static),
        linear=False, stochastic=False, tau=tau, capacity=capacity, coding=coding,
        rice_k=rice_k)


def _encode(x: jax.Array, key: jax.Array | None = None, *, name: str, tau: float,
            capacity: int | float, coding: Coding, rice_k: int | None) -> Payload:
    """The entries with ``|v| > tau`` (the largest ``capacity`` of them)."""
    x = jnp.asarray(x)
    check_floating_input(x)
    check_size(x.size)
    cap = resolve_capacity(capacity, x.size)
    flat = jnp.ravel(x).astype(jnp.float32)
    idx, count = compact_largest(
        lambda: jnp.where(jnp.abs(flat) > tau, magnitude_keys(flat), 0), x.size, cap)
    positive = jnp.take(flat, idx, mode="clip") > 0 if cap else jnp.zeros((0,), bool)
    arrays = encode_entries(coding, idx, count, positive, x.size, rice_k)
    arrays["header"] = header(count, flat)
    return Payload(arrays, tuple(x.shape), x.dtype, name)


def _decode(payload: Payload, *, name: str, tau: float, capacity: int | float,
            coding: Coding, rice_k: int | None) -> jax.Array:
    """``+-tau`` at the sent entries, 0 elsewhere (all NaN for non-finite input)."""
    check_format(payload, name)
    size = math.prod(payload.shape)
    cap = resolve_capacity(capacity, size)
    count = header_count(payload["header"])
    idx, positive = decode_entries(coding, payload.arrays, count, size, cap, rice_k)
    values = jnp.where(positive, jnp.float32(tau), jnp.float32(-tau))
    flat = scatter_decode(payload["header"], size, idx, values)
    return flat.reshape(payload.shape).astype(payload.dtype)
