"""The gradient all-reduce of each compressor name, as an optax transformation.

`communication(name, cfg, axis_name, key)` returns a `Communication`: the
transformation that turns each device's gradients into the mean gradient
(chained before the optimizer), and what the training loop needs to know
about it (whether it switches phases, whether it needs entropy plans).

=============  ==============================================================
name           all-reduce
=============  ==============================================================
none           ``lax.pmean`` (XLA's all-reduce): the baseline
bf16           `transforms.compressed_all_reduce` with ``qc.cast("bfloat16")``
onebit         ... ``qc.onebit()`` (Seide, 64-value buckets, Grubic's 1bitSGD*)
onebit-column  ... ``qc.onebit(grouping="column")`` (Seide/CNTK, means per column)
threshold      ... ``qc.threshold(tau)`` (Strom, Dryden 3.2)
adaptive       ... ``qc.adaptive(proportion, sample=256)`` (Dryden 3.3, sampled)
qsgd-b         ... ``qc.qsgd(bits=b)`` (Grubic eq. 1, default buckets)
entropy[-c]    ... ``qc.entropy(floor=c)`` with host-side plans (Oland & Raj)
powersgd       `transforms.powersgd` (Vogels et al.)
gradiveq       `transforms.gradiveq` (Yu et al.)
=============  ==============================================================

All but ``none`` keep error feedback; compressed_all_reduce leaves with fewer
than ``cfg.min_size`` values (biases) are averaged uncompressed.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import optax
from jax import lax

import qcollect as qc
import transforms


class Communication(NamedTuple):
    """A gradient all-reduce and how the training loop should drive it.

    Attributes:
      tx: the optax transformation (mean gradient over the data axis).
      phased: it switches phases with ``lax.cond`` (warm-up, sampling,
        compressed), so wire bytes differ per phase.
      entropy: the entropy compressor when the step needs host-side plans
        (`examples.common.entropy_plan`), else None.
    """

    tx: optax.GradientTransformation
    phased: bool = False
    entropy: qc.EntropyCompressor | None = None


def pmean(axis_name) -> optax.GradientTransformation:
    """The uncompressed baseline: ``lax.pmean`` of every gradient leaf."""

    def update(grads, state, params=None):
        del params
        return jax.tree.map(lambda g: lax.pmean(g, axis_name), grads), state

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


def _compressed(compressor, cfg, axis_name, key, **kwargs) -> optax.GradientTransformation:
    return transforms.compressed_all_reduce(axis_name, compressor=compressor, key=key,
                                            min_size=cfg.min_size, **kwargs)


def communication(name: str, cfg, axis_name, key) -> Communication:
    """The `Communication` for compressor ``name`` with the settings of ``cfg``.

    ``entropy`` returns a transformation for the worst-case payload size; the
    training loop replaces it with planned ones (`entropy_transform`).
    """
    if name == "none":
        return Communication(pmean(axis_name))
    if name == "bf16":
        return Communication(_compressed(qc.cast("bfloat16"), cfg, axis_name, key))
    if name == "onebit":
        return Communication(_compressed(qc.onebit(), cfg, axis_name, key))
    if name == "onebit-column":
        return Communication(_compressed(qc.onebit(grouping="column"), cfg, axis_name, key))
    if name == "threshold":
        return Communication(_compressed(qc.threshold(cfg.threshold_tau), cfg, axis_name, key))
    if name == "adaptive":
        return Communication(_compressed(
            qc.adaptive(cfg.adaptive_proportion, sample=cfg.adaptive_sample or None), cfg,
            axis_name, key))
    if name.startswith("qsgd-"):
        return Communication(_compressed(qc.qsgd(bits=int(name[5:])), cfg, axis_name, key))
    if name == "entropy" or name.startswith("entropy-"):
        c = qc.entropy(floor=int(name[8:]) if name != "entropy" else cfg.entropy_floor,
                       block_size=cfg.entropy_block)
        return Communication(entropy_transform(c, None, cfg, axis_name, key), entropy=c)
    if name == "powersgd":
        return Communication(transforms.powersgd(axis_name, rank=cfg.powersgd_rank, key=key,
                                                 start_iter=cfg.powersgd_start),
                             phased=cfg.powersgd_start > 0)
    if name == "gradiveq":
        rank = cfg.gradiveq_rank
        slice_size = lambda path, leaf: gradiveq_slice_size(  # noqa: E731
            leaf.shape, min_slice=rank * cfg.gradiveq_compression)
        return Communication(transforms.gradiveq(
            axis_name, key=key, slice_size=slice_size, loss_threshold=cfg.gradiveq_loss,
            max_rank=rank, warmup_steps=cfg.gradiveq_warmup,
            sample_steps=cfg.gradiveq_sample_steps,
            compressed_steps=cfg.gradiveq_compressed_steps,
            sample_slices=cfg.gradiveq_sample_slices, min_size=cfg.min_size,
            error_feedback=cfg.gradiveq_error_feedback),
            phased=True)
    raise ValueError(f"unknown compressor {name!r}")


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
