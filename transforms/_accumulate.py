"""`accumulate`: k micro-batches per optimizer step, one all-reduce per step.

Gradient accumulation trains with a batch k times larger than one step's
memory allows: each micro-step adds this device's gradient of one
micro-batch to a per-device sum, and every k-th micro-step hands the mean
of the k gradients to the wrapped transformation, which then runs its
all-reduce (and its error feedback) once, on the optimizer step's gradient.
It is PyTorch DDP's ``no_sync()`` for the first k - 1 micro-batches.

``optax.MultiSteps`` is not that: it calls the wrapped transformation on
every micro-step and keeps the result of the k-th (``jnp.where``), so a
compressed all-reduce inside it communicates k times per optimizer step
(and its per-device accumulators need `state_specs` to place them per
device, which it does). `accumulate` runs the wrapped update inside a
``lax.cond`` taken on the k-th micro-step only: the compiled micro-step
holds the all-reduce once, in the branch, and ``qcollect.wire_bytes(...,
branches="min")`` of it is 0.

The accumulated sum is per device (`AccumulateState.sums`, float32,
``P(axis)`` in `state_specs`); the counter and the wrapped state are placed
as that state's own rules say.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qcollect.checks import check_floating_leaves, check_int
from transforms._axes import AxisName, cond_matching_types
from transforms._blocks import device_block
from transforms._placement import per_device

__all__ = ["AccumulateState", "accumulate"]


@per_device("sums")
class AccumulateState(NamedTuple):
    """State of `accumulate`.

    Attributes:
      sums: per device (``P(axis)``): the sum of this optimizer step's
        micro-batch gradients so far (float32, zero after each optimizer step).
      micro_step: int32 micro-steps taken in this optimizer step (0 to k - 1).
      inner: the wrapped transformation's state.
    """

    sums: Any
    micro_step: jax.Array
    inner: Any


def accumulate(axis_name: AxisName, *, inner: optax.GradientTransformation,
               every: int) -> optax.GradientTransformation:
    """Accumulates ``every`` micro-batch gradients per device, then runs ``inner`` once.

    ``update(grads, state, params)`` takes this device's gradient of one
    micro-batch. On the first ``every - 1`` micro-steps it adds it to the
    per-device sum and returns zero updates, with no communication; on the
    ``every``-th it calls ``inner.update`` with the mean of the ``every``
    gradients (cast to the gradients' dtype), returns its updates and
    clears the sum. With equal micro-batches and a mean loss, that mean is
    the gradient of their union, so an exact (or identity-compressed)
    all-reduce gives the large-batch step.

    Wrap the whole chain whose first element communicates, e.g.
    ``accumulate("data", inner=optax.chain(compressed_all_reduce(...),
    optax.adamw(...)), every=4)``: the optimizer then also steps once per ``every`` micro-steps.

    Args:
      axis_name: the data axis (the sums are per device along it).
      inner: the transformation to run once per optimizer step.
      every: k, micro-batches per optimizer step (an integer >= 1).

    Returns:
      An ``optax.GradientTransformation`` (state `AccumulateState`).

    Raises:
      ValueError: ``every`` below 1 or not an integer; ``inner`` not a
        transformation.

    Example:
      >>> import jax, jax.numpy as jnp, optax, transforms
      >>> tx = transforms.accumulate("data", inner=optax.sgd(1.0), every=2)
      >>> params = {"w": jnp.zeros(3)}
      >>> state = tx.init(params)
      >>> u, state = tx.update({"w": jnp.ones(3)}, state, params)     # held
      >>> u["w"].tolist()
      [0.0, 0.0, 0.0]
      >>> u, state = tx.update({"w": 3 * jnp.ones(3)}, state, params)  # mean 2, applied
      >>> u["w"].tolist()
      [-2.0, -2.0, -2.0]
    """
    every = check_int("every", every)
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise ValueError(f"inner must be an optax GradientTransformation, got {inner!r}")
    return optax.GradientTransformation(
        functools.partial(_init, inner=inner),
        functools.partial(_update, axis_name=axis_name, inner=inner, every=every))


def _init(params: optax.Params, *, inner: optax.GradientTransformation) -> AccumulateState:
    return AccumulateState(sums=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32),
                                             params),
                           micro_step=jnp.zeros([], jnp.int32), inner=inner.init(params))


def _update(grads: optax.Updates, state: AccumulateState, params: optax.Params | None = None,
            *, axis_name: AxisName, inner: optax.GradientTransformation,
            every: int) -> tuple[optax.Updates, AccumulateState]:
    check_floating_leaves(grads, "grads")
    stored = state.sums
    sums = jax.tree.map(
        lambda s, g: device_block(s, g, axis_name, "the accumulated gradient").astype(
            jnp.float32)
        + g.astype(jnp.float32), stored, grads)

    def emit(sums: Any, inner_state: optax.OptState) -> tuple[Any, optax.OptState, Any]:
        mean = jax.tree.map(lambda s, g: (s / every).astype(g.dtype), sums, grads)
        updates, inner_state = inner.update(mean, inner_state, params)
        return updates, inner_state, jax.tree.map(jnp.zeros_like, sums)

    def hold(sums: Any, inner_state: optax.OptState) -> tuple[Any, optax.OptState, Any]:
        shapes = jax.eval_shape(lambda: inner.update(grads, inner_state, params)[0])
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        return zeros, inner_state, sums

    if every == 1:
        updates, inner_state, sums = emit(sums, state.inner)
    else:
        updates, inner_state, sums = cond_matching_types(
            state.micro_step == every - 1, emit, hold, sums, state.inner)
    sums = jax.tree.map(lambda s, st: jnp.reshape(s, jnp.shape(st)), sums, stored)
    micro_step = (state.micro_step + 1) % every
    return updates, AccumulateState(sums=sums, micro_step=micro_step, inner=inner_state)
