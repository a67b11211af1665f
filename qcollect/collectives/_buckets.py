"""Equal buckets batched: one traced copy of the per-bucket work per shape.

The layout cuts a pytree into segments and each segment into buckets of
whole compressor groups (`Segment.parts`). Buckets of equal layout -- the
full buckets of a fused segment, or leaves of one shape reduced on their
own -- form a *class*: their chunks are stacked and the per-bucket
collective runs once over the stack, batched with `jax.vmap` (every
collective moves the class's payloads in one message per hop). The program
therefore holds one copy of the algorithm per class, not per bucket: its
compile time stays flat as the model grows (``python -m qcollect.bench
compile``).

Why a batch: across processes every hop of a class is one message instead
of one per bucket, so the collectives' fixed costs are paid once per class.
What it costs: the class's buckets are copied into one stack and its
intermediates are held at once (more scratch memory than the traced
program), and in one process, where a hop costs little, the copy is not
repaid. A `lax.map` loop over the buckets was slower still and needed more
scratch memory, not less. The measurements are in
docs/collectives.md#batch-or-trace.

What still grows with the model is per leaf: each output leaf is its own
kernel, a slice of the class's result with the decode fused in. The slices
start at runtime offsets (`runtime_slices`,
`_backend.CONSTANT_OFFSETS`), so the kernels of the leaves of one shape
are one program and XLA generates its code once; the optimised HLO text
still prints every leaf's copy.

When a class runs as a batch (`runs_batched`, ``batch_buckets``): with
the default ``"auto"`` (`BATCH_BUCKETS`), a class of buckets of at most
`AUTO_BATCH_BYTES` (4 MiB: the full buckets of fused leaves, and leaves up
to that size reduced alone) runs as one batch, and a class of larger
buckets (large leaves reduced alone) is traced once per bucket unless it
has more than `AUTO_TRACE_LIMIT` of them: the batch saves each hop's fixed
cost per bucket but copies its buckets into one stack.
``"always"`` batches every class of two or more buckets, ``"never"``
traces every bucket, and an int ``K`` batches the classes of more than
``K`` buckets; a single bucket is always traced.

Randomness: a segment of one bucket uses ``fold_in(key, segment)`` as it
always did; bucket ``b`` of a longer segment uses
``fold_in(fold_in(key, segment), b)``, so no two buckets share a stream,
batched or traced.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np

from qcollect.collectives._layout import BUCKET_BYTES
from qcollect.collectives._offsets import runtime_slices
from qcollect.collectives._result import AllReduceResult
from qcollect.collectives._segments import Segment

__all__ = ["AUTO_BATCH_BYTES", "AUTO_TRACE_LIMIT", "BATCH_BUCKETS", "BatchBuckets",
           "ReduceBucket", "check_batch_buckets", "reduce_buckets", "runs_batched"]

#: The values of ``batch_buckets`` besides an int ``K`` (batch the classes of
#: more than ``K`` buckets).
BatchBuckets = Literal["auto", "always", "never"] | int
#: The default ``batch_buckets``: batch by bucket size (`runs_batched`).
BATCH_BUCKETS: BatchBuckets = "auto"
#: ``"auto"``: classes of buckets of at most this many bytes run as one batch.
AUTO_BATCH_BYTES = BUCKET_BYTES
#: ``"auto"``: larger buckets are traced one by one up to this many per class.
AUTO_TRACE_LIMIT = 16

_BATCH_WORDS = ("auto", "always", "never")


class ReduceBucket(Protocol):
    """``(data, valid, residual, *, key, layout) -> AllReduceResult``: one
    bucket's collective (`reduce_buckets`)."""

    def __call__(self, data: jax.Array, valid: Any, residual: jax.Array | None, /, *,
                 key: jax.Array | None, layout: Segment) -> AllReduceResult: ...


def check_batch_buckets(value: object, name: str = "batch_buckets") -> BatchBuckets:
    """``value`` as a ``batch_buckets`` setting: ``"auto"``, ``"always"``,
    ``"never"`` or an int >= 0."""
    if isinstance(value, str) and value in _BATCH_WORDS:
        return cast(BatchBuckets, value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be 'auto', 'always', 'never' or an integer >= 0, "
                         f"got {value!r}")
    return int(value)


