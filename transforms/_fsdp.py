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

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
from qcollect.checks import check_choice, check_floating_leaves, check_key
from qcollect.varying import varying_axes
from transforms._axes import AxisName, ReducingOptimizer, check_axis, mesh_axes, varies_along
from transforms._feedback import ResidualFeedback, keeps_residual, residual_feedback
from transforms._finite import finite_everywhere, keep_if_finite
from transforms._placement import init_like_params, per_device, put

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


def fsdp(axis_name: AxisName, *, dimension: Any, key: jax.Array,
         weights: qc.Compressor | None = None, gradients: qc.Compressor | None = None,
         error_feedback: ResidualFeedback | None = residual_feedback(), mean: bool = True,
         exchange: qc.Exchange = "permute") -> FSDP:
    """Sharded data parallelism with compressed collectives and error feedback.

    Each device keeps 1/N of every large leaf. A step gathers the weights
    through ``weights`` and reduce-scatters the gradients through
    ``gradients``, so neither direction sends float32 where a compressor
    suffices; the gradients' error feedback is explicit state (`FSDPState`).

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
      error_feedback: `transforms.residual_feedback()` (default): keep
        ``x - contributed`` of every device's gradient blocks for the next
        step; None: the state holds a scalar per leaf, no residual (True and
        False are deprecated spellings).
      mean: gradients are the mean over devices (default) or the sum.
      exchange: ``"permute"`` or ``"all_to_all"`` (`qcollect.compressed_reduce_scatter`).

    Returns:
      An `FSDP`. A step whose gradients are non-finite on any device
      (checked with a 4-byte ``psum`` of a flag) keeps every residual as it was.

    Raises:
      ValueError: ``exchange``, ``weights``, ``gradients`` or ``key`` is not
        one of the allowed values (naming it).

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc, transforms
      >>> params = {"w": jnp.zeros((64, 512)), "b": jnp.zeros(512)}
      >>> dims = qc.shard_dimensions(params, jax.device_count())
      >>> f = transforms.fsdp("data", dimension=dims, key=jax.random.key(0),
      ...                     gradients=qc.qsgd(bits=4))
      >>> f.init(params).residual["w"].shape
      (64, 512)

    References:
      Wang et al. (ZeRO++), 2023 <https://arxiv.org/abs/2306.10209>,
      section 3 (qwZ, qgZ); Markov et al. (QSDP), ICML 2023
      <https://arxiv.org/abs/2302.02390>; Xie et al. (LoCo), 2024
      <https://arxiv.org/abs/2407.04480> (error feedback of sharded gradients).
    """
    exchange = check_choice("exchange", exchange, get_args(qc.Exchange))
    for name, c in (("weights", weights), ("gradients", gradients)):
        if c is not None and not isinstance(c, qc.Compressor):
            raise ValueError(f"{name} must be a qcollect Compressor or None, got {c!r}")
    settings = _Settings(axis_name, dimension, weights, gradients,
                         keeps_residual(error_feedback, "fsdp"), mean, exchange)
    return FSDP(functools.partial(_init, key=check_key("key", key), s=settings),
                functools.partial(_value_and_grad, s=settings), dimension)


class _Settings(NamedTuple):
    """The validated static settings of one `fsdp`."""

    axis_name: AxisName
    dimension: Any
    weights: qc.Compressor | None
    gradients: qc.Compressor | None
    error_feedback: bool
    mean: bool
    exchange: qc.Exchange


def _init(params: optax.Params, *, key: jax.Array, s: _Settings) -> FSDPState:
    residual = (qc.fsdp_residuals(params, s.dimension) if s.error_feedback else
                jax.tree.map(lambda _: jnp.zeros((), jnp.float32), params))
    return FSDPState(residual=residual, key=key, count=jnp.zeros([], jnp.int32))


