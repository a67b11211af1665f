"""Sharded data parallelism (FSDP / ZeRO-3) with compressed weight gathers and
gradient reduce-scatters, error feedback carried as state.

Parameters and optimizer state are sharded over the data axis, each leaf on
one dimension (`qcollect.shard_dimensions`; small leaves replicated), so
each device holds 1/N of them. A step gathers the weights
(`qcollect.compressed_all_gather`, e.g. int8 blocks as ZeRO++'s qwZ),
differentiates an ordinary loss of the full parameters, and the derivative
reduce-scatters each device's gradient back to the shards
(`qcollect.compressed_reduce_scatter`, e.g. 4-bit QSGD as qgZ) with error
feedback: `qcollect.fsdp_gather`. Any optax optimizer then steps on the
shards, as on replicated parameters (a clip by the global norm needs the
norm of all shards: `clip_by_global_norm`).

The pattern, inside ``jax.shard_map`` over the data axis::

    fsdp = transforms.fsdp("data", dimension=dims, weights=..., gradients=..., key=key)
    (loss, grads), fsdp_state = fsdp.value_and_grad(loss_fn)(shards, fsdp_state, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, shards)
    shards = optax.apply_updates(shards, updates)

Placement outside: `shard_params` places the parameters (``P(axis)`` on
each leaf's dimension), `sharded_specs` gives the specs of any tree of
placed arrays, `init_on_shards` initialises the optimizer on the placed
shards (its moments sharded like them), and `transforms.init_sharded` /
`transforms.state_specs` place the `FSDPState` (per-device residuals).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
from qcollect.checks import check_choice, check_key
from transforms._sharding import (
    _put,
    _varies_along,
    check_axis,
    init_like_params,
    keep_if_finite,
    mesh_axes,
    per_device,
)

__all__ = ["FSDP", "FSDPState", "clip_by_global_norm", "fsdp", "init_on_shards",
           "shard_params", "shard_specs", "sharded_specs"]


@per_device("residual")
class FSDPState(NamedTuple):
    """State of `fsdp`.

    Attributes:
      residual: per device (``P(axis_name)``): the gradient's error-feedback
        residual, float32, the full shape of each sharded leaf (a scalar
        zero for replicated leaves); without error feedback a scalar zero per leaf.
      key: the PRNG key, replicated.
      count: steps taken, replicated; each step draws ``fold_in(key, count)``.
    """

    residual: Any
    key: jax.Array
    count: jax.Array


class FSDP(NamedTuple):
    """What `fsdp` returns.

    Attributes:
      init: ``init(params) -> FSDPState`` of the full-size parameters (place
        it with `transforms.init_sharded`).
      value_and_grad: ``value_and_grad(loss_fn, has_aux=False)`` ->
        ``f(shards, state, *args) -> ((loss, grads), state)``: ``loss_fn(params,
        *args)`` of the full parameters, its gradient with respect to the
        shards (this device's shard of the mean over devices), and the next
        state; with ``has_aux=True``, ``loss_fn`` returns ``(loss, aux)``
        and so does the first entry, as with ``jax.value_and_grad``.
      dimension: each leaf's sharded dimension or None (replicated).
    """

    init: Callable
    value_and_grad: Callable
    dimension: Any


def fsdp(axis_name, *, dimension, key: jax.Array, weights: qc.Compressor | None = None,
         gradients: qc.Compressor | None = None, error_feedback: bool = True,
         mean: bool = True, exchange: str = "permute") -> FSDP:
    """Sharded data parallelism with compressed collectives and error feedback.

    Args:
      axis_name: the data axis (or ``(outer, inner)``: the gradients are
        reduce-scattered uncompressed inside a node, compressed across).
      dimension: a pytree like the parameters of ints (the dimension each
        leaf is sharded on, a multiple of N long) and None (replicated):
        `qcollect.shard_dimensions`.
      key: PRNG key for stochastic compressors (the same on every device).
      weights: the weights' all-gather compressor (default
        ``qc.identity()``); ZeRO++'s qwZ is ``qc.qsgd(bits=8,
        bucket_size=2048, stochastic=False)``.
      gradients: the gradients' reduce-scatter compressor (default
        ``qc.identity()``), e.g. ``qc.qsgd(bits=4)``.
      error_feedback: keep ``x - contributed`` of every device's gradient
        blocks for the next step (default True). Without it the state holds
        a scalar per leaf, no residual.
      mean: gradients are the mean over devices (default) or the sum.
      exchange: ``"permute"`` or ``"all_to_all"`` (`qcollect.compressed_reduce_scatter`).

    Returns:
      An `FSDP`.

    A step whose gradients are non-finite on any device (checked with a
    4-byte ``psum`` of a flag) keeps every residual as it was.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc, transforms
      >>> params = {"w": jnp.zeros((64, 512)), "b": jnp.zeros(512)}
      >>> dims = qc.shard_dimensions(params, jax.device_count())
      >>> f = transforms.fsdp("data", dimension=dims, key=jax.random.key(0),
      ...                     gradients=qc.qsgd(bits=4))
      >>> f.init(params).residual["w"].shape
      (64, 512)

    References:
      Wang et al. (ZeRO++), 2023 <https://arxiv.org/abs/2306.10209>;
      Markov et al. (QSDP), ICML 2023 <https://arxiv.org/abs/2302.02390>;
      Xie et al. (LoCo), 2024 <https://arxiv.org/abs/2407.04480>.
    """
    check_choice("exchange", exchange, qc.EXCHANGES)
    for name, c in (("weights", weights), ("gradients", gradients)):
        if c is not None and not isinstance(c, qc.Compressor):
            raise ValueError(f"{name} must be a qcollect Compressor or None, got {c!r}")
    key = check_key("key", key)

    def init(params) -> FSDPState:
        residual = (qc.fsdp_residuals(params, dimension) if error_feedback else
                    jax.tree.map(lambda _: jnp.zeros((), jnp.float32), params))
        return FSDPState(residual=residual, key=key, count=jnp.zeros([], jnp.int32))

    def value_and_grad(loss_fn, has_aux: bool = False):
        def run(shards, state: FSDPState, *args):
            check_axis(axis_name)
            stored = state.residual
            residual = (jax.tree.map(_block, stored) if error_feedback
                        else _zero_residuals(shards, dimension, axis_name))
            step_key = jax.random.fold_in(state.key, state.count)

            def loss_of(s, r):
                params = qc.fsdp_gather(s, r, step_key, axis_name, dimension=dimension,
                                        weights=weights, gradients=gradients, mean=mean,
                                        exchange=exchange)
                return loss_fn(params, *args)

            value, (grads, new) = jax.value_and_grad(loss_of, argnums=(0, 1),
                                                     has_aux=has_aux)(shards, residual)
            if not error_feedback:
                return (value, grads), FSDPState(stored, state.key,
                                                 optax.safe_int32_increment(state.count))
            finite = _finite_everywhere(grads, axis_name)
            new = keep_if_finite(finite, new, residual)
            new = jax.tree.map(lambda n, s: n.reshape(s.shape), new, stored)
            return (value, grads), FSDPState(new, state.key,
                                             optax.safe_int32_increment(state.count))
        return run

    return FSDP(init, value_and_grad, dimension)


def _zero_residuals(shards, dimension, axis_name):
    """`qcollect.fsdp_residuals` of the full leaves whose shards are ``shards``
    (made in the step: without error feedback nothing is stored)."""
    n = math.prod(lax.axis_size(a) for a in mesh_axes(axis_name))

    def zeros(shard, d):
        shape = list(jnp.shape(shard))
        if d is not None:
            shape[d] *= n
        return lax.pcast(jnp.zeros(() if d is None else shape, jnp.float32),
                         tuple(mesh_axes(axis_name)), to="varying")  # per device, as stored

    return jax.tree.map(zeros, shards, dimension, is_leaf=lambda d: d is None)


def _block(stored):
    """This device's residual: its ``(1, *shape)`` block under ``shard_map``."""
    return stored[0]


