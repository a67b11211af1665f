"""PowerSGD low-rank compression: pure building blocks and a linear compressor.

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

``view="first"`` on a PyTorch-layout array is the hook's own matrix.
``view="last"`` on the Flax kernel of the same layer is its transpose (for
convs, up to the order of the ``in kh kw`` entries): the same singular values,
payload size ``4 r (n + m)`` and compression decision, with the roles of ``P``
and ``Q`` swapped. The wrong view for a layout can ruin compression: a Flax
conv kernel ``(3, 3, 32, 64)`` is ``(288, 64)`` with ``"last"`` but
``(3, 6144)`` with ``"first"``, where the rank is capped at 3 and a rank-3
factorization is larger than the kernel itself.
Vectors ``(n,)`` are ``(n, 1)`` and scalars ``(1, 1)`` in both views.

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

The state (``Q`` per leaf, the residuals) and the two collectives live in the
optax layer; this module is pure and holds no state. PyTorch switches to QR
for ``r > 2`` in float32; here Gram-Schmidt is used for every rank (same span
and, up to rounding, the same result).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp

from qcollect._config import check_choice, check_float, check_floating_input, check_int
from qcollect._groups import matrix_view
from qcollect._payload import Compressor, Payload, check_format
from qcollect._scaling import (
    OVERFLOW_EXPONENT,
    binary_exponent,
    rescale,
    unless_overflow,
    unscale,
)

__all__ = [
    "PowerSGDCompressor",
    "orthogonalize",
    "powersgd",
    "powersgd_init",
    "powersgd_matrix",
    "powersgd_matrix_shape",
    "powersgd_p",
    "powersgd_q",
    "powersgd_rank",
    "powersgd_reconstruct",
    "powersgd_should_compress",
]

_HIGHEST = jax.lax.Precision.HIGHEST


_VIEWS = ("last", "first")
#: How an array is viewed as a matrix (`powersgd_matrix_shape`).
MatrixView = Literal["last", "first"]


def _view_shape(shape, view: str) -> tuple[int, int]:
    """The ``(n, m)`` matrix view of ``shape`` (validates ``view``)."""
    check_choice("view", view, _VIEWS)
    shape = tuple(int(s) for s in shape)
    if view == "last" or len(shape) < 2:
        return matrix_view(shape)
    return (shape[0], math.prod(shape[1:]))


def powersgd_matrix_shape(shape, *, view: MatrixView = "last") -> tuple[int, int]:
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

    Example:
      >>> import qcollect as qc
      >>> qc.powersgd_matrix_shape((3, 3, 16, 32))
      (144, 32)
      >>> qc.powersgd_matrix_shape((32, 16, 3, 3), view="first")
      (32, 144)
    """
    return _view_shape(shape, view)


def powersgd_matrix(x, *, view: MatrixView = "last") -> jax.Array:
    """``x`` as its float32 ``(n, m)`` matrix view (see `powersgd_matrix_shape`).

    Undo it with ``m.reshape(x.shape).astype(x.dtype)``.
    """
    x = jnp.asarray(x)
    return x.reshape(_view_shape(x.shape, view)).astype(jnp.float32)


def powersgd_rank(shape, rank: int, *, view: MatrixView = "last") -> int:
    """The rank PyTorch uses for a leaf: ``min(n, m, rank)`` of its ``view``."""
    rank = check_int("rank", rank, low=1)
    n, m = _view_shape(shape, view)
    return max(min(n, m, rank), 1)


