"""Groups of values that share one scale or one pair of means.

Two layouts, both static in shape:

* buckets (Grubic et al., "reshaped" 1bitSGD* and QSGD bucketing, seed 001
  section 3.2.2): the array is flattened row-major and cut into buckets of
  ``bucket_size`` consecutive values; the last one is zero-padded. Reductions
  run along axis 1 of a ``(num_buckets, bucket_size)`` view.
* columns (CNTK 1bitSGD, seed 001 section 3.2.1; Dryden et al. section 3.1):
  the last dimension indexes the columns and the others are flattened into
  rows (`matrix_view`), so a ``(rows, cols)`` view is reduced along axis 0
  with no transpose. For a Flax ``Dense`` kernel ``(in, out)`` and a conv
  kernel ``(kh, kw, in, out)`` a column holds all the weights into one output
  unit. A vector is one column; a scalar is a 1x1 matrix.

Counts of real values per group are static (numpy) for a whole array, or an
int32 array when a collective passes ``valid`` counts (a leaf's last bucket
and padding chunks hold zero padding after their real values).
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qcollect.compressors._random import hash_bits

#: The two layouts a compressor with per-group statistics chooses between.
GroupLayout = Literal["bucket", "column"]


class Groups(NamedTuple):
    """A static grouping of ``size`` values.

    Attributes:
      view: shape of the 2-D view that holds the (padded) values.
      axis: the axis of ``view`` that is reduced within a group.
      size: number of real values.
      counts: real values per group (padding excluded): a numpy int array,
        or an int32 array from `with_valid`.
    """

    view: tuple[int, int]
    axis: int
    size: int
    counts: np.ndarray | jax.Array

    @property
    def num_groups(self) -> int:
        return self.view[1 - self.axis]

    @property
    def padded_size(self) -> int:
        return self.view[0] * self.view[1]

    def expand(self, per_group: jax.Array) -> jax.Array:
        """Broadcasts a ``(num_groups,)`` array against the 2-D view."""
        return jnp.expand_dims(per_group, self.axis)


def bucket_groups(shape: tuple[int, ...], bucket_size: int | None) -> Groups:
    """Buckets of ``bucket_size`` consecutive values (None: one bucket)."""
    size = math.prod(shape)
    length = max(size, 1) if bucket_size is None else bucket_size
    num = -(-size // length)
    counts = np.full(num, length, np.int64)
    if num:
        counts[-1] = size - (num - 1) * length
    return Groups(view=(num, length), axis=1, size=size, counts=counts)


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, cols)`` of an array's matrix view: the last axis is the columns.

    A vector is one column, a scalar a 1x1 matrix; higher ranks flatten every
    axis but the last into rows (channels-last, as Flax lays out kernels), so
    a column of a Dense kernel ``(in, out)`` or a conv kernel
    ``(kh, kw, in, out)`` holds all the weights into one output unit. The
    compressors with ``grouping="column"`` (`qcollect.onebit`,
    `qcollect.adaptive`) compute one statistic per column of this view, as
    CNTK's 1-bit SGD does per column of a weight matrix. The same view is
    PowerSGD's default (`qcollect.powersgd_matrix_shape`).

    Args:
      shape: the array's shape.

    Returns:
      ``(rows, cols)``, a row-major reshape of the array.

    References:
      Dryden et al., MLHPC 2016, section 3.1; Grubic et al., EDBT 2018,
      section 3.2.1.

    Example:
      >>> import qcollect as qc
      >>> qc.matrix_view((3, 3, 16, 32)), qc.matrix_view((10,)), qc.matrix_view(())
      ((144, 32), (10, 1), (1, 1))
    """
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], 1
    return math.prod(shape[:-1]), shape[-1]


def column_groups(shape: tuple[int, ...]) -> Groups:
    """CNTK columns of `matrix_view`: one group per column."""
    rows, cols = matrix_view(shape)
    return Groups(view=(rows, cols), axis=0, size=rows * cols,
                  counts=np.full(cols, rows, np.int64))


def bucket_or_column_groups(shape: tuple[int, ...], grouping: GroupLayout,
                            bucket_size: int) -> Groups:
    """`bucket_groups` for ``grouping="bucket"``, else `column_groups`."""
    return bucket_groups(shape, bucket_size) if grouping == "bucket" else column_groups(shape)


def with_valid(groups: Groups, valid: jax.Array | None) -> Groups:
    """``groups`` with traced real counts per group (None: unchanged)."""
    if valid is None:
        return groups
    valid = jnp.asarray(valid, jnp.int32).reshape(-1)
    if valid.shape != (groups.num_groups,):
        raise ValueError(f"valid must hold one count per group ({groups.num_groups}), "
                         f"got shape {valid.shape}")
    return groups._replace(counts=valid)


