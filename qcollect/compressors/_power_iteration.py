"""PowerSGD's power iteration: the products, the orthogonalization and the
reconstruction, scaled so that no float32 product overflows or underflows.

One step of Vogels et al.'s Algorithm 1 on a matrix ``M`` with the shared
factor ``Q`` (the whole data-parallel step and the matrix views are in
docs/compressors.md#powersgd): ``P = M Q`` (`powersgd_p`), ``P`` orthogonalized
(`orthogonalize`, Gram-Schmidt), ``Q = M^T P`` (`powersgd_q`) and ``M^ = P
Q^T`` (`powersgd_reconstruct`). `powersgd_normalize` scales ``Q``'s columns
by powers of two first, so that ``P`` keeps ``M``'s scale. Every product is
computed in float32 at the highest precision, on operands rescaled by
powers of two where their exponents would overflow (`_scaled_matmul`);
stacks of matrices (one per leaf of a shape class) are multiplied one
matrix at a time (`_each_matmul`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp

from qcollect._config import check_floating_input
from qcollect.checks import check_float
from qcollect.compressors._scaling import (
    OVERFLOW_EXPONENT,
    binary_exponent,
    rescale,
    unless_overflow,
    unscale,
)

__all__ = ["gram_schmidt", "orthogonalize", "powersgd_normalize", "powersgd_p", "powersgd_q",
           "powersgd_reconstruct"]

_HIGHEST = jax.lax.Precision.HIGHEST


def powersgd_normalize(q: jax.Array) -> jax.Array:
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

    Raises:
      ValueError: ``q`` has fewer than two dimensions.

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
def _normalize_columns(q: jax.Array) -> jax.Array:
    q = q.astype(jnp.float32)
    top = jnp.max(jnp.abs(q), axis=-2, keepdims=True, initial=0.0)
    e = jnp.where(top > 0, binary_exponent(top), 0)
    # Two exact steps: 2**-e alone is not a float32 for e = -126 .. -128 or 127, 128.
    half = e // 2
    return rescale(rescale(q, -half), half - e)


def orthogonalize(p: jax.Array, epsilon: float = 1e-8) -> jax.Array:
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

    Raises:
      ValueError: ``p`` has fewer than two dimensions, or ``epsilon < 0``.

    References:
      Vogels, Karimireddy, Jaggi, PowerSGD, NeurIPS 2019, Algorithm 1
      (ORTHOGONALIZE); PyTorch ``powerSGD_hook._orthogonalize``.

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
    return gram_schmidt(p, epsilon)


@functools.partial(jax.jit, static_argnames="epsilon")
def gram_schmidt(p: jax.Array, epsilon: float) -> jax.Array:
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
    single matrix, which XLA:CPU miscompiles (`_backend.BATCH_OF_ONE_MISCOMPILED`).
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


def _gram_schmidt_loop(rest: jax.Array, epsilon: float) -> jax.Array:
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


def _matmul(a: jax.Array, b: jax.Array, transpose_a: bool = False,
            transpose_b: bool = False) -> jax.Array:
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


def _maybe_transpose(x: jax.Array, transpose: bool) -> jax.Array:
    return jnp.swapaxes(x, -1, -2) if transpose else x


def _exponents(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per matrix, ``E`` with ``max |a| < 2**E`` and the same for ``b``."""
    ea = binary_exponent(jnp.max(jnp.abs(a), axis=(-2, -1), keepdims=True, initial=0.0))
    eb = binary_exponent(jnp.max(jnp.abs(b), axis=(-2, -1), keepdims=True, initial=0.0))
    return ea, eb


def _excess(ea: jax.Array, eb: jax.Array, a: jax.Array, transpose_a: bool) -> jax.Array:
    """Per matrix, how many binary orders the partial sums of ``a @ b`` could
    pass ``2**OVERFLOW_EXPONENT`` by: ``e_a + e_b + bits(k)`` bounds them
    (`_exponents`)."""
    length = a.shape[-2] if transpose_a else a.shape[-1]
    return jnp.maximum(ea + eb + int(length).bit_length() - OVERFLOW_EXPONENT, 0)


def _scaled_matmul(a: jax.Array, b: jax.Array, transpose_a: bool,
                   transpose_b: bool) -> jax.Array:
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


def _each_matmul(a: Sequence[jax.Array], b: jax.Array, transpose_a: bool = False) -> jax.Array:
    """`_matmul` of matrices ``a[j]`` given as a list, not a stack, with the
    stacked ``b``: each product runs on its own operand (no copy of the
    large matrices into a stack); the small products are stacked and
    checked at once, and only where one overflowed is the list stacked for
    the rescaled computation."""
    plain = jnp.stack([
        jnp.matmul(_maybe_transpose(b[j], True) if transpose_a else jnp.asarray(x, jnp.float32),
                   jnp.asarray(x, jnp.float32) if transpose_a else b[j], precision=_HIGHEST)
        for j, x in enumerate(a)])

    def rescaled(a: list[jax.Array], b: jax.Array) -> jax.Array:
        a = jnp.stack([jnp.asarray(x, jnp.float32) for x in a])
        if transpose_a:
            return _scaled_matmul(b, a, transpose_a=True, transpose_b=False)
        return _scaled_matmul(a, b, transpose_a=False, transpose_b=False)

    return unless_overflow(plain, rescaled, list(a), jnp.asarray(b, jnp.float32))