def powersgd_should_compress(shape, rank: int, *, min_compression_rate: float = 2.0,
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


def powersgd_normalize(q) -> jax.Array:
    """``Q`` with each column scaled by a power of two to a largest entry in [0.5, 1).

    Only the direction of each column of ``P = M Q`` matters (it is
    orthogonalized next, and Gram-Schmidt ignores positive column scales), so
    a warm-start ``Q``, which has the gradients' scale, can be normalized
    first: ``M Q`` then has ``M``'s scale, not its square, and a sum of ``N``
    workers' ``P_i`` stays finite up to gradients near ``F32_MAX / (N m)``.
    The scales are exact, and the same on every worker for a replicated
    ``Q``. Zero columns stay zero and non-finite ones non-finite.

    Args:
      q: floating array ``(..., m, r)``.

    Returns:
      float32 ``(..., m, r)``.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> qc.powersgd_normalize(jnp.array([[3e30, 0.0], [-1e30, 0.0]]))
      Array([[ 0.59164566,  0.        ],
             [-0.19721523,  0.        ]], dtype=float32)
    """
    q = jnp.asarray(q)
    check_floating_input(q)
    if q.ndim < 2:
        raise ValueError(f"q must have shape (..., m, r), got {q.shape}")
    return _normalize_columns(q)


@jax.jit
def _normalize_columns(q):
    q = q.astype(jnp.float32)
    top = jnp.max(jnp.abs(q), axis=-2, keepdims=True, initial=0.0)
    e = jnp.where(top > 0, binary_exponent(top), 0)
    # Two exact steps: 2**-e alone is not a float32 for e = -126 .. -128 or 127, 128.
    half = e // 2
    return rescale(rescale(q, -half), half - e)


def orthogonalize(p, epsilon: float = 1e-8) -> jax.Array:
    """Orthonormalizes the columns of ``p`` by Gram-Schmidt, as PyTorch's hook.

    For ``i = 0 .. r-1``: ``p_i /= ||p_i|| + epsilon``, then its projection is
    removed from the later columns. Batched over leading axes: ``p`` is
    ``(..., n, r)``, each ``(n, r)`` matrix is processed on its own. Computed
    in float32 and returned in ``p``'s dtype.

    ``epsilon > 0`` keeps degenerate input finite: a zero column comes out as
    zeros instead of NaN, and a linearly dependent column as its normalized
    rounding leftover (finite, but not a meaningful direction), as in
    PyTorch. With ``epsilon = 0`` a zero column gives NaN, as in PyTorch.
    Non-finite input stays non-finite.

    Args:
      p: floating array ``(..., n, r)``, ``r <= n`` for orthonormal output.
      epsilon: >= 0, added to every column norm.

    Returns:
      ``p`` with orthonormal columns (for full-column-rank input).

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> qc.orthogonalize(jnp.array([[3.0, 0.0], [4.0, 5.0]]), 0.0)
      Array([[ 0.6      , -0.8000001],
             [ 0.8      ,  0.6      ]], dtype=float32)
    """
    epsilon = check_float("epsilon", epsilon, low=0.0, low_inclusive=True)
    p = jnp.asarray(p)
    check_floating_input(p)
    if p.ndim < 2:
        raise ValueError(f"p must have shape (..., n, r), got {p.shape}")
    return _gram_schmidt(p, epsilon)


@functools.partial(jax.jit, static_argnames="epsilon")
def _gram_schmidt(p, epsilon):
    """Gram-Schmidt on the last two axes, finite for finite ``p`` of any size.

    Each output column depends only on the direction of its input column.
    Squares of values above about ``1e19`` overflow float32 and turned such a
    column into zeros (and later ones into NaN); zeros are finite, so the
    overflow is told from the input: where a matrix has entries at or above
    ``2**t``, its columns are scaled by powers of two to below ``2**t``
    (column norms stay below ``sqrt(n) 2**t`` and sums of squares below
    ``2**OVERFLOW_EXPONENT``) and the loop runs again (`unless_overflow`).
    A scaled column's norm is at least ``2**(t - 2)``, so epsilon is lost in
    its rounding as it is for the unscaled one: the same result.

    The leading axes are folded into one, and dropped when they hold a
    single matrix: XLA:CPU (jaxlib 0.10) miscompiles the loop's fused
    projection ``rest - sum(col * rest) col`` on arrays with a size-1 batch
    axis (a ``(1, 2048, 4)`` stack came out with columns off by 0.1, a
    ``(1, 1000, 8)`` one with NaN), while one matrix or a batch of two or
    more is right (`tests/test_powersgd.py` checks both at these sizes).
    """
    shape = p.shape
    batch = math.prod(shape[:-2])
    p32 = p.astype(jnp.float32).reshape(shape[-2:] if batch == 1 else (batch,) + shape[-2:])
    plain = _gram_schmidt_loop(p32, epsilon)
    if shape[-1] == 0:
        return plain.reshape(shape).astype(p.dtype)
    t = (OVERFLOW_EXPONENT - int(shape[-2]).bit_length()) // 2
    top = jnp.max(jnp.abs(p32), axis=-2, keepdims=True, initial=0.0)
    e = jnp.minimum(t - binary_exponent(top), 0)
    out = unless_overflow(plain, lambda p32, e: _gram_schmidt_loop(rescale(p32, e), epsilon),
                          p32, e, overflowed=jnp.any(e != 0))
    return out.reshape(shape).astype(p.dtype)


def _gram_schmidt_loop(rest, epsilon):
    cols = []
    for _ in range(rest.shape[-1]):
        col = rest[..., :, :1]
        col = col / (jnp.sqrt(jnp.sum(col * col, axis=-2, keepdims=True)) + epsilon)
        cols.append(col)
        rest = rest[..., :, 1:]
        rest = rest - jnp.sum(col * rest, axis=-2, keepdims=True) * col
    if not cols:
        return rest
    return jnp.concatenate(cols, axis=-1)


def _matmul(a, b, transpose_a=False, transpose_b=False):
    """``a @ b`` in float32 (``a^T`` or ``b^T`` if asked), finite for finite
    operands over the whole float32 range.

    A product of two values near ``2**100`` overflows float32 (and a warm-start
    ``Q`` has the gradients' scale, so ``M Q`` squares it). Where the product
    overflows (`unless_overflow`), it is computed again from operands scaled
    by exact powers of two and scaled back. A product smaller than its
    operands (``M Q``, ``P^T M``) is checked on its result; a larger one
    (``P Q^T``) on the operands' exponents, which bound it, so the check
    reads the small arrays only. The operands enter the rescaled branch
    untransposed: a transpose there would be materialised.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    plain = jnp.matmul(_maybe_transpose(a, transpose_a), _maybe_transpose(b, transpose_b),
                       precision=_HIGHEST)
    overflowed = None
    if plain.size > a.size + b.size:
        overflowed = jnp.any(_excess(*_exponents(a, b), a, transpose_a) > 0)
    rescaled = functools.partial(_scaled_matmul, transpose_a=transpose_a,
                                 transpose_b=transpose_b)
    return unless_overflow(plain, rescaled, a, b, overflowed=overflowed)


def _maybe_transpose(x, transpose):
    return jnp.swapaxes(x, -1, -2) if transpose else x


def _exponents(a, b) -> tuple[jax.Array, jax.Array]:
    """Per matrix, ``E`` with ``max |a| < 2**E`` and the same for ``b``."""
    ea = binary_exponent(jnp.max(jnp.abs(a), axis=(-2, -1), keepdims=True, initial=0.0))
    eb = binary_exponent(jnp.max(jnp.abs(b), axis=(-2, -1), keepdims=True, initial=0.0))
    return ea, eb


def _excess(ea, eb, a, transpose_a):
    """Per matrix, how many binary orders the partial sums of ``a @ b`` could
    pass ``2**OVERFLOW_EXPONENT`` by: ``e_a + e_b + bits(k)`` bounds them
    (`_exponents`)."""
    length = a.shape[-2] if transpose_a else a.shape[-1]
    return jnp.maximum(ea + eb + int(length).bit_length() - OVERFLOW_EXPONENT, 0)


def _scaled_matmul(a, b, transpose_a, transpose_b):
    """``a @ b`` with every partial sum below ``2**OVERFLOW_EXPONENT``.

    The `_excess` is taken off the larger operand first, then split, by
    exact powers of two, and the product scaled back (saturating at the
    float32 maximum where the true entry is larger).
    """
    ea, eb = _exponents(a, b)
    excess = _excess(ea, eb, a, transpose_a)
    first = jnp.minimum(excess, jnp.abs(ea - eb))
    big = first + (excess - first + 1) // 2       # at most 81: exact_pow2 stays exact
    ra = jnp.where(ea >= eb, big, excess - big)
    rb = excess - ra
    a = _maybe_transpose(rescale(a, -ra), transpose_a)
    b = _maybe_transpose(rescale(b, -rb), transpose_b)
    return unscale(jnp.matmul(a, b, precision=_HIGHEST), -ra, -rb)


def _each_matmul(a, b, transpose_a=False):
    """`_matmul` of matrices ``a[j]`` given as a list, not a stack, with the
    stacked ``b``: each product runs on its own operand (no copy of the
    large matrices into a stack); the small products are stacked and
    checked at once, and only where one overflowed is the list stacked for
    the rescaled computation."""
    plain = jnp.stack([
        jnp.matmul(_maybe_transpose(b[j], True) if transpose_a else jnp.asarray(x, jnp.float32),
                   jnp.asarray(x, jnp.float32) if transpose_a else b[j], precision=_HIGHEST)
        for j, x in enumerate(a)])

    def rescaled(a, b):
        a = jnp.stack([jnp.asarray(x, jnp.float32) for x in a])
        if transpose_a:
            return _scaled_matmul(b, a, transpose_a=True, transpose_b=False)
        return _scaled_matmul(a, b, transpose_a=False, transpose_b=False)

    return unless_overflow(plain, rescaled, list(a), jnp.asarray(b, jnp.float32))


def _sequence(m) -> bool:
    """Whether ``m`` is a list or tuple of matrices (leaves of one shape)."""
    if not isinstance(m, (list, tuple)):
        return False
    shapes = {tuple(jnp.shape(x)) for x in m}
    if not m or len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"m must be an array (..., n, m) or a non-empty sequence of "
                         f"(n, m) matrices of one shape, got shapes {sorted(shapes)}")
    return True


def powersgd_p(m, q) -> jax.Array:
    """``P = M Q``: ``(..., n, m) @ (..., m, r) -> (..., n, r)`` float32.

    ``m`` may also be a list of ``k`` matrices ``(n, m)`` of one shape (the
    leaves of one shape, unstacked) with ``q`` of shape ``(k, m, r)``: the
    result is the ``(k, n, r)`` stack of their products, and no stack of the
    large matrices is made (one fewer read and write of them per product).
    """
    if _sequence(m):
        return _each_matmul(m, q)
    return _matmul(m, q)


def powersgd_q(m, p) -> jax.Array:
    """``Q = M^T P``: ``(..., n, m)^T @ (..., n, r) -> (..., m, r)`` float32.

    ``m`` may also be a list of ``k`` matrices ``(n, m)`` with ``p`` of shape
    ``(k, n, r)``, as in `powersgd_p`.
    """
    # As (P^T M)^T: the overflow check reads the (..., r, m) product, and XLA
    # keeps the layout it picks for M^T P.
    if _sequence(m):
        return jnp.swapaxes(_each_matmul(m, p, transpose_a=True), -1, -2)
    return jnp.swapaxes(_matmul(p, m, transpose_a=True), -1, -2)


def powersgd_reconstruct(p, q, *, stacked: bool = True):
    """``M^ = P Q^T``: ``(..., n, r) @ (..., m, r)^T -> (..., n, m)`` float32.

    With ``stacked=False``, ``p`` and ``q`` are stacks ``(k, n, r)`` and
    ``(k, m, r)`` and the result is a list of the ``k`` matrices, each its
    own product: a consumer of one matrix then reads no slice of a ``(k, n,
    m)`` stack (XLA:CPU also runs ``k`` separate outer products faster than
    one batched). The overflow check is still one for the stack.
    """
    if stacked:
        return _matmul(p, q, transpose_b=True)
    p = jnp.asarray(p, jnp.float32)
    q = jnp.asarray(q, jnp.float32)
    if p.ndim != 3 or q.ndim != 3 or p.shape[0] != q.shape[0]:
        raise ValueError(f"stacked=False needs p (k, n, r) and q (k, m, r), got shapes "
                         f"{p.shape} and {q.shape}")
    plain = [jnp.matmul(p[j], q[j].T, precision=_HIGHEST) for j in range(p.shape[0])]
    overflowed = jnp.any(_excess(*_exponents(p, q), p, False) > 0)

    def rescaled(p, q):
        return list(_scaled_matmul(p, q, transpose_a=False, transpose_b=True))

    return unless_overflow(plain, rescaled, p, q, overflowed=overflowed)


def powersgd_init(key, shape, rank: int, *, epsilon: float = 1e-8,
                  view: MatrixView = "last") -> jax.Array:
    """A first ``Q`` for a leaf: orthogonalized standard normal, ``(m, r)`` float32.

    ``(n, m) = powersgd_matrix_shape(shape, view=view)`` and ``r =
    powersgd_rank(shape, rank, view=view)``. Use the same key on every worker
    (the factor must be shared); PyTorch seeds all ranks alike for the same
    reason.
    """
    r = powersgd_rank(shape, rank, view=view)
    _, m = _view_shape(shape, view)
    epsilon = check_float("epsilon", epsilon, low=0.0, low_inclusive=True)
    return _random_factor(key, (m, r), epsilon)


@functools.partial(jax.jit, static_argnames=("shape", "epsilon"))
def _random_factor(key, shape, epsilon):
    return _gram_schmidt(jax.random.normal(key, shape, jnp.float32), epsilon)


@dataclasses.dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class PowerSGDCompressor(Compressor):
    """What `powersgd` returns: a `Compressor` whose settings are typed fields.

    Attributes:
      factor: the shared factor given to `powersgd` (compared by identity).
      side: ``"right"`` (``factor = Q``) or ``"left"`` (``factor = P``).
      view: the matrix view, ``"last"`` or ``"first"``.
    """

    factor: Any
    side: Literal["right", "left"]
    view: MatrixView

    setting_names: ClassVar[tuple[str, ...]] = ("factor", "side", "view")


def powersgd(factor, *, side: Literal["right", "left"] = "right",
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
    hold the same one (see the module docstring for the two-round step); it
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


def _encode(x, key=None, *, name: str, f, side: str, view: MatrixView) -> Payload:
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


def _decode(payload, *, name: str, f, side: str):
    """``P Q^T`` reshaped to the payload's shape."""
    check_format(payload, name)
    if side == "right":
        mat = powersgd_reconstruct(payload["p"], f)
    else:
        mat = powersgd_reconstruct(f, payload["q"])
    return mat.reshape(payload.shape).astype(payload.dtype)