def _value_and_grad(loss_fn: Callable[..., Any], has_aux: bool = False, *,
                    s: _Settings) -> Callable[..., tuple[tuple[Any, Any], FSDPState]]:
    """`FSDP.value_and_grad`: ``f(shards, state, *args) -> ((loss, grads), state)``."""
    return functools.partial(_step, loss_fn=loss_fn, has_aux=has_aux, s=s)


def _step(shards: optax.Params, state: FSDPState, *args: Any, loss_fn: Callable[..., Any],
          has_aux: bool, s: _Settings) -> tuple[tuple[Any, Any], FSDPState]:
    """One step of `FSDP.value_and_grad`: the loss of the gathered parameters,
    its gradient reduce-scattered to ``shards``, and the next residuals."""
    check_axis(s.axis_name)
    stored = state.residual
    residual = (jax.tree.map(_block, stored) if s.error_feedback
                else _zero_residuals(shards, s.dimension, s.axis_name))
    step_key = jax.random.fold_in(state.key, state.count)

    def loss_of(shards: Any, residual: Any) -> Any:
        params = qc.fsdp_gather(shards, residual, step_key, s.axis_name, dimension=s.dimension,
                                weights=s.weights, gradients=s.gradients, mean=s.mean,
                                exchange=s.exchange)
        return loss_fn(params, *args)

    value, (grads, new) = jax.value_and_grad(loss_of, argnums=(0, 1),
                                             has_aux=has_aux)(shards, residual)
    if not s.error_feedback:
        return (value, grads), FSDPState(stored, state.key,
                                         optax.safe_int32_increment(state.count))
    finite = finite_everywhere(grads, s.axis_name)
    new = keep_if_finite(finite, new, residual)
    new = jax.tree.map(lambda n, st: n.reshape(st.shape), new, stored)
    return (value, grads), FSDPState(new, state.key, optax.safe_int32_increment(state.count))


def _zero_residuals(shards: Any, dimension: Any, axis_name: AxisName) -> Any:
    """`qcollect.fsdp_residuals` of the full leaves whose shards are ``shards``
    (made in the step: without error feedback nothing is stored)."""
    n = math.prod(lax.axis_size(a) for a in mesh_axes(axis_name))

    def zeros(shard: jax.Array, d: int | None) -> jax.Array:
        shape = list(jnp.shape(shard))
        if d is not None:
            shape[d] *= n
        return lax.pcast(jnp.zeros(() if d is None else shape, jnp.float32),
                         tuple(mesh_axes(axis_name)), to="varying")  # per device, as stored

    return jax.tree.map(zeros, shards, dimension, is_leaf=lambda d: d is None)


def _block(stored: jax.Array) -> jax.Array:
    """This device's residual: its ``(1, *shape)`` block under ``shard_map``."""
    return stored[0]


def shard_specs(dimension: Any, axis_name: AxisName) -> Any:
    """The ``PartitionSpec`` of each leaf of `shard_params`: ``P(axis_name)``
    on its ``dimension``, ``P()`` where it is None.

    These are the ``in_specs`` and ``out_specs`` of the sharded parameters in
    the step's ``jax.shard_map``.

    Args:
      dimension: a pytree like the parameters of ints and None
        (`qcollect.shard_dimensions`).
      axis_name: the data axis, or ``(outer, inner)``: the leaf is then split
        over both axes on its dimension.

    Returns:
      A pytree like ``dimension`` of ``PartitionSpec``.

    Example:
      >>> import transforms
      >>> transforms.shard_specs({"w": 1, "b": None}, "data")
      {'b': P(), 'w': P(None, 'data')}
    """
    axes = mesh_axes(axis_name)
    axis = axes[0] if len(axes) == 1 else axes
    return jax.tree.map(lambda d: P() if d is None else P(*([None] * d + [axis])),
                        dimension, is_leaf=lambda d: d is None)