def _sequence(m: Any) -> bool:
    """Whether ``m`` is a list or tuple of matrices (leaves of one shape)."""
    if not isinstance(m, (list, tuple)):
        return False
    shapes = {tuple(jnp.shape(x)) for x in m}
    if not m or len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"m must be an array (..., n, m) or a non-empty sequence of "
                         f"(n, m) matrices of one shape, got shapes {sorted(shapes)}")
    return True


def powersgd_p(m: jax.Array | Sequence[jax.Array], q: jax.Array) -> jax.Array:
    """``P = M Q``: the first product of a PowerSGD step, what all-reduce #1 sums.

    Computed in float32 at the highest precision; where the product would
    overflow float32 it is recomputed from operands scaled by powers of two,
    so finite operands give a finite result over the whole float32 range.

    Args:
      m: ``M``, float ``(..., n, m)``; or a list of ``k`` matrices ``(n, m)``
        of one shape (the leaves of one shape, unstacked): the result is then
        the ``(k, n, r)`` stack of their products, and no stack of the large
        matrices is made (one fewer read and write of them per product).
      q: ``Q``, float ``(..., m, r)`` (``(k, m, r)`` for a list).

    Returns:
      float32 ``(..., n, r)``.

    References:
      Vogels, Karimireddy, Jaggi, PowerSGD, NeurIPS 2019, Algorithm 1,
      ``P <- M Q``.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> m = jnp.arange(6.0).reshape(3, 2)
      >>> qc.powersgd_p(m, jnp.array([[1.0], [0.0]]))
      Array([[0.],
             [2.],
             [4.]], dtype=float32)
    """
    if _sequence(m):
        return _each_matmul(m, q)
    return _matmul(m, q)


def powersgd_q(m: jax.Array | Sequence[jax.Array], p: jax.Array) -> jax.Array:
    """``Q = M^T P``: the second product of a PowerSGD step, what all-reduce #2 sums.

    Float32 and overflow-safe as `powersgd_p`.

    Args:
      m: ``M``, float ``(..., n, m)``, or a list of ``k`` matrices ``(n, m)``
        as in `powersgd_p`.
      p: the orthogonalized ``P``, float ``(..., n, r)`` (``(k, n, r)`` for a
        list).

    Returns:
      float32 ``(..., m, r)``.

    References:
      Vogels, Karimireddy, Jaggi, PowerSGD, NeurIPS 2019, Algorithm 1,
      ``Q <- M^T P``.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> m = jnp.arange(6.0).reshape(3, 2)
      >>> qc.powersgd_q(m, jnp.array([[1.0], [0.0], [0.0]]))
      Array([[0.],
             [1.]], dtype=float32)
    """
    # As (P^T M)^T: the overflow check reads the (..., r, m) product, and XLA
    # keeps the layout it picks for M^T P.
    if _sequence(m):
        return jnp.swapaxes(_each_matmul(m, p, transpose_a=True), -1, -2)
    return jnp.swapaxes(_matmul(p, m, transpose_a=True), -1, -2)


@overload
def powersgd_reconstruct(p: jax.Array, q: jax.Array, *,
                         stacked: Literal[True] = True) -> jax.Array: ...


@overload
def powersgd_reconstruct(p: jax.Array, q: jax.Array, *,
                         stacked: Literal[False]) -> list[jax.Array]: ...


def powersgd_reconstruct(p: jax.Array, q: jax.Array, *,
                         stacked: bool = True) -> jax.Array | list[jax.Array]:
    """``M^ = P Q^T``: the rank-``r`` approximation a PowerSGD step decodes.

    Float32 and overflow-safe as `powersgd_p`.

    Args:
      p: ``P``, float ``(..., n, r)``.
      q: ``Q``, float ``(..., m, r)``.
      stacked: with False, ``p`` and ``q`` are stacks ``(k, n, r)`` and
        ``(k, m, r)`` and the result is a list of the ``k`` matrices, each its
        own product: a consumer of one matrix then reads no slice of a
        ``(k, n, m)`` stack, and the products run faster than one batched
        product on the CPU backend (docs/collectives.md#backend-workarounds).
        The overflow check is still one for the stack.

    Returns:
      float32 ``(..., n, m)``, or a list of ``k`` float32 ``(n, m)`` matrices.

    Raises:
      ValueError: ``stacked=False`` with operands that are not two stacks of
        ``k`` matrices.

    References:
      Vogels, Karimireddy, Jaggi, PowerSGD, NeurIPS 2019, Algorithm 1,
      ``M^ <- P Q^T``.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> qc.powersgd_reconstruct(jnp.array([[1.0], [0.0], [0.0]]), jnp.array([[0.0], [1.0]]))
      Array([[0., 1.],
             [0., 0.],
             [0., 0.]], dtype=float32)
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

    def rescaled(p: jax.Array, q: jax.Array) -> list[jax.Array]:
        return list(_scaled_matmul(p, q, transpose_a=False, transpose_b=True))

    return unless_overflow(plain, rescaled, p, q, overflowed=overflowed)