def runs_batched(count: int, bucket_bytes: int, batch_buckets: BatchBuckets = BATCH_BUCKETS
                 ) -> bool:
    """Whether a class of ``count`` equal buckets of ``bucket_bytes`` bytes
    each runs as one batch (`jax.vmap` over its buckets) rather than traced
    once per bucket.

    Args:
      count: buckets (or leaves of one shape) in the class; one is never
        batched.
      bucket_bytes: bytes of one bucket, all devices' chunks together.
      batch_buckets: ``"auto"`` (default, `BATCH_BUCKETS`): batch buckets of
        at most `AUTO_BATCH_BYTES`, and larger ones when there are more than
        `AUTO_TRACE_LIMIT`; ``"always"``: batch; ``"never"``: trace each
        bucket; an int ``K``: batch more than ``K`` buckets.

    Example:
      >>> import qcollect as qc
      >>> mib = 1 << 20
      >>> qc.runs_batched(16, 4 * mib), qc.runs_batched(2, 16 * mib)
      (True, False)
      >>> qc.runs_batched(2, 16 * mib, "always"), qc.runs_batched(17, 16 * mib)
      (True, True)
      >>> qc.runs_batched(16, 4 * mib, "never"), qc.runs_batched(3, 4 * mib, 2)
      (False, True)
    """
    batch_buckets = check_batch_buckets(batch_buckets)
    if count < 2 or batch_buckets == "never":
        return False
    if batch_buckets == "always":
        return True
    if batch_buckets == "auto":
        return bucket_bytes <= AUTO_BATCH_BYTES or count > AUTO_TRACE_LIMIT
    return count > batch_buckets


class _Run(NamedTuple):
    """``buckets`` equal buckets of segment ``segment``, its `parts` entry ``part``."""

    segment: int
    part: int
    first: int
    buckets: int


def _bucket_key(key: jax.Array | None, segment: int | jax.Array, bucket: int | jax.Array,
                single: bool | np.bool_ | jax.Array) -> jax.Array | None:
    """The key of one bucket: ``fold_in(key, segment)``, folded again with
    ``bucket`` unless its segment is a single bucket. Static (ints) in an
    unrolled class, traced in a batch. None for no key."""
    if key is None:
        return None
    key = jax.random.fold_in(key, segment)
    if isinstance(single, (bool, np.bool_)):
        return key if single else jax.random.fold_in(key, bucket)
    folded = jax.random.fold_in(key, bucket)
    return jax.random.wrap_key_data(
        jnp.where(single, jax.random.key_data(key), jax.random.key_data(folded)),
        impl=jax.random.key_impl(key))


def _joined(arrays: Sequence[jax.Array]) -> jax.Array:
    return arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays)


class _Inputs(NamedTuple):
    """Per segment index: its buckets' data, valid counts and owner residual,
    each a list with one stacked array per `Segment.parts` entry, or None."""

    data: dict[int, list[jax.Array]]
    valid: dict[int, list[np.ndarray] | None]
    residual: dict[int, list[jax.Array] | None]

    def of_run(self, run: _Run) -> tuple[Any, ...]:
        """A run's stacked data, valid counts and residual (None where absent)."""
        parts = (inputs[run.segment] for inputs in self)
        return tuple(None if part is None else part[run.part] for part in parts)


#: A class of equal buckets: the layout of one bucket (`Segment.layout`), and
#: whether its buckets come without valid counts.
_Class = tuple[Segment, bool]


def _classes(segments: list[Segment], leaves: Sequence[Any], owners: Sequence[Any] | None,
             masks_padding: bool) -> tuple[dict[_Class, list[_Run]], _Inputs]:
    """``(classes, inputs)``: the runs of equal buckets grouped by layout, and
    the `_Inputs` they read."""
    classes: dict[_Class, list[_Run]] = {}
    inputs = _Inputs({}, {}, {})
    for i, seg in enumerate(segments):
        if seg.length == 0:
            continue
        inputs.data[i] = seg.bucketed(leaves)
        inputs.valid[i] = seg.bucket_valid() if masks_padding else None
        inputs.residual[i] = None if owners is None else seg.bucketed(owners)
        first = 0
        for p, (count, per_chunk) in enumerate(seg.parts):
            signature = (seg.layout(per_chunk), inputs.valid[i] is None)
            classes.setdefault(signature, []).append(_Run(i, p, first, count))
            first += count
    return classes, inputs


def _stacked(results: list[AllReduceResult]) -> AllReduceResult:
    """The buckets' results stacked field by field (a None field stays None)."""
    return AllReduceResult(*(None if field[0] is None else jnp.stack(field)
                             for field in zip(*results, strict=True)))