def overflow_safe_scale(length: int) -> float:
    """A power of two ``c`` with ``length * c <= 1/2``.

    Summing up to ``length`` values each times ``c`` cannot overflow float32
    whatever their size (the sum stays within half the float32 maximum), and
    scaling by ``c`` and back by ``1 / c`` is exact (barring underflow below
    ``2**-126 / c``): so group statistics of finite input stay finite over
    the whole float32 range.
    """
    return 2.0 ** -(max(int(length) - 1, 0).bit_length() + 1)


_F32_MAX = float(np.finfo(np.float32).max)


def unscaled(mean: jax.Array, c: float) -> jax.Array:
    """``mean / c`` for a mean of values times `overflow_safe_scale` ``c``,
    saturating at the float32 maximum.

    A mean of finite values lies within their range, but the rounding of the
    scaled sum and of the division can put it an ulp beyond ``F32_MAX * c``
    (a side whose values all are ``+-F32_MAX``), and scaling back would turn
    that into inf. Finite means therefore stay within ``+-F32_MAX``; a
    non-finite ``mean`` (from non-finite input) stays as it is.
    """
    out = mean / c
    return jnp.where(jnp.isfinite(mean), jnp.clip(out, -_F32_MAX, _F32_MAX), out)


def group_sums(view: jax.Array, groups: Groups, scale: float = 1.0) -> jax.Array:
    """``(num_groups,)`` float32 sums of the view within each group, times ``scale``
    (`overflow_safe_scale` keeps them finite).

    A product with a vector of ones (at full float32 precision) rather than a
    sum reduction, which XLA:CPU fused with the broadcast of its result and
    wrote out in full (`_backend.REDUCTION_INPUTS_WRITTEN`; measured in
    docs/compressors.md#one-bit-encoding-in-one-pass).
    """
    ones = jnp.full((groups.view[groups.axis],), scale, jnp.float32)
    if groups.axis == 1:
        return jnp.matmul(view, ones, precision=jax.lax.Precision.HIGHEST)
    return jnp.matmul(ones, view, precision=jax.lax.Precision.HIGHEST)


def padding_mask(groups: Groups) -> jax.Array | None:
    """Bool view, True on real values: None when counts are static (no padding
    inside the view but the tail, which `to_view` zero-fills)."""
    if isinstance(groups.counts, np.ndarray):
        return None
    length = groups.view[groups.axis]
    position = jnp.arange(length, dtype=jnp.int32)
    return jnp.expand_dims(position, 1 - groups.axis) < groups.expand(groups.counts)


def to_view(x: jax.Array, groups: Groups) -> jax.Array:
    """Flattens ``x`` into the 2-D view in float32, zero-padding the tail."""
    flat = jnp.ravel(x).astype(jnp.float32)
    pad = groups.padded_size - groups.size
    if pad:
        flat = jnp.pad(flat, (0, pad))
    return flat.reshape(groups.view)


def from_view(view: jax.Array, groups: Groups, shape: tuple[int, ...],
              dtype: Any) -> jax.Array:
    """Inverse of `to_view`: strips padding, restores shape and dtype."""
    return view.reshape(-1)[: groups.size].reshape(shape).astype(dtype)


def flat_codes(view_codes: jax.Array, groups: Groups) -> jax.Array:
    """Codes of the real values, flattened (padding dropped before packing)."""
    return view_codes.reshape(-1)[: groups.size]


def view_codes(codes: jax.Array, groups: Groups) -> jax.Array:
    """Unpacked flat codes back into the 2-D view (padding codes are 0)."""
    pad = groups.padded_size - groups.size
    if pad:
        codes = jnp.pad(codes, (0, pad))
    return codes.reshape(groups.view)


def sample_within_groups(view: jax.Array, groups: Groups, key: jax.Array,
                         m: int) -> jax.Array:
    """``(num_groups, m)`` entries drawn uniformly, with replacement, per group."""
    if groups.size == 0:
        return jnp.zeros((groups.num_groups, m), jnp.float32)
    counts = jnp.maximum(jnp.asarray(groups.counts), 1).astype(jnp.uint32)[:, None]
    within = hash_bits(key, (groups.num_groups, m)) % counts
    group = jnp.arange(groups.num_groups, dtype=jnp.uint32)[:, None]
    width = jnp.uint32(view.shape[1])
    flat = group * width + within if groups.axis == 1 else within * width + group
    return view.reshape(-1)[flat]
