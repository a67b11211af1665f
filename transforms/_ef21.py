"""What `transforms.compressed_all_reduce` sends and keeps beyond the classic
residual: the EF21 estimator, its momentum variant, and rows without gradient.

``error_feedback=transforms.ef21()`` (Richtárik, Sokolov and Fatkhullin, Algorithm 1):
device i keeps an estimate ``g_i`` of its own gradient and compresses the
difference ``grad_i - g_i``; ``g_i`` moves by what its own encodings decode
to (``contributed``), and every device moves the replicated estimate ``g``
by the all-reduce's value, the mean (or sum) of those. The update is ``g``.
So ``g`` stays the mean of the ``g_i``, up to the owner's re-encoding error
where the compressor's chunks are re-encoded by their owner (the pairwise
algorithm, which ``"auto"`` picks for non-linear compressors): that error is
kept and added before the owner's next re-encoding, and in sum units ``g``
equals ``sum_i g_i`` minus the owner errors held now, a bounded gap rather
than a drift. The compressed-domain ring of a linear compressor sums
exactly what the devices contributed, up to the rounding of its sums (for
``cast`` in the narrow dtype; that rounding is not fed back, pairwise keeps
it). The hierarchical ``(outer, inner)`` all-reduce keeps the same relation.
``"ring_requantize"`` re-encodes at every hop, errors that belong to no
device, and is refused.

``transforms.ef21(momentum=eta)`` (EF21-SGDM; Fatkhullin, Tyurin and Richtárik,
Algorithm 1): each device first averages its gradients,
``v_i = (1 - eta) v_i + eta grad_i``, with ``v_i`` the first gradient at
step 0 (the paper's ``v_i^0``), and EF21 then compresses ``v_i - g_i``.

``mask_zero_rows`` (Tang et al.'s 1-bit Adam, DeepSpeed's ``exp_avg_mask``):
a sign compressor cannot send a zero, so a row that never gets a gradient
(an unused embedding row) would get ``+-scale`` every step and its error
would grow. With the mask, one all-reduce (max) of one uint8 flag per row
of each compressed leaf (a leaf of fewer than two dimensions is one row)
finds the rows whose gradient is exactly zero on every device; their input
to the encoder is zero (not a stale residual that would set their bucket's
scale), their update is exactly zero and their error-feedback state
(residual, owner residual, estimates, momentum) stays as it was.

References:
  Richtárik, Sokolov and Fatkhullin, "EF21: A New, Simpler, Theoretically
    Better, and Practically Faster Error Feedback", NeurIPS 2021
    <https://arxiv.org/abs/2106.05203>, Algorithm 1;
  Fatkhullin, Tyurin and Richtárik, "Momentum Provably Improves Error
    Feedback!", NeurIPS 2023 <https://arxiv.org/abs/2305.15155>,
    Algorithm 1 (EF21-SGDM);
  Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed", ICML 2021
    <https://arxiv.org/abs/2102.02888> (zero-gradient masks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import qcollect as qc
from transforms._axes import AxisName, mesh_axes
from transforms._placement import per_device
from transforms._policy import sum_uncompressed

__all__ = ["Context", "EF21State", "Reduce", "Reduced", "ef21_steps", "live_rows", "masked",
           "where_live"]


@per_device("local_estimate", "owner_residual", "momentum")
class EF21State(NamedTuple):
    """State of `transforms.ef21`.

    Attributes:
      local_estimate: per device (``P(axis_name)``): float32 tree like the
        gradients, this device's estimate ``g_i`` of its own gradient (EF21
        Algorithm 1); ``optax.MaskedNode()`` for leaves not compressed.
      estimate: replicated (``P()``): the float32 estimate ``g``, the update
        in its units (the mean or the sum of the ``g_i``).
      owner_residual: per device: where the compressor runs pairwise
        (``algorithm="pairwise"``, or ``"auto"`` with a non-linear
        compressor) the owner's re-encoding error; else masked.
      momentum: per device: with ``momentum``, EF21-SGDM's float32 ``v_i``;
        else ``optax.MaskedNode()`` leaves.
    """

    local_estimate: Any
    estimate: Any
    owner_residual: Any
    momentum: Any


class Reduced(NamedTuple):
    """One compressed leaf after the all-reduce: the reduced value, what this
    device's encodings decode to, and the owner's error (None unless kept)."""

    value: jax.Array
    contributed: jax.Array
    owner_error: jax.Array | None


#: ``reduce(inputs, owners, step_key) -> {i: Reduced}`` over the compressed leaves.
Reduce = Callable[[list[Any], list[Any], jax.Array], dict[int, Reduced]]


class Context(NamedTuple):
    """What one step of an error-feedback strategy works with: each leaf's
    compressor (None: uncompressed), the data axis, mean or sum, the leaves'
    block specs (or None), whether zero rows are masked, and the compressed
    all-reduce of the transformation."""

    comps: list[qc.Compressor | None]
    axis_name: AxisName
    mean: bool
    blocks: list[P] | None
    mask: bool
    reduce: Reduce


def live_rows(leaves: list[jax.Array], comps: list[qc.Compressor | None],
              axis_name: AxisName) -> list[jax.Array | None]:
    """Per compressed leaf, which rows have a non-zero gradient on some device.

    One ``lax.pmax`` over the data axis of one uint8 flag per row (slices
    along the first axis; a leaf of fewer than two dimensions is one row) of
    all compressed leaves together. Returns bool arrays broadcastable to
    each leaf (``(rows, 1, ...)``, or ``()``), None for the other leaves.
    """
    which = [i for i, c in enumerate(comps) if c is not None]
    if not which:
        return [None] * len(leaves)
    flags = [jnp.any(leaves[i] != 0, axis=tuple(range(1, leaves[i].ndim)))
             if leaves[i].ndim >= 2 else jnp.any(leaves[i] != 0)[None] for i in which]
    joined = lax.pmax(jnp.concatenate(flags).astype(jnp.uint8), mesh_axes(axis_name))
    out: list[jax.Array | None] = [None] * len(leaves)
    start = 0
    for i, flag in zip(which, flags, strict=True):
        rows = joined[start:start + flag.shape[0]] > 0
        start += flag.shape[0]
        ndim = leaves[i].ndim
        out[i] = rows.reshape((-1,) + (1,) * (ndim - 1)) if ndim >= 2 else rows[0]
    return out


def masked(live: jax.Array | None, x: Any) -> Any:
    """``x`` with its dead rows zero (``x`` as it is without a mask)."""
    return x if live is None or x is None else jnp.where(live, x, jnp.zeros((), x.dtype))


def where_live(live: jax.Array | None, new: Any, old: Any) -> Any:
    """``new`` on the live rows, ``old`` on the dead ones (``new`` without a mask)."""
    return new if live is None or new is None else jnp.where(live, new, old)


def _momentum(leaves: list[jax.Array], momenta: list[Any], count: jax.Array,
              eta: float | None, live: list[Any]) -> tuple[list[Any], list[Any]]:
    """``(sources, momenta)``: ``v_i = (1 - eta) v_i + eta grad_i`` (the
    gradient itself at step 0) where a momentum is kept, and what EF21
    compresses: ``v_i`` there, the gradient elsewhere."""
    if eta is None:
        return leaves, momenta
    rate = jnp.where(count == 0, 1.0, eta).astype(jnp.float32)
    new = [None if v is None
           else where_live(live_, (1 - rate) * v + rate * leaf.astype(jnp.float32), v)
           for leaf, v, live_ in zip(leaves, momenta, live, strict=True)]
    return [leaf if v is None else v for leaf, v in zip(leaves, new, strict=True)], new


#: ``(updates, state of lists)`` of one step, leaf by leaf.
Step = tuple[list[jax.Array], EF21State]


def ef21_steps(ctx: Context, *, eta: float | None) -> tuple[Callable[..., Step],
                                                           Callable[..., Step]]:
    """``(exact, compressed)``: EF21's warm-up and compressed step, each
    ``(leaves, memory, key, count) -> (updates, memory)`` on an `EF21State`
    of lists (None where a leaf keeps nothing); ``eta``: EF21-SGDM's momentum
    or None."""
    return (functools.partial(_exact, ctx=ctx, eta=eta),
            functools.partial(_compressed, ctx=ctx, eta=eta))


def _exact(leaves: list[jax.Array], memory: EF21State, key: jax.Array, count: jax.Array, *,
           ctx: Context, eta: float | None) -> Step:
    """The warm-up step under EF21: the exact mean (or sum) of what EF21
    would compress (the gradient, or ``v_i``), and the full-gradient start:
    ``g_i`` that value on each device, ``g`` the exact mean."""
    del key
    sources, momenta = _momentum(leaves, memory.momentum, count, eta, [None] * len(leaves))
    sent = [leaf if c is None else s
            for leaf, s, c in zip(leaves, sources, ctx.comps, strict=True)]
    out = sum_uncompressed(sent, [False] * len(leaves), ctx.axis_name, mean=ctx.mean,
                           block_specs=ctx.blocks)
    estimate = [None if g is None else o.astype(jnp.float32)
                for o, g in zip(out, memory.estimate, strict=True)]
    local = [None if g is None else s.astype(jnp.float32)
             for s, g in zip(sources, memory.local_estimate, strict=True)]
    return ([o.astype(leaf.dtype) for o, leaf in zip(out, leaves, strict=True)],
            EF21State(local, estimate, memory.owner_residual, momenta))


def _compressed(leaves: list[jax.Array], memory: EF21State, key: jax.Array,
                count: jax.Array, *, ctx: Context, eta: float | None) -> Step:
    """One compressed EF21 step: ``C(source_i - g_i)`` all-reduced,
    ``g_i += contributed``, ``g += value``, the update ``g``; the leaves
    left uncompressed get the exact mean of their gradients."""
    comps = ctx.comps
    live = live_rows(leaves, comps, ctx.axis_name) if ctx.mask else [None] * len(leaves)
    sources, momenta = _momentum(leaves, memory.momentum, count, eta, live)
    inputs = [leaf if c is None else masked(lv, s.astype(jnp.float32) - g_i)
              for leaf, s, g_i, c, lv in zip(leaves, sources, memory.local_estimate, comps,
                                              live, strict=True)]
    owners = [masked(lv, o) for lv, o in zip(live, memory.owner_residual, strict=True)]
    out = sum_uncompressed(inputs, [c is not None for c in comps], ctx.axis_name,
                           mean=ctx.mean, block_specs=ctx.blocks)
    estimate, local = list(memory.estimate), list(memory.local_estimate)
    owner = list(memory.owner_residual)
    for i, r in ctx.reduce(inputs, owners, jax.random.fold_in(key, count)).items():
        estimate[i] = where_live(live[i], memory.estimate[i] + r.value.astype(jnp.float32),
                                 memory.estimate[i])
        local[i] = where_live(live[i], memory.local_estimate[i]
                              + r.contributed.astype(jnp.float32), memory.local_estimate[i])
        if r.owner_error is not None:
            owner[i] = where_live(live[i], r.owner_error, memory.owner_residual[i])
        out[i] = masked(live[i], estimate[i])
    return ([o.astype(leaf.dtype) for o, leaf in zip(out, leaves, strict=True)],
            EF21State(local, estimate, owner, momenta))