def _traced(runs: list[_Run], inputs: _Inputs, segments: list[Segment], key: jax.Array | None,
            reduce_bucket: ReduceBucket,
            layout: Segment) -> dict[tuple[int, int], AllReduceResult]:
    """Each bucket of ``runs`` traced on its own, straight from its run's
    buckets, with static keys and valid counts: ``{(segment, part): result}``."""
    results = {}
    for r in runs:
        single = segments[r.segment].buckets == 1
        outs = []
        for b in range(r.buckets):
            data, valid, residual = (None if a is None else a[b] for a in inputs.of_run(r))
            outs.append(reduce_bucket(data, valid, residual,
                                      key=_bucket_key(key, r.segment, r.first + b, single),
                                      layout=layout))
        results[r.segment, r.part] = _stacked(outs)
    return results


def _batched(runs: list[_Run], inputs: _Inputs, segments: list[Segment], key: jax.Array | None,
             reduce_bucket: ReduceBucket,
             layout: Segment) -> dict[tuple[int, int], AllReduceResult]:
    """The buckets of ``runs`` as one `jax.vmap` batch: ``{(segment, part): result}``."""
    index = np.array([(r.segment, r.first + b, segments[r.segment].buckets == 1)
                      for r in runs for b in range(r.buckets)], np.int32)
    stacked = [inputs.of_run(r) for r in runs]
    xs = tuple(None if column[0] is None
               else (np.concatenate(column) if isinstance(column[0], np.ndarray)
                     else _joined(column))
               for column in zip(*stacked, strict=True))

    def body(xs_and_index: tuple[tuple[Any, ...], tuple[jax.Array, ...]]) -> AllReduceResult:
        (data_b, valid_b, residual_b), (segment, bucket, single) = xs_and_index
        return reduce_bucket(data_b, valid_b, residual_b,
                             key=_bucket_key(key, segment, bucket, single), layout=layout)

    out = jax.vmap(body)((xs, tuple(jnp.asarray(index.T))))
    firsts = np.cumsum([0] + [r.buckets for r in runs[:-1]])
    counts = [r.buckets for r in runs]
    # Runtime starts, so that the runs' consumers share kernels (_backend.CONSTANT_OFFSETS).
    cut = [None if a is None else [a] if len(runs) == 1 else runtime_slices(a, firsts, counts)
           for a in out]
    return {(r.segment, r.part): AllReduceResult(*(None if c is None else c[i] for c in cut))
            for i, r in enumerate(runs)}


def reduce_buckets(segments: list[Segment], leaves: Sequence[Any],
                   owners: Sequence[Any] | None, *, key: jax.Array | None,
                   masks_padding: bool, reduce_bucket: ReduceBucket,
                   batch_buckets: BatchBuckets = BATCH_BUCKETS) -> list[AllReduceResult]:
    """Runs ``reduce_bucket`` on every bucket of every segment, once per class.

    Args:
      segments: `plan_segments` of ``leaves``.
      leaves: the arrays.
      owners: arrays laid out like ``leaves`` (the owner residual), or None.
      key: this device's PRNG key, or None: ``reduce_bucket`` gets None.
      masks_padding: pass each bucket's valid counts (`Segment.bucket_valid`).
      reduce_bucket: ``(data, valid, residual, *, key, layout) ->
        AllReduceResult`` for one bucket: ``data`` and ``residual`` as
        `Segment.laid_out` of the bucket ``layout``, results stacked
        ``(n, *chunk_shape)`` (``owner_error`` may be None).
      batch_buckets: `runs_batched`: which classes run as one
        batch.

    Returns:
      Per segment an `AllReduceResult` whose fields are lists with one
      ``(count, n, *chunk_shape)`` array per `Segment.parts` entry (for
      `Segment.unbucketed`), or None; empty segments get None fields.
    """
    classes, inputs = _classes(segments, leaves, owners, masks_padding)
    results: dict[tuple[int, int], AllReduceResult] = {}
    for (layout, _), runs in classes.items():
        nbytes = layout.n * math.prod(layout.chunk_shape) * np.dtype(layout.dtype).itemsize
        batched = runs_batched(sum(r.buckets for r in runs), nbytes, batch_buckets)
        run = _batched if batched else _traced
        results.update(run(runs, inputs, segments, key, reduce_bucket, layout))
    reduced = []
    for i, seg in enumerate(segments):
        if seg.length == 0:
            reduced.append(AllReduceResult(None, None, None))
            continue
        parts = [results[i, p] for p in range(len(seg.parts))]
        reduced.append(AllReduceResult(*(None if field[0] is None else list(field)
                                         for field in zip(*parts, strict=True))))
    return reduced