def shard_params(params: optax.Params, mesh: Mesh, axis_name: AxisName,
                 dimension: Any) -> optax.Params:
    """``params`` placed on ``mesh`` by `shard_specs`: each device holds its
    block of every sharded leaf, and 1/N of the memory.

    The placed array is the global view (its shape is the full leaf's); inside
    ``jax.shard_map`` each device sees its block. Works across processes
    (each fills its own devices from equal ``params``).

    Args:
      params: the full parameters (host values or replicated arrays).
      mesh: a `jax.sharding.Mesh` with the axes of ``axis_name``.
      axis_name: the data axis (or ``(outer, inner)``).
      dimension: each leaf's sharded dimension or None
        (`qcollect.shard_dimensions`).

    Returns:
      ``params`` with every leaf placed by its `shard_specs` spec.

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc, transforms
      >>> n = jax.device_count()
      >>> mesh = jax.make_mesh((n,), ("data",))
      >>> params = {"w": jnp.zeros((64, 512)), "b": jnp.zeros(512)}
      >>> dims = qc.shard_dimensions(params, n)
      >>> shards = transforms.shard_params(params, mesh, "data", dims)
      >>> shards["w"].addressable_shards[0].data.size * n == params["w"].size
      True
    """
    specs = shard_specs(dimension, axis_name)
    return jax.tree.map(lambda leaf, spec: put(leaf, NamedSharding(mesh, spec)), params,
                        specs)


def init_on_shards(tx: optax.GradientTransformation, shards: optax.Params,
                   mesh: Mesh) -> optax.OptState:
    """``tx.init(shards)`` on ``mesh``: moments sharded like the parameters
    they follow, counters replicated.

    With the optimizer's moments sharded as the parameters, each device keeps
    1/N of the optimizer state too (ZeRO-3).

    Args:
      tx: the optimizer that steps on the shards (any optax transformation).
      shards: the parameters placed by `shard_params`.
      mesh: the mesh they are placed on.

    Returns:
      The optimizer state, each leaf placed on ``mesh`` (`sharded_specs`
      gives its specs).

    Raises:
      ValueError: ``tx`` all-reduces inside (`transforms.onebit_adam`,
        `transforms.decoupled_momentum`: the message names the alternative);
        ``tx``'s update of a replicated leaf varies across the
        devices (it mixes in a value computed from one device's shards, as
        ``optax.clip_by_global_norm`` does: use `clip_by_global_norm`);
        found by tracing one update, no computation.

    Example:
      >>> import jax, jax.numpy as jnp, optax, qcollect as qc, transforms
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> params = {"w": jnp.zeros((64, 512)), "b": jnp.zeros(512)}
      >>> dims = qc.shard_dimensions(params, jax.device_count())
      >>> shards = transforms.shard_params(params, mesh, "data", dims)
      >>> state = transforms.init_on_shards(optax.adam(1e-3), shards, mesh)
      >>> state[0].mu["w"].sharding.spec == shards["w"].sharding.spec
      True
    """
    if isinstance(tx, ReducingOptimizer):
        raise ValueError(
            "tx all-reduces each device's own gradients inside (transforms.onebit_adam, "
            "transforms.decoupled_momentum), but the gradients of sharded training are reduced "
            "shards already: compress them in transforms.fsdp(gradients=...) and step with "
            "transforms.frozen_adamw (1-bit Adam's frozen variance) or any optax optimizer")
    state = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, a.sharding.spec)),
                         init_like_params(tx, shards, mesh))
    _check_replicated_updates(tx, shards, state, mesh)
    return state


