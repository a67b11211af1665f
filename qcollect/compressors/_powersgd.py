"""PowerSGD low-rank compression: matrix views and a linear compressor.

Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization" (NeurIPS 2019), Algorithm 1, as PyTorch's
``powerSGD_hook`` implements it. Every leaf is viewed as a matrix ``M`` of
shape ``(n, m)`` (`powersgd_matrix_shape`), a row-major reshape chosen by
``view``:

* ``view="last"`` (default), for JAX/Flax channels-last kernels:
  ``(prod(shape[:-1]), shape[-1])``. A dense kernel ``(in, out)`` is itself,
  a conv kernel ``(kh, kw, in, out)`` is ``(kh kw in, out)``.
* ``view="first"``, for PyTorch's channels-first layouts:
  ``(shape[0], prod(shape[1:]))``, the hook's ``view(shape[0], -1)``. A conv
  weight ``(out, in, kh, kw)`` is ``(out, in kh kw)``.

Vectors ``(n,)`` are ``(n, 1)`` and scalars ``(1, 1)`` in both views. The
wrong view for a layout can ruin compression (docs/compressors.md#powersgd
compares the two).

With a rank ``r`` and a ``Q`` of shape ``(m, r)`` (random at first, then
reused: warm start) one step of data-parallel PowerSGD on ``N`` workers is::

    Q   = powersgd_normalize(Q)      # power-of-two column scales: P keeps M's scale
    P_i = M_i Q                      # powersgd_p          (n, r) per worker
    P   = sum_i P_i                  # all-reduce #1, a compressed-domain sum
    P   = orthogonalize(P)           # Gram-Schmidt, identical on all workers
    Q_i = M_i^T P                    # powersgd_q          (m, r) per worker
    Q   = sum_i Q_i / N              # all-reduce #2
    M^  = P Q^T                      # powersgd_reconstruct: the mean's rank-r approximation
    e_i = M_i - M^                   # error feedback (PyTorch keeps M_i - M^)
    Q is kept for the next step       # warm start

Both all-reduces sum payloads that are linear in ``M_i`` for a factor every
worker shares, so each half is a linear `Compressor` (`powersgd`). Encode
locally and sum the payloads in the compressed domain, e.g. with
``compressed_all_reduce(payload, axis, identity(), algorithm="ring")`` over the
payload pytree; `compressed_all_reduce` cannot take `powersgd` itself as its
compressor, because it cuts the flattened buffer into per-device chunks and a
chunk has no matrix view:

* ``powersgd(Q, side="right")``: encode ``M -> P = M Q``; decode ``P Q^T``.
  Only the summed payload matters here (it is orthogonalized next).
* ``powersgd(P, side="left")`` with the orthogonalized ``P``: encode
  ``M -> Q = M^T P``; decode ``P Q^T``. Its decode of the summed payload is
  ``P P^T sum_i M_i``, the PowerSGD output (times ``N``), and decoding one
  worker's payload gives that worker's contribution ``P P^T M_i``.

The products, the orthogonalization and the reconstruction are
`qcollect.powersgd_p`, `qcollect.orthogonalize`, `qcollect.powersgd_q` and
`qcollect.powersgd_reconstruct`. The state (``Q`` per leaf, the residuals) and
the two collectives live in the optax layer; this module is pure and holds
no state. PyTorch switches to QR for ``r > 2`` in float32; here Gram-Schmidt
is used for every rank (same span and, up to rounding, the same result).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp

from qcollect._config import check_floating_input
from qcollect._payload import Compressor, Payload, check_format
from qcollect.checks import check_choice, check_float, check_int
from qcollect.compressors._groups import matrix_view
from qcollect.compressors._power_iteration import (
    gram_schmidt,
    powersgd_p,
    powersgd_q,
    powersgd_reconstruct,
)

__all__ = [
    "PowerSGDCompressor",
    "powersgd",
    "powersgd_init",
    "powersgd_matrix",
    "powersgd_matrix_shape",
    "powersgd_rank",
    "powersgd_should_compress",
]


#: How an array is viewed as a matrix (`powersgd_matrix_shape`).
MatrixView = Literal["last", "first"]
_VIEWS: tuple[MatrixView, ...] = ("last", "first")
#: Which factor a `powersgd` compressor holds: ``Q`` (right) or ``P`` (left).
Side = Literal["right", "left"]


def _view_shape(shape: Sequence[int], view: MatrixView) -> tuple[int, int]:
    """The ``(n, m)`` matrix view of ``shape`` (validates ``view``)."""
    check_choice("view", view, _VIEWS)
    shape = tuple(int(s) for s in shape)
    if view == "last" or len(shape) < 2:
        return matrix_view(shape)
    return (shape[0], math.prod(shape[1:]))


def powersgd_matrix_shape(shape: Sequence[int], *,
                          view: MatrixView = "last") -> tuple[int, int]:
    """The ``(n, m)`` matrix view of a leaf.

    A vector ``(n,)`` is ``(n, 1)`` and a scalar ``(1, 1)`` in both views.

    Args:
      shape: the leaf's shape.
      view: ``"last"`` (default; JAX/Flax channels-last kernels):
        ``(prod(shape[:-1]), shape[-1])``, so a dense kernel ``(in, out)`` is
        itself and a conv kernel ``(kh, kw, in, out)`` is ``(kh kw in, out)``.
        ``"first"`` (PyTorch's channels-first layouts; the hook's
        ``view(shape[0], -1)``): ``(shape[0], prod(shape[1:]))``.

    Returns:
      ``(n, m)``; the view is a row-major reshape in both cases.

    Raises:
      ValueError: ``view`` is not ``"last"`` or ``"first"``.

    References:
      Vogels, Karimireddy, Jaggi, PowerSGD, NeurIPS 2019 (each layer's
      gradient as a matrix); PyTorch ``powerSGD_hook`` (``view(shape[0], -1)``).

    Example:
      >>> import qcollect as qc
      >>> qc.powersgd_matrix_shape((3, 3, 16, 32))
      (144, 32)
      >>> qc.powersgd_matrix_shape((32, 16, 3, 3), view="first")
      (32, 144)
    """
    return _view_shape(shape, view)


def powersgd_matrix(x: jax.Array, *, view: MatrixView = "last") -> jax.Array:
    """``x`` as its float32 ``(n, m)`` matrix view, the ``M`` PowerSGD factorizes.

    Args:
      x: an array of any shape.
      view: ``"last"`` (default) or ``"first"``, see `powersgd_matrix_shape`.

    Returns:
      float32 ``(n, m)``, a row-major reshape; undo it with
      ``m.reshape(x.shape).astype(x.dtype)``.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> qc.powersgd_matrix(jnp.ones((3, 3, 16, 32))).shape
      (144, 32)
    """
    x = jnp.asarray(x)
    return x.reshape(_view_shape(x.shape, view)).astype(jnp.float32)


def powersgd_rank(shape: Sequence[int], rank: int, *, view: MatrixView = "last") -> int:
    """The rank PyTorch uses for a leaf: ``min(n, m, rank)`` of its ``view``.

    A rank above the smaller side of ``M`` adds nothing: ``M`` has no
    more singular values.

    Args:
      shape: the leaf's shape.
      rank: the requested approximation rank, >= 1.
      view: ``"last"`` (default) or ``"first"``, see `powersgd_matrix_shape`.

    Returns:
      ``max(min(n, m, rank), 1)`` for the ``(n, m)`` view.

    Raises:
      ValueError: ``rank`` below 1, or another ``view``.

    References:
      PyTorch ``powerSGD_hook`` (``min(n, m, matrix_approximation_rank)``).

    Example:
      >>> import qcollect as qc
      >>> qc.powersgd_rank((512, 256), 4), qc.powersgd_rank((3, 3, 2, 2), 64)
      (4, 2)
    """
    rank = check_int("rank", rank, low=1)
    n, m = _view_shape(shape, view)
    return max(min(n, m, rank), 1)


def powersgd_should_compress(shape: Sequence[int], rank: int, *,
                             min_compression_rate: float = 2.0,
                             view: MatrixView = "last") -> bool:
    """Whether a leaf is worth compressing (PyTorch's ``_should_compress``).

    True for leaves of two or more dimensions whose ``(n, m)`` view satisfies
    ``(n + m) * r * min_compression_rate < n * m`` with ``r = min(n, m, rank)``.
    Vectors and scalars are never compressed (PyTorch sends them raw).

    Args:
      shape: the leaf's shape.
      rank: the requested approximation rank, >= 1.
      min_compression_rate: > 0; PyTorch's default is 2.
      view: ``"last"`` (default, channels-last) or ``"first"`` (PyTorch's
        layout), see `powersgd_matrix_shape`.

    Returns:
      Whether the two factors are smaller than the leaf by the rate.

    References:
      PyTorch ``powerSGD_hook._should_compress`` and its
      ``min_compression_rate``.

    Example:
      >>> import qcollect as qc
      >>> qc.powersgd_should_compress((512, 256), 4), qc.powersgd_should_compress((512,), 4)
      (True, False)
      >>> [qc.powersgd_should_compress((3, 3, 32, 64), 4, view=v) for v in ("last", "first")]
      [True, False]
    """
    r = powersgd_rank(shape, rank, view=view)
    rate = check_float("min_compression_rate", min_compression_rate, low=0.0)
    if len(tuple(shape)) < 2:
        return False
    n, m = _view_shape(shape, view)
    return (n + m) * r * rate < n * m


def powersgd_init(key: jax.Array, shape: Sequence[int], rank: int, *, epsilon: float = 1e-8,
                  view: MatrixView = "last") -> jax.Array:
    """A first ``Q`` for a leaf: orthogonalized standard normal, ``(m, r)`` float32.

    PowerSGD starts its power iteration from a random ``Q`` and then reuses
    the last one (warm start). Use the same key on every worker (the factor
    must be shared); PyTorch seeds all ranks alike for the same reason.

    Args:
      key: a PRNG key, the same on every worker.
      shape: the leaf's shape; ``(n, m) = powersgd_matrix_shape(shape,
        view=view)``.
      rank: the requested rank; ``r = powersgd_rank(shape, rank, view=view)``.
      epsilon: >= 0, as in `orthogonalize`.
      view: ``"last"`` (default) or ``"first"``, see `powersgd_matrix_shape`.

    Returns:
      float32 ``(m, r)`` with orthonormal columns.

    References:
      Vogels, Karimireddy, Jaggi, PowerSGD, NeurIPS 2019, Algorithm 1 (``Q``
      initialized from an i.i.d. standard normal).

    Example:
      >>> import jax, qcollect as qc
      >>> q = qc.powersgd_init(jax.random.key(0), (3, 3, 16, 32), 4)
      >>> q.shape, q.dtype
      ((32, 4), dtype('float32'))
    """
    r = powersgd_rank(shape, rank, view=view)
    _, m = _view_shape(shape, view)
    epsilon = check_float("epsilon", epsilon, low=0.0, low_inclusive=True)
    return _random_factor(key, (m, r), epsilon)


@functools.partial(jax.jit, static_argnames=("shape", "epsilon"))
def _random_factor(key: jax.Array, shape: tuple[int, int], epsilon: float) -> jax.Array:
    return gram_schmidt(jax.random.normal(key, shape, jnp.float32), epsilon)


@dataclasses.dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class PowerSGDCompressor(Compressor):
    """What `powersgd` returns: a `Compressor` whose settings are typed fields.

    Attributes:
      factor: the shared factor given to `powersgd` (compared by identity).
      side: ``"right"`` (``factor = Q``) or ``"left"`` (``factor = P``).
      view: the matrix view, ``"last"`` or ``"first"``.
    """

    factor: Any
    side: Side
    view: MatrixView

    setting_names: ClassVar[tuple[str, ...]] = ("factor", "side", "view")


def powersgd(factor: jax.Array, *, side: Side = "right",
             view: MatrixView = "last") -> PowerSGDCompressor:
    """One half of a PowerSGD step as a linear compressor with a shared factor.

    The input ``x`` is viewed as ``M`` of shape ``(n, m)``
    (`powersgd_matrix` with ``view``); decode reshapes back to ``x.shape``.

    * ``side="right"``, ``factor = Q`` of shape ``(m, r)``: payload
      ``{"p": M Q}``, float32 ``(n, r)``, ``4 n r`` bytes; decode ``P Q^T``
      (with orthonormal ``Q``, the projection ``M Q Q^T``).
    * ``side="left"``, ``factor = P`` of shape ``(n, r)``: payload
      ``{"q": M^T P}``, float32 ``(m, r)``, ``4 m r`` bytes; decode ``P Q^T``
      (with orthonormal ``P``, the projection ``P P^T M``).

    Both are linear in ``M`` for a fixed factor, so payloads sum in the
    compressed domain. The factor is captured, not sent: all workers must
    hold the same one (docs/compressors.md#powersgd has the two-round step); it
    may be a traced array from optimizer state. A one-shot use
    (``side="right"`` with a fixed orthonormal ``Q``) is a plain linear
    low-rank projection.

    Args:
      factor: float array, ``Q`` ``(m, r)`` or ``P`` ``(n, r)``, ``r >= 1``.
      side: ``"right"`` (default) or ``"left"``.
      view: ``"last"`` (default, JAX/Flax channels-last) or ``"first"``
        (PyTorch's ``view(shape[0], -1)``), see `powersgd_matrix_shape`.
        Encode and decode use it; the factor must be built for the same view.

    Returns:
      A `PowerSGDCompressor` with ``linear=True`` and ``stochastic=False``. Its
      settings ``factor``, ``side`` and ``view`` read as attributes;
      ``factor`` compares by identity (see `Compressor`), so compressors
      built from one factor array are equal and a new factor makes a new
      compressor.

    References:
      Vogels, Karimireddy, Jaggi, `PowerSGD: Practical Low-Rank Gradient
      Compression for Distributed Optimization
      <https://arxiv.org/abs/1905.13727>`_, NeurIPS 2019,
      Algorithm 1 (one power iteration with warm start); PyTorch
      ``powerSGD_hook``.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> q = qc.powersgd_init(jax.random.key(0), (8, 6), 2)
      >>> c = qc.powersgd(q)
      >>> p = c.encode(jnp.ones((8, 6)))
      >>> p["p"].shape, qc.payload_bytes(p), c.decode(p).shape
      ((8, 2), 64, (8, 6))
    """
    side = check_choice("side", side, ("right", "left"))
    view = check_choice("view", view, _VIEWS)
    if getattr(factor, "ndim", None) != 2 or factor.shape[1] < 1:
        raise ValueError(f"factor must be a (rows, rank) array with rank >= 1, got shape "
                         f"{getattr(factor, 'shape', None)}")
    f = jnp.asarray(factor, jnp.float32)
    name = f"powersgd/{side}/{view}/{int(f.shape[0])}x{int(f.shape[1])}"
    static = {"name": name, "f": f, "side": side}
    return PowerSGDCompressor(name, functools.partial(_encode, view=view, **static),
                              functools.partial(_decode, **static), linear=True,
                              stochastic=False, factor=factor, side=side, view=view)


def _encode(x: jax.Array, key: jax.Array | None = None, *, name: str, f: jax.Array,
            side: Side, view: MatrixView) -> Payload:
    """``{"p": M Q}`` (right) or ``{"q": M^T P}`` (left) of ``x``'s matrix view."""
    x = jnp.asarray(x)
    check_floating_input(x)
    mat = powersgd_matrix(x, view=view)
    axis = 1 if side == "right" else 0
    length = int(f.shape[0])
    if mat.shape[axis] != length:
        raise ValueError(f"x has matrix view {mat.shape}; factor {f.shape} needs "
                         f"{length} {'columns' if axis else 'rows'}")
    if side == "right":
        return Payload({"p": powersgd_p(mat, f)}, tuple(x.shape), x.dtype, name)
    return Payload({"q": powersgd_q(mat, f)}, tuple(x.shape), x.dtype, name)


def _decode(payload: Payload, *, name: str, f: jax.Array, side: Side) -> jax.Array:
    """``P Q^T`` reshaped to the payload's shape."""
    check_format(payload, name)
    if side == "right":
        mat = powersgd_reconstruct(payload["p"], f)
    else:
        mat = powersgd_reconstruct(f, payload["q"])
    return mat.reshape(payload.shape).astype(payload.dtype)
