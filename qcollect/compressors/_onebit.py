"""Seide's 1-bit quantization with mean reconstruction.

Seide et al. via Dryden et al., "Communication Quantization for Data-parallel
Training of Deep Neural Networks", section 3.1, and Grubic et al.,
"Synchronous Multi-GPU Deep Learning with Low-Precision Communication",
section 2.2 (Algorithm 2) and 3.2.1.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qcollect._config import check_floating_input, require_key
from qcollect._payload import Compressor, Payload, check_format
from qcollect.checks import check_choice, check_int
from qcollect.coding._packing import pack_bits, unpack_bits
from qcollect.compressors._groups import (
    GroupLayout,
    Groups,
    bucket_or_column_groups,
    flat_codes,
    from_view,
    group_sums,
    overflow_safe_scale,
    sample_within_groups,
    to_view,
    unscaled,
    view_codes,
    with_valid,
)

__all__ = ["OneBitCompressor", "onebit"]


@dataclasses.dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class OneBitCompressor(Compressor):
    """What `onebit` returns: a `Compressor` whose settings are typed fields.

    Attributes:
      bucket_size: values per bucket (``grouping="bucket"``).
      sample: sampled entries per group, or None for exact means.

    ``grouping``, a `Compressor` field, is its first setting.
    """

    bucket_size: int
    sample: int | None

    setting_names: ClassVar[tuple[str, ...]] = ("grouping", "bucket_size", "sample")


def onebit(*, grouping: GroupLayout = "bucket", bucket_size: int = 64,
           sample: int | None = None) -> OneBitCompressor:
    """Seide 1-bit quantization: one sign bit per value, two means per group.

    Values ``>= 0`` are sent as bit 1, negative values as bit 0, 32 bits per
    uint32 word. Each group also sends two float32 reconstruction values, the
    mean of its non-negative and of its negative entries (Dryden section 3.1;
    Grubic eq. for Q^1b). Decoding replaces each value by the mean of its side.
    Error feedback (Grubic Algorithm 2, lines 1 and 4) lives in the optax
    layer; this is the pure quantizer.

    Groups:
      * ``grouping="column"``: per column of the weight matrix, as CNTK does
        (Dryden 3.1): the columns of `qcollect.matrix_view`, the last axis.
      * ``grouping="bucket"``: per bucket of ``bucket_size`` consecutive values
        after flattening, Grubic's reshaped 1bitSGD* (section 3.2.2; bucket 64
        is the size the paper uses for its results).

    Empty sides (a group with no negatives) get mean 0, which no value decodes
    to. Non-finite inputs make their group's means non-finite, so decode is
    never silently finite (with sampling, a per-group ``sum * 0`` poisons the
    means).

    Payload size: ``4 * ceil(n / 32) + 8 * num_groups`` bytes.

    ``encode(x, key=None, *, valid=None)``: ``valid`` (one int32 count per
    group, see `Compressor.masks_padding`) marks the trailing zeros of each
    group as padding, kept out of the counts behind the means.

    Args:
      grouping: ``"bucket"`` (default) or ``"column"``.
      bucket_size: values per bucket, >= 1; ignored for columns.
      sample: None for exact means, or ``m >= 1``: Dryden's sampled means from
        ``m`` entries per group drawn uniformly with replacement (section 3.1,
        "randomly sample a fixed number of entries from each column"). Needs
        a key. A side that no sample falls on reconstructs as 0; error
        feedback carries what that loses.

    Returns:
      A non-linear `OneBitCompressor`; stochastic when ``sample`` is set.

    Raises:
      ValueError: a setting outside the values above.

    References:
      Seide, Fu, Droppo, Li, Yu, `1-bit stochastic gradient descent and its
      application to data-parallel distributed training of speech DNNs
      <https://doi.org/10.21437/Interspeech.2014-274>`_, INTERSPEECH 2014;
      Dryden, Moon, Jacobs, Van Essen, `Communication Quantization for
      Data-parallel Training of Deep Neural Networks
      <https://doi.org/10.1109/MLHPC.2016.004>`_, MLHPC 2016, section 3.1;
      Grubic, Tam, Alistarh, Zhang, `Synchronous Multi-GPU Deep Learning with
      Low-Precision Communication: An Experimental Study
      <https://doi.org/10.3929/ethz-b-000319485>`_, EDBT 2018, Algorithm 2 and
      sections 3.2.1-3.2.2.

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> c = qc.onebit(bucket_size=4)
      >>> c.decode(c.encode(jnp.array([1., 3., -2., -4.])))
      Array([ 2.,  2., -3., -3.], dtype=float32)
    """
    grouping = check_choice("grouping", grouping, ("bucket", "column"))
    bucket_size = check_int("bucket_size", bucket_size, low=1)
    sample = check_int("sample", sample, low=1, allow_none=True)
    name = f"onebit/{grouping}" + (f"/{bucket_size}" if grouping == "bucket" else "")
    name += "" if sample is None else f"/sample{sample}"
    static: dict[str, Any] = {"name": name, "grouping": grouping, "bucket_size": bucket_size}
    coding: dict[str, Any] = dict(static, sample=sample)
    return OneBitCompressor(
        name, functools.partial(_encode, **coding), functools.partial(_decode, **static),
        linear=False, stochastic=sample is not None,
        block=bucket_size if grouping == "bucket" else 1, grouping=grouping,
        masks_padding=True, encode_decoded=functools.partial(_encode_decoded, **coding),
        bucket_size=bucket_size, sample=sample)


def _nonnegative_counts(view: jax.Array, groups: Groups, bits: jax.Array,
                        grouping: GroupLayout, bucket_size: int) -> jax.Array:
    """Real non-negatives per group: a popcount of the packed sign words
    when every bucket is whole uint32 words (the tail's padding bits are
    0; padding zeros inside the view, as `valid` marks, are 1 and are
    subtracted), else a reduction over the view."""
    if grouping == "bucket" and bucket_size % 32 == 0:
        words = bucket_size // 32
        bits = jnp.pad(bits, (0, groups.num_groups * words - bits.shape[0]))
        per_word = lax.population_count(bits).reshape(groups.num_groups, words)
        ones = jnp.sum(per_word, axis=1, dtype=jnp.int32)
        if not isinstance(groups.counts, np.ndarray):
            ones = ones - (bucket_size - groups.counts)
        return ones.astype(jnp.float32)
    # Only unary and same-shape binary ops feed reductions
    # (_backend.REDUCTION_INPUTS_WRITTEN).
    # |sign v| - sign v is 2 for negatives and 0 otherwise.
    sign = jnp.sign(view)
    return groups.counts - 0.5 * jnp.sum(jnp.abs(sign) - sign, axis=groups.axis)


def _exact_means(view: jax.Array, groups: Groups, bits: jax.Array, grouping: GroupLayout,
                 bucket_size: int,
                 sums: tuple[jax.Array, ...] | None = None) -> tuple[jax.Array, jax.Array]:
    """The means of each group's non-negative and of its negative values;
    ``sums``: ``(non-negative sums, sums)`` times the `overflow_safe_scale`
    of the group length, when `_bucket_statistics` has them already."""
    # Sums of the values times c (a power of two) cannot overflow; the
    # means are scaled back within +-F32_MAX (`unscaled`). v + |v| is
    # exactly 2v or 0. total - pos keeps NaN/Inf of the group in the
    # negative mean (a NaN is neither >= 0 nor < 0, else it would vanish).
    c = overflow_safe_scale(groups.view[groups.axis])
    if sums is None:
        pos_sum = 0.5 * jnp.sum(view * c + jnp.abs(view * c), axis=groups.axis)
        total = group_sums(view, groups, scale=c)
    else:
        pos_sum, total = sums
    neg_sum = total - pos_sum
    pos_cnt = _nonnegative_counts(view, groups, bits, grouping, bucket_size)
    neg_cnt = groups.counts - pos_cnt
    return (unscaled(pos_sum / jnp.maximum(pos_cnt, 1), c),
            unscaled(neg_sum / jnp.maximum(neg_cnt, 1), c))


def _bucket_statistics(view: jax.Array,
                       groups: Groups) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Packed sign bits, and each bucket's sums of its non-negative values and
    of all its values (times the `overflow_safe_scale` of the bucket), from
    one read of the view: one reduction of three operands over each run of
    32 values (a sign word and two partial sums), the runs of a bucket then
    added. Buckets of whole uint32 words only.

    The same words as ``pack_bits(flat_codes(view >= 0))`` (padding after
    the last real value packs as 0), and sums in another order than two
    reductions of their own would take. Those three reductions (the words,
    the non-negative sums and a product with ones, `group_sums`) would each
    read the view, three passes where this is one
    (`_backend.REDUCTION_INPUTS_WRITTEN`).
    """
    rows, width = groups.view
    c = overflow_safe_scale(width)
    runs = view.reshape(rows, width // 32, 32)
    signs = runs >= 0
    if groups.size % 32:  # the last word holds padding: its bits must be 0
        index = jnp.arange(rows * width, dtype=jnp.int32).reshape(runs.shape)
        signs = signs & (index < groups.size)
    shifts = jnp.arange(32, dtype=jnp.uint32)
    scaled = runs * c

    def add(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return a[0] | b[0], a[1] + b[1], a[2] + b[2]

    words, pos, total = lax.reduce(
        (signs.astype(jnp.uint32) << shifts, 0.5 * (scaled + jnp.abs(scaled)), scaled),
        (jnp.uint32(0), jnp.float32(0), jnp.float32(0)), add, (2,))
    bits = words.reshape(-1)[: -(-groups.size // 32)]
    # The runs of a bucket are added by a product with ones, as `group_sums`
    # does (_backend.REDUCTION_INPUTS_WRITTEN).
    ones = jnp.ones((width // 32,), jnp.float32)
    return bits, tuple(jnp.matmul(s, ones, precision=lax.Precision.HIGHEST)
                       for s in (pos, total))


def _sampled_means(view: jax.Array, groups: Groups, key: jax.Array,
                   sample: int) -> tuple[jax.Array, jax.Array]:
    """The two means of ``sample`` entries per group drawn with replacement."""
    c = overflow_safe_scale(sample)
    picks = sample_within_groups(view, groups, key, sample) * c
    pos = picks >= 0
    pos_mean = jnp.sum(jnp.where(pos, picks, 0.0), -1) / jnp.maximum(jnp.sum(pos, -1), 1)
    neg_mean = jnp.sum(jnp.where(pos, 0.0, picks), -1) / jnp.maximum(jnp.sum(~pos, -1), 1)
    poison = group_sums(view, groups, scale=overflow_safe_scale(
        groups.view[groups.axis])) * 0.0
    return unscaled(pos_mean, c) + poison, unscaled(neg_mean, c) + poison


def _encoded(x: jax.Array, key: jax.Array | None, valid: jax.Array | None, *, name: str,
             grouping: GroupLayout, bucket_size: int,
             sample: int | None) -> tuple[Payload, jax.Array, Groups]:
    """(payload, the group view, its groups): the view feeds `_encode_decoded`."""
    x = jnp.asarray(x)
    check_floating_input(x)
    if sample is not None:
        require_key(key, "onebit(sample=...)")
    groups = with_valid(bucket_or_column_groups(x.shape, grouping, bucket_size), valid)
    view = to_view(x, groups)
    if sample is None and grouping == "bucket" and bucket_size % 32 == 0:
        bits, sums = _bucket_statistics(view, groups)
    else:
        bits, sums = pack_bits(flat_codes(view >= 0, groups), 1), None
    if sample is None:
        pos_mean, neg_mean = _exact_means(view, groups, bits, grouping, bucket_size, sums)
    else:
        pos_mean, neg_mean = _sampled_means(view, groups, key, sample)
    payload = Payload({"bits": bits, "pos": pos_mean, "neg": neg_mean},
                      tuple(x.shape), x.dtype, name)
    return payload, view, groups


def _reconstruct(nonnegative: jax.Array, payload: Payload, groups: Groups) -> jax.Array:
    """Every value replaced by the mean of its side."""
    view = jnp.where(nonnegative, groups.expand(payload["pos"]),
                     groups.expand(payload["neg"]))
    return from_view(view, groups, payload.shape, payload.dtype)


def _encode(x: jax.Array, key: jax.Array | None = None, *, valid: jax.Array | None = None,
            **static: Any) -> Payload:
    return _encoded(x, key, valid, **static)[0]


def _encode_decoded(x: jax.Array, key: jax.Array | None = None, *,
                    valid: jax.Array | None = None,
                    **static: Any) -> tuple[Payload, jax.Array]:
    # The signs come from the view, not from unpacking the bits just packed.
    payload, view, groups = _encoded(x, key, valid, **static)
    return payload, _reconstruct(view >= 0, payload, groups)


def _decode(payload: Payload, *, name: str, grouping: GroupLayout,
            bucket_size: int) -> jax.Array:
    check_format(payload, name)
    groups = bucket_or_column_groups(payload.shape, grouping, bucket_size)
    signs = view_codes(unpack_bits(payload["bits"], 1, groups.size), groups)
    return _reconstruct(signs == 1, payload, groups)
