"""DeMo's fast components: the largest DCT coefficients of each chunk.

Peng, Quesnelle and Kingma, "DeMo: Decoupled Momentum Optimization"
(arXiv:2411.19870), section 3 and Algorithm 1: a worker's momentum is cut
into chunks of ``s`` values, each chunk goes through the orthonormal DCT-II
(a fixed ``s x s`` matrix, so the shapes are static), and only the ``k``
coefficients of largest magnitude per chunk travel, as sparse words: the
coefficient's index inside its chunk and its value. What they decode to
(the inverse DCT of the kept coefficients, the others zero) is what the
worker removes from its momentum.

Deviation: the chunks are ``s`` consecutive values of the flattened tensor
(a 1-D DCT), where the reference implementation takes 2-D ``s x s`` blocks
of matrices; one layout for every leaf, any shape. The index is a uint8
(``s <= 256``) or uint16 word, the value bfloat16 by default (3 bytes per
coefficient at ``s <= 256``), float32 on request.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DCTComponents", "dct_components", "dct_matrix", "from_dct_components"]


class DCTComponents(NamedTuple):
    """The words that travel: per chunk, ``k`` coefficients.

    Attributes:
      index: ``(..., chunks, k)`` uint8 or uint16, each coefficient's place in its chunk.
      value: ``(..., chunks, k)`` the coefficients (bfloat16 or float32).
    """

    index: jax.Array
    value: jax.Array


@functools.lru_cache(maxsize=16)
def dct_matrix(size: int) -> np.ndarray:
    """The orthonormal DCT-II matrix ``D`` of ``size``: ``D @ x`` are the
    coefficients of ``x``, ``D.T @ c`` inverts them.

    Example:
      >>> import numpy as np
      >>> d = dct_matrix(8)
      >>> bool(np.allclose(d @ d.T, np.eye(8), atol=1e-6))
      True
    """
    n = np.arange(size)
    d = np.cos(np.pi * (n[None, :] + 0.5) * n[:, None] / size) * np.sqrt(2.0 / size)
    d[0] /= np.sqrt(2.0)
    return d.astype(np.float32)


def dct_components(chunks: jax.Array, k: int, *, value_dtype: Any = jnp.bfloat16
                   ) -> DCTComponents:
    """The ``k`` largest coefficients (by magnitude) of each chunk's DCT.

    Args:
      chunks: ``(..., chunks, s)`` float values, one chunk per row.
      k: coefficients kept per chunk, ``1 <= k <= s``.
      value_dtype: the coefficients' dtype on the wire.

    Returns:
      `DCTComponents` of shape ``(..., chunks, k)``.

    Example:
      >>> import jax.numpy as jnp
      >>> c = dct_components(jnp.ones((1, 4)), 1, value_dtype=jnp.float32)
      >>> int(c.index[0, 0]), float(c.value[0, 0])   # a constant: the DC term alone
      (0, 2.0)
    """
    size = chunks.shape[-1]
    if not 1 <= k <= size:
        raise ValueError(f"k must be in [1, {size}] (the chunk size), got {k!r}")
    coeffs = chunks.astype(jnp.float32) @ jnp.asarray(dct_matrix(size)).T
    _, index = jax.lax.top_k(jnp.abs(coeffs), k)
    value = jnp.take_along_axis(coeffs, index, axis=-1)
    return DCTComponents(index.astype(jnp.uint8 if size <= 256 else jnp.uint16),
                         value.astype(value_dtype))


def from_dct_components(components: DCTComponents, size: int) -> jax.Array:
    """The chunks the components decode to: the kept coefficients in their
    places (summed where two name one place, so ``(chunks, N * k)``
    components of N workers decode to the sum of their chunks), zeros
    elsewhere, through the inverse DCT; ``(..., chunks, size)`` float32.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([[1.0, 2.0, 3.0, 4.0]])
      >>> bool(jnp.allclose(from_dct_components(dct_components(
      ...     x, 4, value_dtype=jnp.float32), 4), x, atol=1e-5))
      True
    """
    lead, k = components.index.shape[:-1], components.index.shape[-1]
    index = components.index.reshape(-1, k).astype(jnp.int32)
    rows = jnp.arange(index.shape[0])[:, None]
    coeffs = jnp.zeros((index.shape[0], size), jnp.float32).at[rows, index].add(
        components.value.reshape(-1, k).astype(jnp.float32))
    return (coeffs @ jnp.asarray(dct_matrix(size))).reshape(*lead, size)
