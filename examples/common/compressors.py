"""The gradient all-reduce of each compressor name, as an optax transformation.

`communication(name, cfg, axis_name, key)` returns a `Communication`: the
transformation that turns each device's gradients into the mean gradient
(chained before the optimizer), and what the training loop needs to know
about it (whether it switches phases and on which steps, whether it needs
entropy plans).

=============  ==============================================================
name           all-reduce
=============  ==============================================================
none           ``qc.fused_psum(mean=True)``: ``lax.pmean`` in 4 MiB buckets
bf16-psum      the same of the gradients cast to bfloat16 (no error
               feedback): a 16-bit all-reduce as a user writes it, the
               uncompressed-transport reference (XLA:CPU sums it as float32)
bf16           `transforms.compressed_all_reduce` with ``qc.cast("bfloat16")``
onebit         ... ``qc.onebit()`` (Seide, 64-value buckets, Grubic's 1bitSGD*)
onebit-column  ... ``qc.onebit(grouping="column")`` (Seide/CNTK, means per column)
threshold      ... ``qc.threshold(tau)`` (Strom, Dryden 3.2)
adaptive       ... ``qc.adaptive(proportion, sample=256)`` (Dryden 3.3, sampled)
qsgd-b         ... ``qc.qsgd(bits=b)`` (Grubic eq. 1, default buckets)
entropy[-c]    ... ``qc.entropy(floor=c)`` with host-side plans (Oland & Raj)
powersgd       `transforms.powersgd` (Vogels et al.)
gradiveq       `transforms.gradiveq` (Yu et al.)
local          no all-reduce: each device steps on its own gradient (the
               step's compute alone, to time what the all-reduce adds; the
               replicas drift apart, so its loss means nothing)
=============  ==============================================================

All but ``none`` and ``bf16-psum`` keep error feedback; compressed_all_reduce leaves with fewer
than ``cfg.min_size`` values (biases) are averaged uncompressed.
`compressed_leaves` says which leaves each name compresses.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import qcollect as qc
import transforms
from common.config import COMPUTE_ONLY, ERROR_FEEDBACK, MODEL_AXIS_COMPRESSORS, PSUM_BF16


class Communication(NamedTuple):
    """A gradient all-reduce and how the training loop should drive it.

    Attributes:
      tx: the optax transformation (mean gradient over the data axis).
      phased: it switches phases with ``lax.cond`` (exact, lead-in,
        sampling, compressed), so wire bytes differ per phase.
      entropy: the entropy compressor when the step needs host-side plans
        (`examples.common.entropy_plan`), else None.
      replicated: the update is the same on every device (False only for
        ``local``, which reduces nothing).
      compressor, key: the compressor and key of ``tx`` where it is one of
        `MOMENTUM_COMPRESSORS`: what an optimizer that all-reduces inside
        (`common.train.InOptimizer`) takes instead of ``tx``.
      phases: ``phases(steps)``: which steps of a run fall in which phase,
        a tuple of `transforms.PhaseSpan` under the names the
        transformation marks its branches with (`qcollect.phase`): the
        ``spans`` of the schedule the transformation itself runs
        (`phases_of`), so that `qcollect.wire_bytes_by_phase` of the step
        prices each; None for an all-reduce of one phase.
    """

    tx: optax.GradientTransformation
    phased: bool = False
    entropy: qc.EntropyCompressor | None = None
    replicated: bool = True
    phases: Callable[[int], tuple] | None = None
    compressor: qc.Compressor | None = None
    key: jax.Array | None = None


def pmean(axis_name, block_specs=None) -> optax.GradientTransformation:
    """The uncompressed baseline: the mean of every gradient leaf, in buckets
    of 4 MiB (`qc.fused_psum`, as PyTorch DDP buckets gradients): the values
    and bytes of ``lax.pmean``, one exchange per bucket instead of one per
    leaf (per model block with ``block_specs``, `common.model_axes`)."""

    def update(grads, state, params=None):
        del params
        return qc.fused_psum(grads, axis_name, mean=True, block_specs=block_specs), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def gradiveq_slice_size(leaf_shape, *, min_slice: int) -> int | None:
    """GradiVeQ's slice size K for one kernel, at least ``min_slice`` values.

    Section 3 ("Slice size K") takes K a multiple of ``F * D`` for a conv
    kernel ``(H, W, D, F)``, so that the ``F`` collocated gradients of all
    filters stay together (Fig. 3a). `transforms.gradiveq` has one static
    rank cap ``r`` for all leaves, and the compression is ``K / r``; so that
    every kernel is compressed about ``min_slice / r`` times, K is the
    smallest multiple of ``F * D`` reaching ``min_slice`` when ``F * D`` is at
    most ``min_slice``, and otherwise the smallest multiple of ``F`` (whole
    groups of collocated gradients still). Dense kernels ``(in, F)`` use
    ``F``. None for vectors and kernels smaller than one slice.
    """
    if len(leaf_shape) < 2:
        return None
    width = leaf_shape[-1]
    base = width * leaf_shape[-2] if len(leaf_shape) >= 4 else width
    if base > min_slice:
        base = width
    k = base * -(-min_slice // base)
    return k if k <= math.prod(leaf_shape) else None


#: Each name of ``--error-feedback`` and the strategy it makes.
_FEEDBACK = dict(zip(ERROR_FEEDBACK, (transforms.residual_feedback, transforms.ef21),
                     strict=True))


def feedback(setting: str | bool):
    """The error-feedback strategy a setting names, the value the
    transformations take as ``error_feedback``: a name of ``--error-feedback``
    (``residual``: `transforms.residual_feedback()`, ``ef21``:
    `transforms.ef21()`), or the true/false of ``--gradiveq-error-feedback``
    and ``--fsdp-error-feedback`` (the residual, or None: no error feedback).

    Example:
      >>> feedback("ef21") == transforms.ef21() and feedback(False) is None
      True
    """
    if isinstance(setting, bool):
        return transforms.residual_feedback() if setting else None
    return _FEEDBACK[setting]()


def compress_after_of(cfg) -> transforms.CompressAfter:
    """The schedule of ``cfg``'s first steps: ``cfg.compress_after`` of them,
    through ``cfg.warm_up_compressor`` (none: exact).

    Example:
      >>> from lm.config import Config
      >>> compress_after_of(Config(compressors=("qsgd-4",), compress_after=60,
      ...                          warm_up_compressor="bf16")).first
      'lead-in'
    """
    warm = cfg.warm_up_compressor
    return transforms.CompressAfter(cfg.compress_after,
                                    warm_up=None if warm == "none" else _COMPRESSORS[warm](cfg))


def zero_one_schedule(cfg) -> transforms.ZeroOneSchedule:
    """0/1 Adam's schedule of ``cfg`` (``zero_one_freeze`` and the spacings).

    Example:
      >>> from lm.config import Config
      >>> zero_one_schedule(Config(optimizer="zero-one-adam", compressors=("onebit",),
      ...                          zero_one_freeze=120)).local_steps
      16
    """
    low = None if cfg.zero_one_refresh == "none" else _COMPRESSORS[cfg.zero_one_refresh](cfg)
    return transforms.ZeroOneSchedule(cfg.zero_one_freeze, cfg.zero_one_refreshes,
                                      cfg.zero_one_local_steps, cfg.zero_one_syncs, low)


def _compressed(compressor, cfg, axis_name, key, **kwargs) -> optax.GradientTransformation:
    return transforms.compressed_all_reduce(axis_name, compressor=compressor, key=key,
                                            min_size=cfg.min_size, exchange=cfg.exchange,
                                            error_feedback=feedback(cfg.error_feedback),
                                            mask_zero_rows=cfg.mask_zero_rows, **kwargs)


def pmean_bf16(axis_name, block_specs=None) -> optax.GradientTransformation:
    """`pmean` of the gradients cast to bfloat16, cast back to their dtypes."""

    def update(grads, state, params=None):
        del params
        half = jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads)
        mean = qc.fused_psum(half, axis_name, mean=True, block_specs=block_specs)
        return jax.tree.map(lambda m, g: m.astype(g.dtype), mean, grads), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def communication(name: str, cfg, axis_name, key, block_specs=None) -> Communication:
    """The `Communication` for compressor ``name`` with the settings of ``cfg``:
    with ``cfg.compress_after`` > 0, every compressor's all-reduce is the
    exact mean for that many steps first (``compress_after`` of
    `transforms.compressed_all_reduce` and `transforms.powersgd`), marked
    ``"exact"``.

    ``entropy`` returns a transformation for the worst-case payload size; the
    training loop replaces it with planned ones (`entropy_transform`).
    ``block_specs``: on a ``(data, model)`` mesh, the parameters' model
    specs (`common.model_axes`), taken by the names of
    `common.config.MODEL_AXIS_COMPRESSORS`.
    """
    if cfg.compress_after and (name in ("entropy", "gradiveq") or name.startswith("entropy-")):
        raise ValueError(f"compress_after does not apply to {name}: the entropy compressor's "
                         "plans are made from the compressed steps, and GradiVeQ has its own "
                         "lead-in (gradiveq_warmup)")
    return _communication(name, cfg, axis_name, key, block_specs)


#: The names `transforms.compressed_all_reduce` runs with one compressor.
_COMPRESSORS = {
    "bf16": lambda cfg: qc.cast("bfloat16"),
    "onebit": lambda cfg: qc.onebit(),
    "onebit-column": lambda cfg: qc.onebit(grouping="column"),
    "threshold": lambda cfg: qc.threshold(cfg.threshold_tau),
    "adaptive": lambda cfg: qc.adaptive(cfg.adaptive_proportion,
                                        sample=cfg.adaptive_sample or None),
    **{f"qsgd-{b}": (lambda cfg, b=b: qc.qsgd(bits=b)) for b in (2, 4, 8)},
}


#: The names whose compressor `transforms.onebit_adam` can take for its momentum.
MOMENTUM_COMPRESSORS = ("none", *_COMPRESSORS)


def _communication(name: str, cfg, axis_name, key, block_specs=None) -> Communication:
    if name == "none":
        return Communication(pmean(axis_name, block_specs), compressor=qc.identity(), key=key,
                             phases=phases_of(name, cfg))
    if name == COMPUTE_ONLY:
        return Communication(optax.identity(), replicated=False)
    if name == PSUM_BF16:
        return Communication(pmean_bf16(axis_name, block_specs))
    if name in _COMPRESSORS:
        first, compressor = compress_after_of(cfg), _COMPRESSORS[name](cfg)
        return Communication(
            _compressed(compressor, cfg, axis_name, key, block_specs=block_specs,
                        compress_after=first),
            phased=first.steps > 0, phases=phases_of(name, cfg), compressor=compressor,
            key=key)
    if block_specs is not None:
        raise ValueError(f"compressors: with model axes the all-reduce takes "
                         f"{', '.join(MODEL_AXIS_COMPRESSORS)}, got {name!r}")
    if name == "entropy" or name.startswith("entropy-"):
        c = qc.entropy(floor=int(name[8:]) if name != "entropy" else cfg.entropy_floor,
                       block_size=cfg.entropy_block)
        return Communication(entropy_transform(c, None, cfg, axis_name, key), entropy=c)
    if name == "powersgd":
        start = cfg.compress_after or cfg.powersgd_start
        return Communication(transforms.powersgd(axis_name, rank=cfg.powersgd_rank, key=key,
                                                 compress_after=start),
                             phased=start > 0, phases=phases_of(name, cfg))
    if name == "gradiveq":
        return Communication(gradiveq_transform(cfg, axis_name, key), phased=True,
                             phases=phases_of(name, cfg))
    raise ValueError(f"unknown compressor {name!r}")


def phases_of(name: str, cfg) -> Callable[[int], tuple] | None:
    """``steps -> spans``: the schedule of the all-reduce `communication`
    builds for ``name`` with ``cfg``, the same value the transformation runs
    (``transforms.CompressAfter(K).spans``, `transforms.gradiveq_phases`);
    None for an all-reduce of one phase. The timing model
    (``lm/time_to_target.py``) reads it too, so a new recipe is timed by
    its own schedule.

    Example:
      >>> from lm.config import Config
      >>> phases_of("qsgd-4", Config(compress_after=10))(30)  # doctest: +NORMALIZE_WHITESPACE
      (PhaseSpan(name='exact', start=0, stop=10),
       PhaseSpan(name='compressed', start=10, stop=30))
    """
    if cfg.optimizer == "zero-one-adam" and name in MOMENTUM_COMPRESSORS:
        return zero_one_schedule(cfg).spans
    if name in _COMPRESSORS or (name == "none" and cfg.optimizer == "onebit-adam"):
        return compress_after_of(cfg).spans if cfg.compress_after else None
    if name == "powersgd":
        return transforms.CompressAfter(cfg.compress_after or cfg.powersgd_start).spans
    if name == "gradiveq":
        return functools.partial(transforms.gradiveq_phases, warmup_steps=cfg.gradiveq_warmup,
                                 sample_steps=cfg.gradiveq_sample_steps,
                                 compressed_steps=cfg.gradiveq_compressed_steps)
    return None


def gradiveq_transform(cfg, axis_name, key, **kwargs) -> optax.GradientTransformation:
    """`transforms.gradiveq` with the settings of ``cfg`` (and ``kwargs``, e.g.
    ``sample_compressor=None`` for exact lead-in and sampling steps)."""
    rank = cfg.gradiveq_rank
    slice_size = lambda path, leaf: gradiveq_slice_size(  # noqa: E731
        leaf.shape, min_slice=rank * cfg.gradiveq_compression)
    return transforms.gradiveq(
        axis_name, key=key, slice_size=slice_size, loss_threshold=cfg.gradiveq_loss,
        max_rank=rank, warmup_steps=cfg.gradiveq_warmup,
        sample_steps=cfg.gradiveq_sample_steps,
        compressed_steps=cfg.gradiveq_compressed_steps,
        sample_slices=cfg.gradiveq_sample_slices, min_size=cfg.min_size,
        error_feedback=feedback(cfg.gradiveq_error_feedback), **kwargs)


def compressed_leaves(name: str, cfg, tree) -> list[bool]:
    """Which leaves of ``tree`` (flatten order) the all-reduce of ``name`` compresses.

    The transforms' own leaf rules, with the settings `communication` gives
    them: ``none`` compresses nothing; `transforms.powersgd` the matrices
    whose rank-``r`` factors are at least twice smaller
    (`qcollect.powersgd_should_compress`); ``bf16-psum`` nothing (its cast leaves
    travel through ``lax.psum``); `transforms.gradiveq` the leaves of
    two or more dimensions with a slice size K (`gradiveq_slice_size`) and at
    least ``max(cfg.min_size, K)`` values; the others
    (`transforms.compressed_all_reduce`) the leaves with at least
    ``cfg.min_size`` values.

    Example:
      >>> import jax.numpy as jnp
      >>> from common.config import TrainConfig
      >>> tree = {"kernel": jnp.zeros((64, 32)), "bias": jnp.zeros(32)}
      >>> compressed_leaves("qsgd-4", TrainConfig(), tree)   # flatten order: bias, kernel
      [False, True]
      >>> compressed_leaves("none", TrainConfig(), tree)
      [False, False]
    """
    shapes = [np.shape(leaf) for leaf in jax.tree.leaves(tree)]
    if name in ("none", COMPUTE_ONLY, PSUM_BF16):  # bf16-psum: a cast, sent uncompressed
        return [False] * len(shapes)
    if name == "powersgd":
        return [qc.powersgd_should_compress(s, cfg.powersgd_rank) for s in shapes]
    if name == "gradiveq":
        min_slice = cfg.gradiveq_rank * cfg.gradiveq_compression
        slices = [gradiveq_slice_size(s, min_slice=min_slice) for s in shapes]
        return [k is not None and len(s) >= 2 and math.prod(s) >= max(cfg.min_size, k)
                for s, k in zip(shapes, slices, strict=True)]
    return [math.prod(s) >= cfg.min_size for s in shapes]


def entropy_transform(c: qc.EntropyCompressor, plans: dict | None, cfg, axis_name, key):
    """compressed_all_reduce with the entropy quantizer, one plan per leaf.

    ``plans`` maps a leaf's key path to an `qcollect.EntropyPlan` of Python
    ints (None: unplanned, worst-case sizes). Leaves are not fused, so each
    layer gets its own range and bit-width (Oland & Raj, Algorithm 1).
    """

    def choose(path, leaf):
        if plans is None:
            return c
        plan = plans.get(jax.tree_util.keystr(path))
        return None if plan is None else c.with_plan(plan)

    return _compressed(choose, cfg, axis_name, key, fuse=False, algorithm="pairwise")