def _finite_everywhere(grads, axis_name):
    """Scalar: every device's gradient shards are finite (one 4-byte psum)."""
    leaves = jax.tree.leaves(grads)
    bad = sum((~jnp.isfinite(leaf)).sum(dtype=jnp.int32) for leaf in leaves) if leaves else 0
    return lax.psum(jnp.asarray(bad, jnp.int32), axis_name) == 0


def shard_specs(dimension, axis_name):
    """The ``PartitionSpec`` of each leaf of `shard_params`: ``P(axis_name)``
    on its ``dimension``, ``P()`` where it is None.

    Example:
      >>> import transforms
      >>> transforms.shard_specs({"w": 1, "b": None}, "data")
      {'b': P(), 'w': P(None, 'data')}
    """
    axes = mesh_axes(axis_name)
    axis = axes[0] if len(axes) == 1 else axes
    return jax.tree.map(lambda d: P() if d is None else P(*([None] * d + [axis])),
                        dimension, is_leaf=lambda d: d is None)


def shard_params(params, mesh, axis_name, dimension):
    """``params`` placed on ``mesh`` by `shard_specs`: the whole array is the
    global view, each device holds its block of every sharded leaf. Works
    across processes (each fills its own devices from equal ``params``)."""
    specs = shard_specs(dimension, axis_name)
    return jax.tree.map(lambda leaf, spec: _put(leaf, NamedSharding(mesh, spec)), params,
                        specs)


def init_on_shards(tx: optax.GradientTransformation, shards, mesh):
    """``tx.init(shards)`` on ``mesh``: moments sharded like the parameters
    they follow (placed by `shard_params`), counters replicated
    (`transforms._sharding.init_like_params`)."""
    return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, a.sharding.spec)),
                        init_like_params(tx, shards, mesh))


def sharded_specs(tree):
    """The ``PartitionSpec`` of every placed array of ``tree`` (for ``shard_map``)."""
    return jax.tree.map(lambda a: a.sharding.spec, tree)


def clip_by_global_norm(max_norm: float, axis_name) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` for gradients sharded over ``axis_name``.

    Leaves typed varying along ``axis_name`` are shards (their squares are
    summed over the devices, one ``psum`` of a float); invariant leaves are
    replicated and counted once. The norm is that of the full gradient, the
    same on every device, so all shards are scaled alike.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")

    def update(grads, state, params=None):
        del params
        check_axis(axis_name)
        leaves = jax.tree.leaves(grads)
        sharded = [leaf for leaf in leaves if _varies_along(leaf, axis_name)]
        whole = [leaf for leaf in leaves if not _varies_along(leaf, axis_name)]
        squares = lambda ls: sum(jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in ls)  # noqa: E731
        total = squares(whole) + (lax.psum(squares(sharded), axis_name) if sharded else 0.0)
        norm = jnp.sqrt(total)
        scale = jnp.where(norm > max_norm, max_norm / norm, 1.0)
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
