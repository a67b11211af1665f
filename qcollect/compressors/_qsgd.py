"""QSGD stochastic quantization.

Alistarh et al.'s QSGD as implemented and studied by Grubic et al.,
"Synchronous Multi-GPU Deep Learning with Low-Precision Communication",
section 2.3 (eq. 1) and section 3.2.2 (bits, bucketing, norms).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp

from qcollect._backend import propagate_nonfinite
from qcollect._config import check_floating_input, require_key
from qcollect._payload import Compressor, Payload, check_format
from qcollect.checks import check_choice, check_int
from qcollect.coding._packing import pack_bits, unpack_bits
from qcollect.compressors._groups import (
    Groups,
    bucket_groups,
    flat_codes,
    from_view,
    to_view,
    view_codes,
)
from qcollect.compressors._random import hash_uniform

__all__ = ["QSGDCompressor", "qsgd", "QSGD_BUCKET_SIZES"]

#: Grubic et al. section 4 ("Bucket Size"): the sizes that kept full accuracy.
QSGD_BUCKET_SIZES = {2: 128, 4: 512, 8: 512, 16: 8192}
#: The scale of a QSGD bucket: its max-norm or its 2-norm.
Norm = Literal["max", "l2"]


@dataclasses.dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class QSGDCompressor(Compressor):
    """What `qsgd` returns: a `Compressor` whose settings are typed fields.

    Attributes:
      bits: bits per value, the sign bit included.
      bucket_size: values per bucket, or None for one bucket per array.
      norm: the bucket scale, ``"max"`` or ``"l2"``.

    ``stochastic``, a `Compressor` field, is its fourth setting.
    """

    bits: int
    bucket_size: int | None
    norm: Norm

    setting_names: ClassVar[tuple[str, ...]] = ("bits", "bucket_size", "norm", "stochastic")


def qsgd(*, bits: int = 4, bucket_size: int | Literal["default"] | None = "default",
         norm: Norm = "max", stochastic: bool = True) -> QSGDCompressor:
    """QSGD: a sign bit and ``bits - 1`` bits of level per value, one scale per bucket.

    For a bucket ``v`` with scale ``||v||`` (max-norm by default, or 2-norm),
    each value is sent as ``sgn(v_i) * l_i`` with ``l_i`` in ``{0..s}``,
    ``s = 2**(bits-1) - 1``; it decodes to ``||v|| * sgn(v_i) * l_i / s``. With
    stochastic rounding ``l_i`` is ``floor(|v_i| s / ||v|| + u_i)``, ``u_i``
    uniform in [0, 1): the ``xi_i`` of Grubic eq. (1), so decode is unbiased,
    and with the 2-norm its variance is at most
    ``min(n/s**2, sqrt(n)/s) * ||v||_2**2`` per bucket of ``n`` values. This is
    the paper's first method (section 3.2.2: "one out of qBits bits to store
    the sign"). The max-norm gives smaller variance and is the default, as the
    paper found it more accurate.

    Codes are packed ``32 / bits`` per uint32 word; each bucket adds one
    float32 scale. Payload size: ``4 * ceil(n * bits / 32) + 4 * num_buckets``.

    The uniforms come from a counter-based integer hash keyed by ``key``,
    not threefry, at a fraction of its cost
    (docs/compressors.md#stochastic-rounding); its 24-bit grid keeps the
    rounding unbiased to 2**-24 of a level.

    Non-finite values make their bucket's scale non-finite, so the decoded
    bucket is non-finite too. An all-zero bucket has scale 0 and decodes to 0.

    Args:
      bits: 2, 4, 8 or 16 (one sign bit plus ``bits - 1`` level bits).
      bucket_size: values per bucket; ``"default"`` picks Grubic's size for
        ``bits`` (2: 128, 4: 512, 8: 512, 16: 8192); None is one bucket per
        array (the original QSGD).
      norm: ``"max"`` or ``"l2"``.
      stochastic: unbiased stochastic rounding (needs a key), or nearest.

    Returns:
      A non-linear `QSGDCompressor`, stochastic when ``stochastic`` is.

    Raises:
      ValueError: a setting outside the values above.

    References:
      Alistarh, Grubic, Li, Tomioka, Vojnovic, `QSGD: Communication-Efficient
      SGD via Gradient Quantization and Encoding
      <https://arxiv.org/abs/1610.02132>`_, NeurIPS 2017;
      Grubic, Tam, Alistarh, Zhang, `Synchronous Multi-GPU Deep Learning with
      Low-Precision Communication: An Experimental Study
      <https://doi.org/10.3929/ethz-b-000319485>`_, EDBT 2018, eq. (1),
      sections 3.2.2 and 4.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> c = qc.qsgd(bits=8, stochastic=False)
      >>> c.decode(c.encode(jnp.array([1.0, -0.5, 0.25])))  # levels k/127
      Array([ 1.       , -0.503937 ,  0.2519685], dtype=float32)
      >>> qc.qsgd(bits=2)  # settings recorded resolved
      qsgd(bits=2, bucket_size=128, norm='max', stochastic=True)
    """
    bits = check_choice("bits", bits, tuple(QSGD_BUCKET_SIZES))
    if isinstance(bucket_size, str):
        check_choice("bucket_size", bucket_size, ("default",))
    size: int | None = check_int("bucket_size", QSGD_BUCKET_SIZES[bits] if isinstance(
        bucket_size, str) else bucket_size, low=1, allow_none=True)
    norm = check_choice("norm", norm, ("max", "l2"))
    stochastic = check_choice("stochastic", stochastic, (True, False))
    name = f"qsgd/b{bits}/{size or 'whole'}/{norm}" + ("" if stochastic else "/nearest")
    static: dict[str, Any] = {"name": name, "bits": bits, "bucket_size": size}
    coding: dict[str, Any] = dict(static, norm=norm, stochastic=stochastic)
    # Zero padding leaves a bucket's max- or 2-norm unchanged: no valid counts.
    return QSGDCompressor(
        name, functools.partial(_encode, **coding), functools.partial(_decode, **static),
        linear=False, stochastic=stochastic, block=size or 1,
        grouping="bucket" if size else "leaf",
        encode_decoded=functools.partial(_encode_decoded, **coding),
        bits=bits, bucket_size=size, norm=norm)


def _bucket_scales(view: jax.Array, norm: Norm) -> jax.Array:
    """``||v||`` of every bucket (row of ``view``), NaN and Inf carried."""
    # max(max v, -min v) rather than max |v| (_backend.REDUCTION_INPUTS_WRITTEN).
    scale = jnp.maximum(jnp.max(view, axis=1, initial=0.0),
                        -jnp.min(view, axis=1, initial=0.0))
    if norm == "l2":
        # Squares of values over 2**64 overflow: sum them divided by a
        # power of two at least max |v| (exact), and keep a 2-norm beyond
        # the float32 range at the float32 maximum (levels stay <= s).
        c = jnp.ldexp(jnp.float32(1.0), -jnp.frexp(scale)[1])
        c = jnp.where(jnp.isfinite(c) & (c > 0), c, 1.0)[:, None]
        norm2 = jnp.sqrt(jnp.sum((view * c) * (view * c), axis=1)) / c[:, 0]
        scale = jnp.minimum(norm2, jnp.finfo(jnp.float32).max)
    # A vectorised max can drop a NaN (_backend.MAX_DROPS_NAN).
    return propagate_nonfinite(scale, view, axis=1)


def _top_level(bits: int) -> int:
    """``s = 2**(bits-1) - 1``: the largest level of ``bits``-bit codes."""
    return 2 ** (bits - 1) - 1


def _rounded_levels(view: jax.Array, scale: jax.Array, key: jax.Array | None, *, bits: int,
                    stochastic: bool) -> jax.Array:
    """``|v_i| s / ||v||`` rounded stochastically (or to nearest) into ``{0..s}``."""
    levels = _top_level(bits)
    inv = jnp.where(scale > 0, levels / scale, 0.0)
    level = jnp.abs(view) * inv[:, None]
    if stochastic:
        level = level + hash_uniform(key, view.shape)
    else:
        level = level + 0.5
    return jnp.minimum(jnp.floor(level), levels).astype(jnp.uint32)


def _encoded(x: jax.Array, key: jax.Array | None, *, name: str, bits: int,
             bucket_size: int | None, norm: Norm,
             stochastic: bool) -> tuple[Payload, jax.Array, jax.Array, Groups]:
    """(payload, each value's sign and level in the group view, the groups)."""
    x = jnp.asarray(x)
    check_floating_input(x)
    if stochastic:
        require_key(key, "qsgd(stochastic=True)")
    groups = bucket_groups(x.shape, bucket_size)
    view = to_view(x, groups)
    scale = _bucket_scales(view, norm)
    level = _rounded_levels(view, scale, key, bits=bits, stochastic=stochastic)
    negative = view < 0
    codes = jnp.where(negative, level | (1 << (bits - 1)), level)
    words = pack_bits(flat_codes(codes, groups), bits)
    payload = Payload({"codes": words, "scale": scale}, tuple(x.shape), x.dtype, name)
    return payload, negative, level, groups


def _reconstruct(negative: jax.Array, level: jax.Array, payload: Payload, groups: Groups,
                 bits: int) -> jax.Array:
    """``scale * sgn * level / s`` per value, as decode computes it."""
    step = payload["scale"][:, None] * (1.0 / _top_level(bits))
    level = level.astype(jnp.float32)
    view = jnp.where(negative, -level, level) * step
    return from_view(view, groups, payload.shape, payload.dtype)


def _encode(x: jax.Array, key: jax.Array | None = None, **static: Any) -> Payload:
    return _encoded(x, key, **static)[0]


def _encode_decoded(x: jax.Array, key: jax.Array | None = None, *, bits: int,
                    **static: Any) -> tuple[Payload, jax.Array]:
    # The levels and signs come from the encoding, not from unpacking its words.
    payload, negative, level, groups = _encoded(x, key, bits=bits, **static)
    return payload, _reconstruct(negative, level, payload, groups, bits)


def _decode(payload: Payload, *, name: str, bits: int, bucket_size: int | None) -> jax.Array:
    check_format(payload, name)
    groups = bucket_groups(payload.shape, bucket_size)
    sign_bit = 1 << (bits - 1)
    codes = view_codes(unpack_bits(payload["codes"], bits, groups.size), groups)
    return _reconstruct(codes >= sign_bit, codes & (sign_bit - 1), payload, groups, bits)
