"""What the collectives take and return: `AxisName` and `AllReduceResult`."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple, TypeAlias

__all__ = ["AllReduceResult", "AxisName"]

#: A mapped axis of ``jax.shard_map`` or ``jax.pmap`` (a mesh axis name), or
#: a tuple of them taken together.
AxisName: TypeAlias = Hashable


class AllReduceResult(NamedTuple):
    """What `compressed_all_reduce` returns.

    Attributes:
      value: the estimate of the sum (or mean) over devices, like ``x``.
      contributed: what this device's own encodings decode to, like ``x``; for
        error feedback keep ``x - contributed``.
      owner_error: ``"pairwise"`` only (else None): like ``x``, zero outside
        the chunk this device owns, and there the owner's re-encoding error
        ``reduced - decode(encode(reduced))`` (in sum units). Pass it back as
        ``owner_residual`` next step for two-level error feedback.

    The steps inside (one segment, one bucket, one class of buckets) return
    the same three fields for their own chunks, stacked per device.
    """

    value: Any
    contributed: Any
    owner_error: Any
