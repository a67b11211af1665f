"""The classic residual of error feedback (Seide; Grubic et al. Algorithm 2).

Each step, on every device: ``input = g + residual`` (float32), the input is
compressed and summed, and ``residual = input - contributed``, where
``contributed`` is what this device's own encodings decode to. With the
pairwise algorithm the owner's re-encoding error is kept too and added
before the owner's next re-encoding (two-level error feedback, like the
worker and server errors of DeepSpeed's 1-bit Adam). `ResidualState` holds
both; `residual_steps` are the warm-up and the compressed step of
`transforms.compressed_all_reduce` under `transforms.residual_feedback`.
`add_residual` and `residual_of` are the two halves every transformation
that keeps a residual uses (`transforms.powersgd`, `transforms.gradiveq`,
`transforms.fsdp`).

References:
  Seide et al., INTERSPEECH 2014 <https://doi.org/10.21437/Interspeech.2014-274>;
  Grubic et al., EDBT 2018 <https://doi.org/10.3929/ethz-b-000319485>,
  Algorithm 2 (line 4); Dryden et al., MLHPC 2016, section 3.4.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from transforms._ef21 import Context, live_rows, masked, where_live
from transforms._placement import per_device
from transforms._policy import sum_uncompressed

__all__ = ["ResidualState", "add_residual", "residual_of", "residual_steps"]


@per_device("residual", "owner_residual")
class ResidualState(NamedTuple):
    """State of `transforms.residual_feedback` (per device, ``P(axis_name)``).

    Attributes:
      residual: float32 tree like the gradients: what error feedback still
        owes, ``input - contributed`` (Seide; Grubic Alg. 2 line 4);
        ``optax.MaskedNode()`` for leaves that are not compressed (all of
        them with ``error_feedback=None``).
      owner_residual: with ``algorithm="pairwise"``, the owner's re-encoding
        error (two-level error feedback, as DeepSpeed's server error); else
        ``optax.MaskedNode()`` leaves.
    """

    residual: Any
    owner_residual: Any


def add_residual(leaf: jax.Array, residual: jax.Array | None) -> jax.Array:
    """What a device compresses: ``leaf + residual`` in float32 (the leaf
    itself where none is kept)."""
    return leaf if residual is None else leaf.astype(jnp.float32) + residual


def residual_of(x: jax.Array, contributed: jax.Array) -> jax.Array:
    """The residual still owed: ``x - contributed`` in float32."""
    return x.astype(jnp.float32) - contributed.astype(jnp.float32)


#: ``(updates, state of lists)`` of one step, leaf by leaf.
Step = tuple[list[jax.Array], Any]


def residual_steps(ctx: Context, *, keep: bool) -> tuple[Callable[..., Step],
                                                        Callable[..., Step]]:
    """``(exact, compressed)``: the warm-up and the compressed step, each
    ``(leaves, memory, key, count) -> (updates, memory)`` on a `ResidualState`
    of lists (None where a leaf keeps nothing); ``keep``: the residual is
    kept (False: no error feedback)."""
    return (functools.partial(_exact_step, ctx=ctx),
            functools.partial(_compressed_step, ctx=ctx, keep=keep))


def _exact_step(leaves: list[jax.Array], memory: ResidualState, key: jax.Array,
                count: jax.Array, *, ctx: Context) -> Step:
    """The warm-up: every leaf's exact mean (or sum) in its own dtype; the
    residuals untouched."""
    del key, count
    out = sum_uncompressed(leaves, [False] * len(leaves), ctx.axis_name, mean=ctx.mean,
                           block_specs=ctx.blocks)
    return [o.astype(g.dtype) for o, g in zip(out, leaves, strict=True)], memory


def _compressed_step(leaves: list[jax.Array], memory: ResidualState, key: jax.Array,
                     count: jax.Array, *, ctx: Context, keep: bool) -> Step:
    """The compressed leaves through their compressors with the classic
    residual (or none), the others summed exactly; the updates in the
    gradients' dtypes. With ``mask_zero_rows`` the dead rows go as zeros,
    come back as zeros and keep their residuals."""
    comps = ctx.comps
    live = (live_rows(leaves, comps, ctx.axis_name) if ctx.mask
            else [None] * len(leaves))
    inputs = [add_residual(leaf, r) for leaf, r in zip(leaves, memory.residual, strict=True)]
    inputs = [x if c is None else masked(lv, x)
              for x, c, lv in zip(inputs, comps, live, strict=True)]
    owners = [masked(lv, o) for lv, o in zip(live, memory.owner_residual, strict=True)]
    out = sum_uncompressed(inputs, [c is not None for c in comps], ctx.axis_name,
                           mean=ctx.mean, block_specs=ctx.blocks)
    residuals, new_owners = list(memory.residual), list(memory.owner_residual)
    for i, r in ctx.reduce(inputs, owners, jax.random.fold_in(key, count)).items():
        out[i] = masked(live[i], r.value)
        if keep:
            residuals[i] = where_live(live[i], residual_of(inputs[i], r.contributed),
                                      memory.residual[i])
        if r.owner_error is not None:
            new_owners[i] = where_live(live[i], r.owner_error, memory.owner_residual[i])
    return [o.astype(leaf.dtype) for o, leaf in zip(out, leaves, strict=True)], \
        ResidualState(residuals, new_owners)
