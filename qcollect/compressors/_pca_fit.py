"""GradiVeQ's compressor fit: ``U_d`` and ``mu`` from sampled slices (eq. 6).

Yu et al., "GradiVeQ: Vector Quantization for Bandwidth-Efficient Gradient
Aggregation in Distributed CNN Training" (NeurIPS 2018), section 3: the
``L_t`` sampled ``K``-value slices are whitened by their mean ``mu`` and the
basis ``U_d`` is the top ``d`` eigenvectors of their covariance, ``d`` the
smallest rank whose explained energy reaches ``1 - lambda`` (eq. 6). The
compressor built from the fit is `qcollect.pca`; docs/compressors.md#gradiveq
describes host planning and capped ranks.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qcollect._config import check_floating_input
from qcollect.checks import check_choice, check_int
from qcollect.compressors._scaling import (
    OVERFLOW_EXPONENT,
    bit_length,
    max_exponent,
    rescale,
    unless_overflow,
)

__all__ = ["PCAFit", "pca_fit"]

#: Which slices of each sample `pca_fit` fits on.
Slices = Literal["first", "all"]

_HIGHEST = jax.lax.Precision.HIGHEST


class PCAFit(NamedTuple):
    """The result of `pca_fit`.

    Attributes:
      basis: ``U_d``, float32 ``(K, r)`` with orthonormal columns, most
        significant first; ``r`` is the static number of columns (``rank``,
        the eq. 6 rank, or ``max_rank``).
      mean: ``mu``, float32 ``(K,)``: the average of the sampled slices.
      rank: ``d`` from eq. (6) (or the requested ``rank``). A Python int on the
        host path, an int32 scalar under the capped path; it may exceed
        ``basis.shape[1]`` when the cap was too small.
      energy: float32 ``(K,)`` explained-energy curve,
        ``energy[k] = sum(s[:k+1]) / sum(s)`` over the covariance eigenvalues
        ``s`` in decreasing order (the left side of eq. 6 for ``d = k + 1``).
        All NaN when the samples do not vary (then ``d = 1``) or hold NaN
        (then ``mean`` is NaN too, so the compressor decodes NaN).
    """

    basis: jax.Array
    mean: jax.Array
    rank: Any
    energy: jax.Array


def _check_loss_threshold(value: Any) -> float:
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool)
    if not ok or not (0.0 <= float(value) < 1.0):
        raise ValueError(f"loss_threshold must be a number in [0, 1), got {value!r}")
    return float(value)


def _eq6_rank(energy: jax.Array, loss_threshold: float) -> jax.Array:
    """Smallest ``d`` with ``energy[d - 1] >= 1 - loss_threshold`` (eq. 6), in [1, K].

    All-zero samples (no energy, a NaN curve) give ``d = 1``.
    """
    short = jnp.sum((energy < 1.0 - loss_threshold).astype(jnp.int32))
    return jnp.clip(short + 1, 1, energy.shape[0])


def _sample_slices(samples: jax.Array, slice_size: int, slices: Slices) -> jax.Array:
    """``(num_samples, ...)`` samples -> float32 ``(rows, K)`` slice matrix."""
    flat = samples.reshape(samples.shape[0], -1).astype(jnp.float32)
    length = flat.shape[1]
    if slices == "first":
        return flat[:, :slice_size]
    full = length // slice_size
    return flat[:, : full * slice_size].reshape(-1, slice_size)


@functools.partial(jax.jit, static_argnames=("slice_size", "slices"))
def _spectrum(samples: jax.Array, slice_size: int,
              slices: Slices) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mean, eigenvectors (decreasing eigenvalue) and explained-energy curve.

    Squares of values above about ``1e19`` overflow float32 (the covariance
    of samples near the float32 maximum was inf and its eigenvectors NaN).
    The eigenvectors and the energy curve do not change when the samples are
    scaled, so samples that could push the covariance or its trace past
    ``2**OVERFLOW_EXPONENT`` are first scaled down by a power of two, undone
    exactly on the mean; the eigensolver scales its input itself (LAPACK's
    ``syevd``). Other samples keep the plain result (`unless_overflow`).
    """
    rows = _sample_slices(samples, slice_size, slices)
    # |centred| < 2**(E + 1); sums of R products (the covariance) and of K
    # eigenvalues (the trace) stay below 2**(2 (E + 1) + max(bits(R), bits(K))).
    spread = 2 + max(bit_length(rows.shape[0]), bit_length(slice_size))
    e = jnp.clip((OVERFLOW_EXPONENT - spread) // 2 - max_exponent(rows), -126, 0)

    def scaled(rows: jax.Array, e: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        mean, eigvecs, energy = _eig(rescale(rows, e))
        return rescale(mean, -e), eigvecs, energy

    return unless_overflow(_eig(rows), scaled, rows, e, overflowed=e != 0)


def _eig(rows: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    mean = jnp.mean(rows, axis=0)
    centred = rows - mean
    cov = jnp.matmul(centred.T, centred, precision=_HIGHEST) / rows.shape[0]
    eigvals, eigvecs = jnp.linalg.eigh(cov)
    eigvals = jnp.flip(jnp.maximum(eigvals, 0.0))
    energy = jnp.cumsum(eigvals) / jnp.sum(eigvals)
    return mean, jnp.flip(eigvecs, axis=1), energy


def _check_fit_settings(slice_size: int, loss_threshold: float | None, rank: int | None,
                        max_rank: int | None,
                        slices: Slices) -> tuple[int, float | None, int | None, int | None]:
    """`pca_fit`'s validated ``(slice_size, loss_threshold, rank, max_rank)``."""
    slice_size = check_int("slice_size", slice_size, low=1)
    check_choice("slices", slices, ("first", "all"))
    if (loss_threshold is None) == (rank is None):
        raise ValueError("exactly one of loss_threshold and rank must be given, got "
                         f"loss_threshold={loss_threshold!r}, rank={rank!r}")
    if rank is not None:
        rank = check_int("rank", rank, low=1, high=slice_size)
        if max_rank is not None:
            raise ValueError(f"max_rank applies to loss_threshold only, got max_rank={max_rank!r}")
    else:
        loss_threshold = _check_loss_threshold(loss_threshold)
        max_rank = check_int("max_rank", max_rank, low=1, high=slice_size, allow_none=True)
    return slice_size, loss_threshold, rank, max_rank


def _check_samples(samples: jax.Array, slice_size: int, host: bool) -> jax.Array:
    """``samples`` as an array of at least one sample of at least ``slice_size``
    values, concrete where the rank is planned on the host."""
    samples = jnp.asarray(samples)
    check_floating_input(samples)
    if samples.ndim < 1 or samples.shape[0] < 1:
        raise ValueError(f"samples must have shape (num_samples >= 1, ...), got {samples.shape}")
    if host and isinstance(samples, jax.core.Tracer):
        raise ValueError("loss_threshold without max_rank picks d on the host and needs "
                         "concrete samples; under jax.jit pass max_rank (a static cap)")
    length = math.prod(samples.shape[1:])
    if length < slice_size:
        raise ValueError(
            f"slice_size must be at most the sample length {length}, got {slice_size}")
    return samples


def pca_fit(samples: jax.Array, *, slice_size: int, loss_threshold: float | None = None,
            rank: int | None = None, max_rank: int | None = None,
            slices: Slices = "first") -> PCAFit:
    """Fits GradiVeQ's compressor ``U_d`` and whitening vector ``mu`` (section 3).

    ``samples`` holds ``L_t`` samples of the aggregated gradient (the sum over
    workers, the quantity that is decoded), stacked along axis 0: shape
    ``(L_t, *leaf_shape)``. Each sample is flattened row-major, the order the
    compressor uses, and cut into slices of ``slice_size`` values. With
    ``slices="first"`` only the first slice of every sample is used: the paper's
    compressor reuse factor ``s = inf``, one compressor per layer computed from
    its first slice and applied to all of them (section 3, "Compressor reuse
    factor s"). With ``slices="all"`` every full slice of every sample is
    pooled (``L_t * floor(size / K)`` rows) into one shared estimate; with
    few samples (``L_t`` well below ``K``) it usually generalizes better to
    the following iterations, at a larger ``d``. An already sliced
    ``(L_t, K)`` array is both.

    ``mu`` is the sample mean; the covariance of the centred slices is
    eigen-decomposed (`jnp.linalg.eigh`, float32) and ``U_d`` is its ``d`` most
    significant eigenvectors. ``d`` is either given (``rank``) or the smallest
    rank whose explained energy reaches ``1 - loss_threshold`` (eq. 6).

    Static shapes: the eq. 6 rank depends on the data. With ``max_rank=None``
    it is planned on the host (concrete samples, a Python int ``rank``, a
    ``basis`` of exactly ``d`` columns); with ``max_rank=r`` the fit runs
    under `jax.jit` and ``basis`` has ``r`` columns, ``d..r-1`` zero
    (docs/compressors.md#gradiveq).

    Args:
      samples: floating array ``(L_t, ...)``; ``L_t >= 1`` samples of at least
        ``slice_size`` values each.
      slice_size: ``K >= 1``, values per slice.
      loss_threshold: ``lambda`` in [0, 1) of eq. (6). Exactly one of
        ``loss_threshold`` and ``rank`` must be given.
      rank: a fixed ``d`` in [1, K].
      max_rank: with ``loss_threshold`` only: the static cap ``r`` in [1, K].
      slices: ``"first"`` (default, the paper's ``s = inf``) or ``"all"``.

    Returns:
      A `PCAFit` ``(basis, mean, rank, energy)``.

    Raises:
      ValueError: a setting outside the values above, not exactly one of
        ``loss_threshold`` and ``rank``, samples shorter than a slice, or
        host planning on traced samples.

    References:
      Yu et al., `GradiVeQ: Vector Quantization for Bandwidth-Efficient
      Gradient Aggregation in Distributed CNN Training
      <https://arxiv.org/abs/1811.03617>`_, NeurIPS 2018, section 2 (PCA
      after eq. 5) and section 3 ("Compressor dimension d", eq. 6; "Slice
      size K").

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> z = jax.random.normal(jax.random.key(0), (100, 2))
      >>> g = z @ jnp.array([[1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 0.0, -1.0]])
      >>> fit = qc.pca_fit(g, slice_size=4, loss_threshold=0.01)
      >>> fit.rank, fit.basis.shape
      (2, (4, 2))
    """
    slice_size, loss_threshold, rank, max_rank = _check_fit_settings(
        slice_size, loss_threshold, rank, max_rank, slices)
    host = rank is None and max_rank is None
    samples = _check_samples(samples, slice_size, host)
    mean, eigvecs, energy = _spectrum(samples, slice_size, slices)
    if rank is not None:
        return PCAFit(eigvecs[:, :rank], mean, rank, energy)
    assert loss_threshold is not None  # exactly one of the two (_check_fit_settings)
    d = _eq6_rank(energy, loss_threshold)
    if host:
        d = int(d)
        return PCAFit(eigvecs[:, :d], mean, d, energy)
    keep = jnp.arange(max_rank) < d
    return PCAFit(eigvecs[:, :max_rank] * keep, mean, d, energy)
