"""The compressor contract: `Payload`, `Compressor` and `payload_bytes`.

A compressor is a static configuration plus two pure functions. Its encode
returns a `Payload`: a pytree whose array leaves are exactly the words that
would travel on the wire, while the original shape, dtype and the wire-format
name ride along as static aux data. Because the metadata is static, a payload
passes through `jax.jit`, `jax.vmap`, `jax.lax.ppermute` and `jax.lax.cond`
like any other pytree, and no output shape ever depends on data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["Compressor", "Payload", "payload_bytes"]


@dataclasses.dataclass(frozen=True)
class Payload:
    """What one compressor sends for one array.

    Attributes:
      arrays: the wire words, a dict of named arrays (packed codes, scales,
        means...). These are the only pytree leaves.
      shape: static shape of the encoded array.
      dtype: static dtype of the encoded array; decode returns it.
      format: static wire-format name, e.g. ``"qsgd/b4/512/max"``. Decoding a
        payload with a compressor of another format raises ValueError.
    """

    arrays: dict[str, Any]
    shape: tuple[int, ...]
    dtype: Any
    format: str

    def __getitem__(self, name: str):
        return self.arrays[name]


jax.tree_util.register_dataclass(
    Payload, data_fields=["arrays"], meta_fields=["shape", "dtype", "format"]
)


class Compressor(NamedTuple):
    """A compressor: static settings and pure encode/decode functions.

    Attributes:
      name: wire-format name shared by every payload it produces.
      encode: ``encode(x, key=None) -> Payload``. Stochastic compressors need a
        PRNG key and raise ValueError without one.
      decode: ``decode(payload) -> x_hat`` with the shape and dtype of ``x``.
      linear: True when ``decode(sum of payloads) == sum of decodes``, so
        payloads may be summed in the compressed domain.
      stochastic: True when encode consumes ``key``.
      block: values per bucket when ``grouping == "bucket"`` (QSGD and 1-bit
        buckets, PCA slices); 1 otherwise.
      grouping: the groups its statistics (scales, means, thresholds, ranges)
        are computed over, within one array: ``"element"`` (none: identity,
        cast, threshold), ``"bucket"`` (runs of ``block`` consecutive values,
        flattened row-major), ``"column"`` (columns of the array's matrix
        view, `qcollect.matrix_view`) or ``"leaf"`` (the whole array).
        `compressed_all_reduce` lays leaves out so that no group spans two
        leaves or two devices (see `qcollect._layout`).
      masks_padding: True when ``encode`` takes ``valid=``, an int32 array
        with one count per group: the group's first ``valid[g]`` values are
        real and the rest is zero padding that must not enter its statistics
        (1-bit means, adaptive selections, entropy ranges). Collectives pass
        it for a leaf's last, partial bucket and for padding chunks.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> c = qc.qsgd(bits=4)
      >>> p = c.encode(jnp.ones(1000), jax.random.key(0))
      >>> c.decode(p).shape, qc.payload_bytes(p)
      ((1000,), 508)
    """

    name: str
    encode: Callable[..., Payload]
    decode: Callable[[Payload], jax.Array]
    linear: bool
    stochastic: bool
    block: int = 1
    grouping: str = "element"
    masks_padding: bool = False


def payload_bytes(tree) -> int:
    """Bytes in the array leaves of a payload (or of any pytree of payloads).

    Static: it reads shapes and dtypes only, so it works on concrete arrays,
    tracers and `jax.ShapeDtypeStruct` trees from `jax.eval_shape`. Under
    `jax.vmap` it counts one example.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> qc.payload_bytes(jax.eval_shape(qc.onebit().encode, jnp.zeros(640)))
      160
    """
    return int(
        sum(
            int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
            for leaf in jax.tree_util.tree_leaves(tree)
        )
    )


def check_format(payload: Payload, name: str) -> None:
    """Raises ValueError when ``payload`` was made by another wire format."""
    if not isinstance(payload, Payload):
        raise TypeError(f"payload must be a qcollect Payload, got {type(payload).__name__}")
    if payload.format != name:
        raise ValueError(f"payload has format {payload.format!r}; this compressor decodes {name!r}")
