"""QSGD stochastic quantization.

Alistarh et al.'s QSGD as implemented and studied by Grubic et al.,
"Synchronous Multi-GPU Deep Learning with Low-Precision Communication",
section 2.3 (eq. 1) and section 3.2.2 (bits, bucketing, norms).
"""

from __future__ import annotations

import jax.numpy as jnp

from qcollect._config import check_choice, check_floating_input, check_int, require_key
from qcollect._groups import bucket_groups, flat_codes, from_view, to_view, view_codes
from qcollect._packing import pack_bits, unpack_bits
from qcollect._payload import Compressor, Payload, check_format, settings
from qcollect._random import hash_uniform

__all__ = ["qsgd", "QSGD_BUCKET_SIZES"]

#: Grubic et al. section 4 ("Bucket Size"): the sizes that kept full accuracy.
QSGD_BUCKET_SIZES = {2: 128, 4: 512, 8: 512, 16: 8192}


def qsgd(*, bits: int = 4, bucket_size: int | None | str = "default", norm: str = "max",
         stochastic: bool = True) -> Compressor:
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

    The uniforms come from a counter-based integer hash keyed by ``key``
    (see `qcollect._random`), not threefry: on CPU threefry costs about twelve
    elementwise passes, the hash about one third of one, and its 24-bit grid
    keeps the rounding unbiased to 2**-24 of a level.

    Args:
      bits: 2, 4, 8 or 16 (one sign bit plus ``bits - 1`` level bits).
      bucket_size: values per bucket; ``"default"`` picks Grubic's size for
        ``bits`` (2: 128, 4: 512, 8: 512, 16: 8192); None is one bucket per
        array (the original QSGD).
      norm: ``"max"`` or ``"l2"``.
      stochastic: unbiased stochastic rounding (needs a key), or nearest.

    Non-finite values make their bucket's scale non-finite, so the decoded
    bucket is non-finite too. An all-zero bucket has scale 0 and decodes to 0.

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
        bucket_size = QSGD_BUCKET_SIZES[bits]
    bucket_size = check_int("bucket_size", bucket_size, low=1, allow_none=True)
    norm = check_choice("norm", norm, ("max", "l2"))
    stochastic = check_choice("stochastic", stochastic, (True, False))
    levels = 2 ** (bits - 1) - 1
    sign_bit = 1 << (bits - 1)
    name = f"qsgd/b{bits}/{bucket_size or 'whole'}/{norm}" + ("" if stochastic else "/nearest")

    def encoded(x, key):
        """(payload, each value's signed level, as float32 in the group view)."""
        x = jnp.asarray(x)
        check_floating_input(x)
        if stochastic:
            require_key(key, "qsgd(stochastic=True)")
        groups = bucket_groups(x.shape, bucket_size)
        view = to_view(x, groups)
        # max(max v, -min v) rather than max |v|: a shared |v| would be
        # materialised by XLA:CPU between the reduction and the packing.
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
        # XLA:CPU's vectorised max reduction can drop a NaN (seen on
        # 8192-wide rows); a sum always propagates NaN and Inf.
        scale = scale + jnp.sum(view - view, axis=1)
        inv = jnp.where(scale > 0, levels / scale, 0.0)
        level = jnp.abs(view) * inv[:, None]
        if stochastic:
            level = level + hash_uniform(key, view.shape)
        else:
            level = level + 0.5
        level = jnp.minimum(jnp.floor(level), levels).astype(jnp.uint32)
        negative = view < 0
        codes = jnp.where(negative, level | sign_bit, level)
        words = pack_bits(flat_codes(codes, groups), bits)
        payload = Payload({"codes": words, "scale": scale}, tuple(x.shape), x.dtype, name)
        return payload, negative, level, groups

    def reconstruct(negative, level, payload, groups):
        """``scale * sgn * level / s`` per value, as decode computes it."""
        step = payload["scale"][:, None] * (1.0 / levels)
        level = level.astype(jnp.float32)
        view = jnp.where(negative, -level, level) * step
        return from_view(view, groups, payload.shape, payload.dtype)

    def encode(x, key=None):
        return encoded(x, key)[0]

    def encode_decoded(x, key=None):
        # The levels and signs come from the encoding, not from unpacking its words.
        payload, negative, level, groups = encoded(x, key)
        return payload, reconstruct(negative, level, payload, groups)

    def decode(payload):
        check_format(payload, name)
        groups = bucket_groups(payload.shape, bucket_size)
        codes = view_codes(unpack_bits(payload["codes"], bits, groups.size), groups)
        return reconstruct(codes >= sign_bit, codes & (sign_bit - 1), payload, groups)

    # Zero padding leaves a bucket's max- or 2-norm unchanged: no valid counts.
    return Compressor(name, encode, decode, linear=False, stochastic=stochastic,
                      block=bucket_size or 1, grouping="bucket" if bucket_size else "leaf",
                      encode_decoded=encode_decoded,
                      settings=settings(bits=bits, bucket_size=bucket_size, norm=norm,
                                        stochastic=stochastic))
