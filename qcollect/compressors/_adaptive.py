"""Dryden's adaptive quantization: a fixed proportion of each sign, mean reconstruction.

Dryden et al., "Communication Quantization for Data-parallel Training of Deep
Neural Networks", section 3.3 (with footnote 1 and the sampling paragraph).

Exact mode (``sample=None``) selects per group and sign with `lax.top_k`
on the magnitudes when at most ``TOP_K_LIMIT = 256`` entries per group
can be sent (the paper's ``pi = 64`` on columns of up to 16K rows), else
with a 31-step bisection on integer keys of ``|v|`` (the paper uses
quickselect; neither sorts the group). It sends exactly ``s+`` and
``s-`` entries, equal magnitudes going to the lower index.

Sampled mode (``sample=m``) is the paper's speed-up: ``m`` entries per
group drawn uniformly with replacement (a counter-based hash of the key);
``tau+`` is the ``max(1, round(m+ / pi))``-th largest non-negative
sample, ``tau-`` likewise for the negative samples, and the means are
the means of the samples at or beyond them. Every entry with
``v >= tau+`` (non-negative) or ``v <= tau-`` (negative) is sent. The
rank is rounded to nearest, not up: it estimates a quantile, and a
ceiling would double the volume when ``m+ / pi`` is near 1; keep ``m``
several times ``pi``. A sign no sample falls on sends nothing.

Static capacity (the paper's message length is data-dependent): group
``g`` of ``c_g`` entries gets ``min(c_g, ceil(scale * ceil(c_g / pi)) + 1)``
slots, ``scale = capacity_scale``. With ``scale = 1`` (the exact-mode
default) that is the bound on ``s+ + s-``; the extra slot per group
stands where the paper sends its column separator word. Slots form one
buffer for the whole array, so exact mode always fits (the counts are
float32 ceilings; should rounding of a non-integer ``pi`` ever exceed
the bound, the highest indices are dropped, never corrupted). Sampled
thresholds let a fluctuating number of entries through (the paper's
Figure 3 shows it), so sampled mode defaults to ``scale = 1.25``. When
more entries pass than the buffer holds, the entries of largest ``|v|``
in the whole array are kept (ties: lower index; a 31-pass bisection paid
only then) and the rest decode to 0 and stay in the error-feedback
residual.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qcollect._config import check_floating_input, require_key
from qcollect._payload import Compressor, Payload, check_format
from qcollect.checks import check_choice, check_float, check_int
from qcollect.coding._golomb import Coding, check_coding, decode_entries, encode_entries
from qcollect.coding._packing import pack_bits
from qcollect.coding._sparse import (
    MAX_SIZE,
    check_size,
    compact_largest,
    compact_words,
    header,
    header_count,
    magnitude_keys,
    scatter_decode,
    top_mask,
)
from qcollect.compressors._groups import (
    GroupLayout,
    Groups,
    bucket_or_column_groups,
    overflow_safe_scale,
    padding_mask,
    sample_within_groups,
    to_view,
    unscaled,
    with_valid,
)

__all__ = ["AdaptiveCompressor", "adaptive"]

#: Largest per-group send count for which exact thresholds come from top_k.
TOP_K_LIMIT = 256
#: Default slot multiplier with sampled thresholds (their counts fluctuate).
SAMPLED_CAPACITY_SCALE = 1.25


@dataclasses.dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class AdaptiveCompressor(Compressor):
    """What `adaptive` returns: a `Compressor` whose settings are typed fields.

    Attributes:
      proportion: ``pi``, the inverse of the fraction of each sign sent.
      sample: sampled entries per group, or None for exact thresholds.
      bucket_size: values per bucket (``grouping="bucket"``).
      capacity_scale: slots per group relative to ``ceil(c_g / pi)``.
      coding: ``"words"`` or ``"golomb_rice"``.
      rice_k: the Rice parameter, None for the automatic one.

    ``grouping``, a `Compressor` field, is its third setting.
    """

    proportion: float
    sample: int | None
    bucket_size: int
    capacity_scale: float
    coding: Coding
    rice_k: int | None

    setting_names: ClassVar[tuple[str, ...]] = (
        "proportion", "sample", "grouping", "bucket_size", "capacity_scale", "coding", "rice_k")


def adaptive(proportion: float = 64.0, *, sample: int | None = None,
             grouping: GroupLayout = "column",
             bucket_size: int = 512, capacity_scale: float | None = None,
             coding: Coding = "words", rice_k: int | None = None) -> AdaptiveCompressor:
    """Adaptive quantization: send the largest ``1/proportion`` of each sign per group.

    For each group (a column of the weight matrix, as in the paper, or a
    bucket), with ``k+`` non-negative and ``k-`` negative entries, the
    ``s+ = ceil(k+ / pi)`` largest non-negative and the ``s- = ceil(k- / pi)``
    most negative entries are sent ("we therefore want to send the largest
    k/pi of them"; footnote 1: the proportion is applied to each sign
    separately). They decode to the mean of the sent non-negative and of the
    sent negative entries of their group, two float32 per group, like
    one-bit quantization (section 3.1). Entries travel as the sparse words of
    threshold quantization (sign bit + 31-bit index) or Golomb-Rice coded
    (section 3.3: "amenable to delta coding and compression"). Error
    feedback lives in the optax layer. When more entries pass than the
    static slots hold, the largest ``|v|`` are sent and the rest stay in the
    residual (docs/compressors.md#adaptive-selection-and-capacity).

    Non-finite input sets a flag in the header word (a NaN is neither >= 0
    nor < 0 and would never be sent); decode then returns all NaN.

    Payload (``C`` slots, ``G`` groups): ``coding="words"`` sends
    ``4 * C + 4 + 8 * G`` bytes; ``"golomb_rice"`` replaces the ``4 * C``
    word bytes by the stream and sign words of `qcollect.threshold`.

    Args:
      proportion: ``pi >= 1``, the inverse of the fraction of each sign sent
        (the paper's benchmark uses 64).
      sample: None for exact thresholds and means, or ``m >= 1`` sampled
        entries per group (needs a key; the compressor is then stochastic).
      grouping: ``"column"`` (default, as the paper: the columns of
        `qcollect.matrix_view`, i.e. one output unit's weights of a Flax
        kernel) or ``"bucket"``.
      bucket_size: values per bucket, >= 1; used by ``grouping="bucket"``.
      capacity_scale: float >= 1, slots per group relative to
        ``ceil(c_g / pi)``; None: 1.0 exact, 1.25 sampled.
      coding: ``"words"`` or ``"golomb_rice"``.
      rice_k: Rice parameter 0..30 for ``"golomb_rice"`` (None: automatic).

    Returns:
      A non-linear `AdaptiveCompressor`; stochastic when ``sample`` is set.

    Raises:
      ValueError: a setting outside the values above.

    References:
      Dryden, Moon, Jacobs, Van Essen, `Communication Quantization for
      Data-parallel Training of Deep Neural Networks
      <https://doi.org/10.1109/MLHPC.2016.004>`_, MLHPC 2016, section 3.3
      and footnote 1 (3.1 for the means).

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> c = qc.adaptive(2)
      >>> c.decode(c.encode(jnp.array([4., 2., 1., -1., -3.])))
      Array([ 3.,  3.,  0.,  0., -3.], dtype=float32)
    """
    pi = check_float("proportion", proportion, low=1.0, low_inclusive=True)
    sample = check_int("sample", sample, low=1, allow_none=True)
    grouping = check_choice("grouping", grouping, ("column", "bucket"))
    bucket_size = check_int("bucket_size", bucket_size, low=1)
    rice_k = check_coding(coding, rice_k)
    if capacity_scale is None:
        capacity_scale = 1.0 if sample is None else SAMPLED_CAPACITY_SCALE
    scale = check_float("capacity_scale", capacity_scale, low=1.0, low_inclusive=True)
    name = f"adaptive/{pi!r}/{grouping}" + (f"/{bucket_size}" if grouping == "bucket" else "")
    name += f"/{coding}" + ("" if rice_k is None else f"/k{rice_k}")
    name += "" if sample is None else f"/sample{sample}"
    name += f"/cap{scale!r}"
    static: dict[str, Any] = {"name": name, "proportion": pi, "grouping": grouping,
                              "bucket_size": bucket_size, "capacity_scale": scale,
                              "coding": coding, "rice_k": rice_k}
    return AdaptiveCompressor(
        name, functools.partial(_encode, sample=sample, **static),
        functools.partial(_decode, **static), linear=False, stochastic=sample is not None,
        block=bucket_size if grouping == "bucket" else 1, grouping=grouping, masks_padding=True,
        proportion=pi, sample=sample, bucket_size=bucket_size, capacity_scale=scale,
        coding=coding, rice_k=rice_k)


def _capacity(groups: Groups, pi: float, scale: float) -> int:
    """Slots of the whole array: ``min(c_g, ceil(scale * ceil(c_g / pi)) + 1)`` per group."""
    per_side = np.ceil(groups.counts.astype(np.float32) / np.float32(pi)).astype(np.int64)
    slots = np.ceil(scale * per_side).astype(np.int64) + 1
    return int(np.minimum(groups.counts, slots).sum())


def _signed_keys(flat: jax.Array, groups: Groups) -> tuple[jax.Array, jax.Array]:
    """``(magnitude keys, their signed view)``: ``+key`` for ``v >= 0``, ``-key``
    for ``v < 0``, 0 for NaN and for padding (never a candidate)."""
    mag = magnitude_keys(flat)
    skeys = jnp.where(flat < 0, -mag, jnp.where(flat >= 0, mag, 0))
    kview = _int_view(skeys, groups)
    real = padding_mask(groups)
    if real is not None:  # zero padding marked by `valid` is never a candidate
        kview = jnp.where(real, kview, 0)
    return mag, kview


def _select(x: jax.Array, key: jax.Array | None, kview: jax.Array, mag: jax.Array,
            groups: Groups, cap: int, *, pi: float,
            sample: int | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Exact (`_exact`) or sampled (`_sampled_thresholds`) selection:
    ``(idx, count, means)`` of the entries sent."""
    if sample is None:
        sides = jnp.stack([jnp.maximum(kview, 0), jnp.maximum(-kview, 0)])
        mask, means = _exact(sides, groups, pi, x)
        idx, count = compact_words(pack_bits(mask[: x.size], 1), x.size, cap)
        return idx, count, means
    picks = sample_within_groups(to_view(x, groups), groups, key, sample)
    t_pos, t_neg, means = _sampled_thresholds(picks, pi)
    mask = (kview >= groups.expand(t_pos)) | (kview <= -groups.expand(t_neg))
    mask = mask.reshape(-1)[: x.size]
    idx, count = compact_largest(lambda: jnp.where(mask, mag, 0), x.size, cap)
    return idx, count, means


def _encode(x: jax.Array, key: jax.Array | None = None, *, valid: jax.Array | None = None,
            name: str, proportion: float, sample: int | None, grouping: GroupLayout,
            bucket_size: int, capacity_scale: float, coding: Coding,
            rice_k: int | None) -> Payload:
    x = jnp.asarray(x)
    check_floating_input(x)
    check_size(x.size)
    if sample is not None:
        require_key(key, "adaptive(sample=...)")
    groups = bucket_or_column_groups(x.shape, grouping, bucket_size)
    cap = _capacity(groups, proportion, capacity_scale)
    groups = with_valid(groups, valid)
    flat = jnp.ravel(x).astype(jnp.float32)
    mag, kview = _signed_keys(flat, groups)
    idx, count, means = _select(x, key, kview, mag, groups, cap, pi=proportion, sample=sample)
    positive = jnp.take(flat, idx, mode="clip") >= 0 if cap else jnp.zeros((0,), bool)
    arrays = encode_entries(coding, idx, count, positive, x.size, rice_k)
    arrays.update(header=header(count, flat), pos=means[0], neg=means[1])
    return Payload(arrays, tuple(x.shape), x.dtype, name)


def _decode(payload: Payload, *, name: str, proportion: float, grouping: GroupLayout,
            bucket_size: int, capacity_scale: float, coding: Coding,
            rice_k: int | None) -> jax.Array:
    """Each sent entry as the mean of its group and sign; 0 elsewhere."""
    check_format(payload, name)
    groups = bucket_or_column_groups(payload.shape, grouping, bucket_size)
    size = math.prod(payload.shape)
    count = header_count(payload["header"])
    idx, positive = decode_entries(coding, payload.arrays, count, size,
                                   _capacity(groups, proportion, capacity_scale), rice_k)
    if groups.axis == 0:
        group = idx % max(groups.view[1], 1)
    else:
        group = idx // bucket_size
    group = jnp.minimum(group, max(groups.num_groups - 1, 0))
    if groups.num_groups:
        values = jnp.where(positive, payload["pos"][group], payload["neg"][group])
    else:
        values = jnp.zeros(idx.shape, jnp.float32)
    flat = scatter_decode(payload["header"], size, idx, values)
    return flat.reshape(payload.shape).astype(payload.dtype)


def _int_view(keys: jax.Array, groups: Groups) -> jax.Array:
    """Flat int32 keys in the groups' 2-D view, padding keys 0 (never sent)."""
    pad = groups.padded_size - groups.size
    if pad:
        keys = jnp.pad(keys, (0, pad))
    return keys.reshape(groups.view)


def _exact(sides: jax.Array, groups: Groups, pi: float,
           x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per group and sign, the ``ceil(count / pi)`` largest ``|v|``; their means.

    Args:
      sides: ``(2, *view)`` keys of the non-negative and of the negative
        entries (`magnitude_keys`, 0 elsewhere and in padding).
      groups: the grouping.
      pi: the proportion.
      x: the input, for the means.

    Returns:
      ``(mask, means)``: flat bool mask over the padded view, ``(2, G)`` means.

    When at most ``TOP_K_LIMIT`` entries per group can be sent (the paper's
    ``pi = 64`` on columns of up to 16K rows), `lax.top_k` on the magnitudes
    of a group-major copy gives the entries and their values directly (it
    returns equal values lower index first). Otherwise the thresholds come
    from the 31-step bisection on integer keys of the sparse coding
    (``top_mask``). Ties go to the lower index either way.
    """
    axis = 1 + groups.axis
    cand = jnp.sum(sides > 0, axis=axis, dtype=jnp.int32)  # (2, G)
    k = _per_side(cand, pi)
    length = groups.view[groups.axis]
    k_max = min(length, int(np.ceil(np.float32(length) / np.float32(pi))))
    signs = jnp.array([1.0, -1.0], jnp.float32)[:, None]
    if k_max == 0:
        return jnp.zeros((groups.padded_size,), bool), jnp.zeros((2, groups.num_groups))
    if k_max > TOP_K_LIMIT:
        sent = top_mask(sides, jnp.expand_dims(k, axis), axis)
        c = overflow_safe_scale(length)  # sums of any float32 stay finite
        sums = jnp.sum(to_view(x, groups) * c * sent, axis=axis)  # same-shape product
        means = unscaled(sums / jnp.maximum(jnp.sum(sent, axis=axis, dtype=jnp.int32), 1), c)
        return (sent[0] | sent[1]).reshape(-1), means
    major = sides if groups.axis == 1 else jnp.swapaxes(sides, 1, 2)
    # Float magnitudes (_backend.TOP_K_ON_FLOATS): key - 1 is the bit
    # pattern of |v|; non-candidates become -1.
    mags = jnp.where(major > 0, lax.bitcast_convert_type(major - 1, jnp.float32), -1.0)
    top, pos = lax.top_k(mags, k_max)  # (2, G, k_max), largest first
    take = jnp.arange(k_max) < k[:, :, None]
    c = overflow_safe_scale(k_max)
    means = signs * unscaled(jnp.sum(jnp.where(take, top * c, 0.0), axis=2) / jnp.maximum(k, 1), c)
    group = jnp.arange(groups.num_groups)[:, None]
    if groups.axis == 1:
        flat = group * groups.view[1] + pos
    else:
        flat = pos * groups.view[1] + group
    flat = jnp.where(take, flat, groups.padded_size).reshape(-1)
    mask = jnp.zeros((groups.padded_size,), bool).at[flat].set(True, mode="drop")
    return mask, means


def _per_side(count: jax.Array, pi: float) -> jax.Array:
    """``ceil(count / pi)`` in float32, the number sent of a side with ``count`` entries."""
    return jnp.ceil(count.astype(jnp.float32) / jnp.float32(pi)).astype(jnp.int32)


def _sampled_thresholds(picks: jax.Array,
                        pi: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Key thresholds and means per group from ``(G, m)`` samples (section 3.3).

    Returns ``(t_pos, t_neg, means)``: int32 keys with ``v >= 0`` sent when its
    key is ``>= t_pos`` and ``v < 0`` when ``-key <= -t_neg``, and the
    ``(2, G)`` means of the samples at or beyond the thresholds.
    """
    m = picks.shape[-1]
    # s <= k_max for every group, so a small top_k replaces a sort of the sample.
    k_max = min(m, max(1, int(np.round(np.float32(m) / np.float32(pi)))))
    rows = []
    for side in (picks >= 0, picks < 0):
        m_side = jnp.sum(side, axis=-1, dtype=jnp.int32)
        # Nearest rather than ceil: the s-th largest of m samples estimates the
        # s/m quantile, and ceil would double the volume when m / pi is ~1.
        s = jnp.maximum(jnp.round(m_side / jnp.float32(pi)), 1).astype(jnp.int32)
        top = lax.top_k(jnp.where(side, jnp.abs(picks), -1.0), k_max)[0]  # magnitudes
        take = jnp.arange(k_max) < s[:, None]
        tau = jnp.take_along_axis(top, (s - 1)[:, None], axis=-1)[:, 0]
        c = overflow_safe_scale(k_max)
        mean = unscaled(jnp.sum(jnp.where(take, top * c, 0.0), axis=-1) / s, c)
        key = jnp.where(m_side > 0, magnitude_keys(tau), MAX_SIZE)
        rows.append((key, jnp.where(m_side > 0, mean, 0.0)))
    (t_pos, mean_pos), (t_neg, mean_neg) = rows
    return t_pos, t_neg, jnp.stack([mean_pos, -mean_neg])
