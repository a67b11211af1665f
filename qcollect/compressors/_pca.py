"""GradiVeQ: a PCA linear compressor that commutes with summation.

Yu et al., "GradiVeQ: Vector Quantization for Bandwidth-Efficient Gradient
Aggregation in Distributed CNN Training" (NeurIPS 2018), sections 2 and 3.

Each array is flattened row-major and cut into slices of ``K`` adjacent
values. A slice ``g`` is sent as the ``d`` coefficients
``g' = U_d^T (g - mu / N)`` (eq. 3); the sum of the ``N`` workers' coefficients
is ``U_d^T (sum g - mu)`` (eq. 4), and one decode ``U_d g' + mu`` (eq. 5)
yields the aggregated slice. `pca_fit` computes ``U_d`` and ``mu`` from
``L_t`` sampled slices (section 3, eq. 6); `pca` is the compressor.

Flattening order (Fig. 3a): the paper places the ``F`` collocated gradients
of the ``F`` filters next to each other, then traverses depth, width and
height. A Flax convolution kernel has shape ``(H, W, D, F)`` (HWIO), so its
row-major flattening already puts ``F`` innermost, then ``D``, ``W``, ``H``:
pass Flax kernels as they are. (A PyTorch ``(F, D, H, W)`` kernel must first be
transposed to ``(H, W, D, F)``.) Pick ``K`` a multiple of ``F * D``
(section 3, "Slice size K"; Fig. 5), e.g. ``3 * F * D`` for a 3x3 kernel. A
dense kernel ``(in, out)`` likewise puts the ``out`` units innermost.

Planning d: the eq. 6 rank depends on the data. Two ways to live with it:

* host planning (``max_rank=None``): call `pca_fit` outside `jax.jit` on
  concrete samples; ``rank`` is a Python int and ``basis`` has exactly
  ``d`` columns. Build `pca` from it and compile the step for that ``d``
  (one compiled step per plan, reused for the ``L_c`` compressed
  iterations). Under a trace this path raises ValueError.
* capped (``max_rank=r``): works under `jax.jit`. ``basis`` always has ``r``
  columns; columns ``d..r-1`` are zero, so their coefficients are zero on
  the wire and decode exactly as the eq. 6 truncation. The wire carries
  ``r`` coefficients per slice. When ``d > r`` nothing is zeroed and the
  loss exceeds ``loss_threshold`` (``rank`` still reports ``d``; error
  feedback keeps what is lost).

Linearity: decode is ``U_d g' + (w / N) mu`` per slice with ``w`` the
summed weight. Summing the payloads of the ``N`` workers gives ``w = N``
and decodes to ``U_d U_d^T (sum g - mu) + mu`` (eq. 4, 5); decoding one
worker's payload gives its share ``U_d g'_n + mu / N``, the local
reconstruction of eq. (7). So decode(sum of payloads) equals the sum of
decodes for any subset of workers, as the ring of Algorithm 1 and error
feedback need. (Deviation: the paper sends no weight; without it the
affine eq. 5 decode would not be linear in the payload. It costs 4 bytes
per array.)
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
from qcollect.checks import check_int
from qcollect.compressors._scaling import (
    binary_exponent,
    bit_length,
    downscale_exponent,
    max_exponent,
    rescale,
    unless_overflow,
    unscale,
)

__all__ = ["PCACompressor", "pca"]

_HIGHEST = jax.lax.Precision.HIGHEST


def _scaled_project(view: jax.Array, u: jax.Array, mu: jax.Array | None,
                    num_workers: int) -> jax.Array:
    """``(view - mu / N) @ u`` with slices that could overflow scaled down first.

    Per slice, ``|coeff| <= 2 max(|g|, |mu|) K max|U|``: where that could
    pass ``2**OVERFLOW_EXPONENT`` the slice is scaled by a power of two.
    """
    top = jnp.max(jnp.abs(view), axis=1)
    if mu is not None:
        top = jnp.maximum(top, jnp.max(jnp.abs(mu)))
    e = downscale_exponent(binary_exponent(top) + 1 + max_exponent(u)
                           + bit_length(view.shape[1]))[:, None]
    view = rescale(view, e)
    if mu is not None:
        view = view - rescale(mu * (1.0 / num_workers), e)
    return unscale(jnp.matmul(view, u, precision=_HIGHEST), e)


def _reconstruct_exponents(coeffs: jax.Array, weight: jax.Array | None, u: jax.Array,
                           mu: jax.Array | None, num_workers: int) -> jax.Array:
    """Per slice, the power of two that keeps ``coeffs @ u^T + w mu / N`` below
    ``2**OVERFLOW_EXPONENT`` (0 for most): ``|U g'| <= d max|g'| max|U|``,
    plus ``|w mu / N|``."""
    bound = (binary_exponent(jnp.max(jnp.abs(coeffs), axis=1)) + max_exponent(u)
             + bit_length(u.shape[1]))
    if mu is not None:
        assert weight is not None, "a payload encoded with a mean carries its weight"
        weight = weight * (1.0 / num_workers)
        bound = jnp.maximum(bound, binary_exponent(jnp.abs(weight)) + max_exponent(mu)) + 1
    return downscale_exponent(bound)[:, None]


def _scaled_reconstruct(coeffs: jax.Array, weight: jax.Array | None, u: jax.Array,
                        mu: jax.Array | None, num_workers: int) -> jax.Array:
    """``coeffs @ u^T + w mu / N`` with slices that could overflow scaled down
    first (`_reconstruct_exponents`)."""
    e = _reconstruct_exponents(coeffs, weight, u, mu, num_workers)
    view = jnp.matmul(rescale(coeffs, e), u.T, precision=_HIGHEST)
    if mu is not None:
        assert weight is not None, "a payload encoded with a mean carries its weight"
        view = view + (weight * (1.0 / num_workers)) * rescale(mu, e)
    return unscale(view, e)


@dataclasses.dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class PCACompressor(Compressor):
    """What `pca` returns: a `Compressor` whose settings are typed fields.

    Attributes:
      basis: ``U_d``, the ``(K, d)`` array given to `pca` (compared by identity).
      mean: ``mu``, the ``(K,)`` array given to `pca`, or None.
      num_workers: ``N``, the number of payloads that are summed.
    """

    basis: Any
    mean: Any
    num_workers: int

    setting_names: ClassVar[tuple[str, ...]] = ("basis", "mean", "num_workers")


def pca(basis: jax.Array, mean: jax.Array | None = None, *,
        num_workers: int) -> PCACompressor:
    """GradiVeQ's linear compressor over slices of ``K`` adjacent values.

    The array is flattened row-major (conv kernels: docs/compressors.md#gradiveq)
    and cut into ``floor(size / K)`` full slices; each slice ``g``
    is sent as ``g' = U_d^T (g - mu / N)`` (eq. 3), ``d`` float32 words.
    Payload arrays:

    * ``coeffs``: float32 ``(num_slices, d)``.
    * ``tail``: the last ``size mod K`` values that do not fill a slice, sent
      raw as float32 (lossless; absent when ``K`` divides the size). An array
      shorter than ``K`` is all tail and is not compressed.
    * ``weight``: one float32 ``1.0`` (only when ``mean`` is given), so that
      the decode of summed payloads adds ``mu`` once (the decode is then
      linear in the payload).

    Payload size: ``4 * (num_slices * d + size mod K + [mean given])`` bytes,
    so the wire shrinks by about ``K / d`` (eq. 3, ``r = K / d``).

    ``basis`` and ``mean`` are captured by the compressor, not sent: every
    worker holds the same ones (they come from `pca_fit` on the aggregated
    samples, which all workers see). They may be traced arrays, e.g. read
    from optimizer state inside a jitted step; only their shapes are static.
    Non-finite values in a slice make its coefficients, and so the whole
    decoded slice, non-finite.

    Args:
      basis: ``U_d``, ``(K, d)`` with ``1 <= d <= K``, orthonormal columns
        (zero columns are allowed: they send zeros).
      mean: ``mu``, ``(K,)``, or None for no whitening (no weight is sent).
      num_workers: ``N >= 1``, the number of payloads that are summed: the
        devices of the axis, or for a hierarchical ``(outer, inner)``
        `compressed_all_reduce` the nodes along ``outer`` (each node's sum
        is encoded once), so that the ``N`` subtracted ``mu / N`` make
        ``mu``.

    Returns:
      A `PCACompressor` with ``linear=True`` and ``stochastic=False``. Its
      settings ``basis``, ``mean`` and ``num_workers`` read as attributes;
      ``basis`` and ``mean`` compare by identity (see `Compressor`): two
      compressors are equal when they hold the same array objects, and a
      refitted basis makes a new compressor even if its values repeat.

    Raises:
      ValueError: ``num_workers`` below 1, or ``basis`` or ``mean`` of
        another shape than above.

    References:
      Yu et al., `GradiVeQ: Vector Quantization for Bandwidth-Efficient
      Gradient Aggregation in Distributed CNN Training
      <https://arxiv.org/abs/1811.03617>`_, NeurIPS 2018, section 2,
      eq. (1) and (3)-(5), Fig. 3, Algorithm 1.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> c = qc.pca(jnp.eye(4)[:, :2], jnp.zeros(4), num_workers=2)
      >>> p = c.encode(jnp.arange(10.0))
      >>> p["coeffs"].shape, p["tail"].shape, qc.payload_bytes(p)
      ((2, 2), (2,), 28)
      >>> c.decode(p)
      Array([0., 1., 0., 0., 4., 5., 0., 0., 8., 9.], dtype=float32)
    """
    num_workers = check_int("num_workers", num_workers, low=1)
    if getattr(basis, "ndim", None) != 2 or basis.shape[0] < 1 or not (
            1 <= basis.shape[1] <= basis.shape[0]):
        raise ValueError("basis must be a (K, d) array with 1 <= d <= K, got shape "
                         f"{getattr(basis, 'shape', None)}")
    slice_size, dim = int(basis.shape[0]), int(basis.shape[1])
    if mean is not None and tuple(getattr(mean, "shape", ())) != (slice_size,):
        raise ValueError(f"mean must have shape ({slice_size},) to match basis, "
                         f"got {getattr(mean, 'shape', None)}")
    u = jnp.asarray(basis, jnp.float32)
    mu = None if mean is None else jnp.asarray(mean, jnp.float32)
    name = f"pca/K{slice_size}/d{dim}" + ("" if mu is None else f"/N{num_workers}")
    static = {"name": name, "u": u, "mu": mu, "num_workers": num_workers}
    return PCACompressor(name, functools.partial(_encode, **static),
                         functools.partial(_decode, **static), linear=True, stochastic=False,
                         block=slice_size, grouping="bucket", basis=basis, mean=mean,
                         num_workers=num_workers)


def _project(view: jax.Array, u: jax.Array, mu: jax.Array | None,
             num_workers: int) -> jax.Array:
    """``(view - mu / N) @ u``: eq. (3) for every slice (row) of ``view``."""
    if mu is not None:
        view = view - mu * (1.0 / num_workers)
    return jnp.matmul(view, u, precision=_HIGHEST)


def _reconstruct(coeffs: jax.Array, weight: jax.Array | None, u: jax.Array,
                 mu: jax.Array | None, num_workers: int) -> jax.Array:
    """``coeffs @ u^T + w mu / N``: eq. (5) for every slice."""
    view = jnp.matmul(coeffs, u.T, precision=_HIGHEST)
    if mu is not None:
        assert weight is not None, "a payload encoded with a mean carries its weight"
        view = view + (weight * (1.0 / num_workers)) * mu
    return view


def _encode(x: jax.Array, key: jax.Array | None = None, *, name: str, u: jax.Array,
            mu: jax.Array | None, num_workers: int) -> Payload:
    """The coefficients of the full slices, the raw tail and the weight."""
    x = jnp.asarray(x)
    check_floating_input(x)
    slice_size = u.shape[0]
    flat = jnp.ravel(x).astype(jnp.float32)
    full = flat.shape[0] // slice_size
    arrays = {}
    if full:
        view = flat[: full * slice_size].reshape(full, slice_size)
        rescaled = functools.partial(_scaled_project, num_workers=num_workers)
        arrays["coeffs"] = unless_overflow(_project(view, u, mu, num_workers), rescaled,
                                           view, u, mu)
    if flat.shape[0] > full * slice_size:
        arrays["tail"] = flat[full * slice_size:]
    if mu is not None:
        arrays["weight"] = jnp.ones((), jnp.float32)
    return Payload(arrays, tuple(x.shape), x.dtype, name)


def _decode(payload: Payload, *, name: str, u: jax.Array, mu: jax.Array | None,
            num_workers: int) -> jax.Array:
    """The reconstructed slices followed by the raw tail."""
    check_format(payload, name)
    slice_size = u.shape[0]
    size = math.prod(payload.shape)
    full = size // slice_size
    parts = []
    if full:
        coeffs, weight = payload["coeffs"], payload.arrays.get("weight")
        # Checked on the bound from the (small) coefficients, not on the
        # full-size result.
        operands = (coeffs, weight, u, mu)
        overflowed = jnp.any(_reconstruct_exponents(*operands, num_workers) != 0)
        rescaled = functools.partial(_scaled_reconstruct, num_workers=num_workers)
        view = unless_overflow(_reconstruct(*operands, num_workers), rescaled, *operands,
                               overflowed=overflowed)
        parts.append(view.reshape(-1))
    if size > full * slice_size:
        parts.append(payload["tail"])
    flat = jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.float32)
    return flat.reshape(payload.shape).astype(payload.dtype)