def _check_replicated_updates(tx: optax.GradientTransformation, shards: Any, state: Any,
                              mesh: Mesh) -> None:
    """Traces one ``tx.update`` on the shards (``jax.eval_shape``) and raises
    when the update of a replicated (``P()``) leaf varies along a mesh axis
    that shards the parameters; that would fail later as a ``shard_map``
    ``out_specs`` error for each such leaf, naming neither the cause nor the
    fix. An optimizer that needs extra update arguments is not checked."""
    specs = sharded_specs(shards)
    flat = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    axes = {a for s in flat for entry in s if entry is not None for a in mesh_axes(entry)}

    def probe(grads: Any, opt_state: Any, params: Any) -> tuple[()]:
        updates, _ = tx.update(grads, opt_state, params)
        leaves = jax.tree_util.tree_leaves_with_path(updates)
        if len(leaves) != len(flat):  # another tree than the parameters': not checked
            return ()
        for (path, update), spec in zip(leaves, flat, strict=True):
            mixed = sorted(axes & (varying_axes(update) or frozenset()))
            if spec == P() and mixed:
                raise ValueError(
                    f"the optimizer's update of the replicated leaf "
                    f"{jax.tree_util.keystr(path)} varies across {mixed[0]!r}: it mixes in a "
                    f"value computed from one device's shards (optax.clip_by_global_norm "
                    f"clips by the norm of this device's shards alone). Use "
                    f"transforms.clip_by_global_norm(max_norm, {mixed[0]!r}), the norm of "
                    f"all shards")
        return ()

    mapped = jax.shard_map(probe, mesh=mesh, in_specs=(specs, sharded_specs(state), specs),
                           out_specs=())
    try:
        jax.eval_shape(mapped, shards, state, shards)
    except TypeError:  # an update that needs extra arguments (value=, ...): not checked
        return


def sharded_specs(tree: Any) -> Any:
    """The ``PartitionSpec`` of every placed array of ``tree`` (for ``shard_map``).

    Args:
      tree: a pytree of arrays placed with a ``NamedSharding`` (`shard_params`,
        `init_on_shards`).

    Returns:
      A pytree like ``tree`` of each leaf's ``sharding.spec``.

    Example:
      >>> import jax, jax.numpy as jnp, transforms
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tree = transforms.shard_params({"w": jnp.zeros((8 * jax.device_count(), 4))},
      ...                                mesh, "data", {"w": 0})
      >>> transforms.sharded_specs(tree)
      {'w': P('data',)}
    """
    return jax.tree.map(lambda a: a.sharding.spec, tree)


def clip_by_global_norm(max_norm: float, axis_name: AxisName) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` for gradients sharded over ``axis_name``.

    ``optax.clip_by_global_norm`` on shards would clip each shard by its own
    norm. Here leaves typed varying along ``axis_name`` are shards (their
    squares are summed over the devices, one ``psum`` of a float); invariant
    leaves are replicated and counted once. The norm is that of the full
    gradient, the same on every device, so all shards are scaled alike.

    Args:
      max_norm: the largest global norm, > 0.
      axis_name: the data axis the gradients are sharded over.

    Returns:
      An ``optax.GradientTransformation`` without state; its ``update`` runs
      inside ``jax.shard_map`` over ``axis_name``.

    Raises:
      ValueError: ``max_norm`` is not above 0.

    Example:
      >>> import optax, transforms
      >>> tx = optax.chain(transforms.clip_by_global_norm(1.0, "data"), optax.adamw(1e-3))
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")

    def update(grads: optax.Updates, state: optax.OptState,
               params: optax.Params | None = None) -> tuple[optax.Updates, optax.OptState]:
        del params
        check_axis(axis_name)
        check_floating_leaves(grads, "grads")
        leaves = jax.tree.leaves(grads)
        sharded = [leaf for leaf in leaves if varies_along(leaf, axis_name)]
        whole = [leaf for leaf in leaves if not varies_along(leaf, axis_name)]
        squares = lambda ls: sum(jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in ls)  # noqa: E731
        total = squares(whole) + (lax.psum(squares(sharded), axis_name) if sharded else 0.0)
        norm = jnp.sqrt(total)
        scale = jnp.where(norm > max_norm, max_norm / norm, 1.0)
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
