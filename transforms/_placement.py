"""Where transform state lives on a mesh: replicated, except what differs per device.

Modern JAX data parallelism keeps parameters and optimizer moments
replicated, ``P()``, under ``jax.jit`` + ``jax.shard_map``. The all-reduced
update of every transformation here is invariant along the data axis (the
collectives end in ``lax.all_gather(..., to="invarying")`` or ``lax.psum``),
so it applies to replicated parameters directly. Only error-feedback state
really differs per device: those leaves are *per device* and are stored
with a leading device axis of size N, sharded ``P(axis_name)``.

* `state_specs(state, axis_name)`: the PartitionSpec tree of a state (or
  of ``jax.eval_shape(tx.init, params)``), for ``shard_map``'s
  ``in_specs``/``out_specs``.
* `init_sharded(tx, params, mesh, axis_name)`: ``tx.init(params)`` placed
  on ``mesh``: per-device leaves ``(N, *shape)`` on ``P(axis_name)``, the
  rest ``P()``.

A state class marks its per-device fields with a ``per_device_fields``
class attribute (set by the `per_device` decorator); `state_specs` finds
such states anywhere in a tree, so it works through ``optax.chain``,
``optax.partition``, ``optax.masked`` and an ``optax.apply_if_finite``
chained after them (wrapped around them it is refused: its flag would be
each device's own).
Inside the step each device reads its block of them (`transforms.local_replica`
for stacked replicas; the transformations read their own state alike).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from transforms._axes import AxisName, mesh_axes

__all__ = ["init_like_params", "init_sharded", "per_device", "put", "state_specs"]

_T = TypeVar("_T", bound=type)


def per_device(*fields: str) -> Callable[[_T], _T]:
    """Class decorator: the state NamedTuple's ``fields`` hold one block per
    device (its ``per_device_fields``, read by `state_specs`).

    Example:
      >>> from typing import NamedTuple
      >>> @per_device("residual")
      ... class MyState(NamedTuple):
      ...     residual: object
      ...     count: object
      >>> MyState.per_device_fields
      ('residual',)
    """
    def mark(cls: _T) -> _T:
        unknown = [f for f in fields if f not in getattr(cls, "_fields", ())]
        if unknown:
            raise ValueError(f"per_device: {cls.__name__} has no fields {unknown}")
        cls.per_device_fields = fields  # type: ignore[attr-defined]
        return cls
    return mark


_MULTISTEPS = (
    "optax.MultiSteps cannot run inside shard_map: its acc_grads must hold each device's "
    "own gradient sum, and a per-device block there has a leading axis of 1 that its "
    "update broadcasts into the parameters' shapes (a stateful optimizer then fails in "
    "lax.cond, a stateless one silently returns parameters of another shape). Use "
    "transforms.accumulate(axis_name, inner=<the chain>, every=k): it keeps the sums per "
    "device and also sends once per k micro-steps instead of every micro-step. Under "
    "jax.pmap optax.MultiSteps works as it is.")


_WRAPPED = (
    "apply_if_finite wraps {name}, whose state differs per device: it would decide "
    "from each device's own gradients, before the all-reduce (inside shard_map a lax.cond "
    "on a value that varies across the devices fails; under pmap devices would disagree). "
    "Chain it after instead: optax.chain(transforms.compressed_all_reduce(...), "
    "optax.apply_if_finite(optax.adamw(...), max_consecutive_errors=k)); the reduced update "
    "is the same on every device, and qcollect's transformations keep their own state on a "
    "non-finite step. For sharded updates use transforms.apply_if_finite(inner, axis_name, "
    "max_consecutive_errors=k).")


def _per_device_fields(node: Any) -> tuple[str, ...] | None:
    if not isinstance(node, tuple):
        return None
    if isinstance(node, optax.MultiStepsState):
        raise ValueError(_MULTISTEPS)
    if isinstance(node, optax.ApplyIfFiniteState):
        inner = [n for n in jax.tree.leaves(node.inner_state, is_leaf=_has_per_device_fields)
                 if _has_per_device_fields(n)]
        if inner:
            raise ValueError(_WRAPPED.format(name=type(inner[0]).__name__))
    fields: tuple[str, ...] | None = getattr(type(node), "per_device_fields", None)
    return fields


def _has_per_device_fields(node: Any) -> bool:
    return _per_device_fields(node) is not None


def state_specs(state: optax.OptState, axis_name: AxisName) -> Any:
    """PartitionSpecs for a transformation state: ``P(axis_name)`` per device, else ``P()``.

    Args:
      state: a state pytree, e.g. ``tx.init(params)``, the result of
        `init_sharded`, or ``jax.eval_shape(tx.init, params)``; any optax
        state may contain qcollect states.
      axis_name: the data axis of the mesh, or the pair ``(outer, inner)``
        of a hierarchical all-reduce (per-device leaves are then split over
        both, ``P((outer, inner))``).

    Returns:
      A pytree of the same structure with a `jax.sharding.PartitionSpec` per
      leaf: ``P(axis_name)`` for error-feedback residuals and gradient sums
      (the fields each state class lists in ``per_device_fields``), ``P()``
      for the rest.

    Raises:
      ValueError: a per-device leaf of a concrete state is not placed on the
        mesh (a ``tx.init`` state on several devices: use `init_sharded`),
        or is placed along another axis than ``axis_name``;
        the state holds an ``optax.MultiSteps`` state (use
        `transforms.accumulate`).

    Example:
      >>> import jax, jax.numpy as jnp, optax, qcollect as qc, transforms
      >>> tx = optax.chain(transforms.compressed_all_reduce(
      ...     "data", compressor=qc.onebit(), key=jax.random.key(0)), optax.sgd(0.1))
      >>> specs = transforms.state_specs(
      ...     jax.eval_shape(tx.init, {"w": jnp.zeros((8, 8))}), "data")
      >>> specs[0].feedback.residual["w"] == jax.P("data"), specs[0].count == jax.P()
      (True, True)
    """

    specs = _specs(state, axis_name)
    _check_placed(state, specs, axis_name)
    return specs


def _specs(state: Any, axis_name: AxisName) -> Any:
    def spec(node: Any) -> Any:
        if not _has_per_device_fields(node):
            return P()
        fields = _per_device_fields(node) or ()
        return type(node)(*[
            jax.tree.map(lambda _: P(axis_name), value) if name in fields
            else _specs(value, axis_name)
            for name, value in zip(node._fields, node, strict=True)])

    return jax.tree.map(spec, state, is_leaf=_has_per_device_fields)


def _check_placed(state: Any, specs: Any, axis_name: AxisName) -> None:
    """Raises when a per-device leaf of a concrete state sits unplaced on one
    device of several (a ``tx.init`` state: the step's ``shard_map`` would
    cut its first dimension across the devices, or fail to), or is placed
    along another axis than ``axis_name``."""
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(state), flat_specs,
                                  strict=True):
        if spec == P() or not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
            continue
        where = jax.tree_util.keystr(path)
        placed = (leaf.sharding.spec[0] if isinstance(leaf.sharding, NamedSharding)
                  and len(leaf.sharding.spec) else None)
        if placed is not None and mesh_axes(placed) != mesh_axes(axis_name):
            raise ValueError(
                f"axis_name {axis_name!r}: the state's per-device leaf {where} is placed "
                f"along {placed!r} (mesh axes {tuple(leaf.sharding.mesh.axis_names)}); pass "
                f"the data axis the state was made for, state_specs(state, {placed!r})")
        if (jax.device_count() > 1 and leaf.size > 0
                and isinstance(leaf.sharding, jax.sharding.SingleDeviceSharding)):
            raise ValueError(
                f"the state's per-device leaf {where} (shape "
                f"{tuple(leaf.shape)}) is not placed on the mesh: it has no leading device "
                f"axis. Make the state with transforms.init_sharded(tx, params, mesh, "
                f"axis_name) instead of tx.init(params), or restore a checkpoint with "
                f"transforms.restore_sharded.")


def init_sharded(tx: optax.GradientTransformation, params: optax.Params, mesh: Mesh,
                 axis_name: AxisName) -> optax.OptState:
    """``tx.init(params)`` placed on ``mesh``: residuals per device, the rest replicated.

    Per-device leaves get a leading axis of size ``mesh.shape[axis_name]``
    (every device starts from the same value, zeros for residuals) and are
    sharded ``P(axis_name)``; every other leaf is ``P()``. Works across
    processes (each process fills its own devices; all must pass equal
    ``params``).

    Args:
      tx: any optax transformation (a chain containing qcollect transforms).
      params: the parameters: host values, replicated arrays, or arrays
        placed sharded over the mesh's model axes (a ``(data, model)``
        mesh): every state leaf is then sharded as the parameter it
        follows, per-device leaves ``P(axis_name, *param_spec)``.
      mesh: a `jax.sharding.Mesh` with axis ``axis_name``.
      axis_name: the data axis, or a pair ``(outer, inner)`` of mesh axes:
        per-device leaves then get one row per device of both.

    Returns:
      The placed state; `state_specs` of it gives the ``shard_map`` specs.

    Raises:
      ValueError: an axis of ``axis_name`` is not an axis of ``mesh``; ``tx``
        holds ``optax.MultiSteps`` (use `transforms.accumulate`).

    Example:
      >>> import jax, jax.numpy as jnp, optax, qcollect as qc, transforms
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = transforms.compressed_all_reduce("data", compressor=qc.onebit(),
      ...                                       key=jax.random.key(0))
      >>> state = transforms.init_sharded(tx, {"w": jnp.zeros((8, 8))}, mesh, "data")
      >>> state.feedback.residual["w"].shape == (jax.device_count(), 8, 8)
      True
    """
    missing = [a for a in mesh_axes(axis_name) if a not in mesh.shape]
    if missing:
        raise ValueError(f"axis_name {axis_name!r}: {missing[0]!r} is not an axis of the "
                         f"mesh {tuple(mesh.shape)}")
    n = math.prod(mesh.shape[a] for a in mesh_axes(axis_name))
    if _model_sharded(params):
        state = init_like_params(tx, params, mesh)
        return jax.tree.map(functools.partial(_place_like_params, mesh=mesh, n=n,
                                              axis_name=axis_name),
                            state, _specs(state, axis_name))
    with jax.set_mesh(mesh):
        state = jax.jit(tx.init)(params)

    def place(leaf: jax.Array, spec: P) -> jax.Array:
        if spec != P():
            leaf = jnp.broadcast_to(leaf[None], (n,) + jnp.shape(leaf))
        return put(leaf, NamedSharding(mesh, spec))

    return jax.tree.map(place, state, _specs(state, axis_name))


def _place_like_params(leaf: jax.Array, spec: P, *, mesh: Mesh, n: int,
                       axis_name: AxisName) -> jax.Array:
    """A state leaf made by `init_like_params` on ``mesh``: its own spec, or
    per device (``spec`` not ``P()``) ``P(axis_name, *its spec)``."""
    block = leaf.sharding.spec
    leaf = jax.device_put(leaf, NamedSharding(mesh, block))
    if spec == P():
        return leaf
    return jax.jit(lambda a: jnp.broadcast_to(a[None], (n,) + a.shape),
                   out_shardings=NamedSharding(mesh, P(axis_name, *block)))(leaf)


def _model_sharded(params: Any) -> bool:
    """Some leaf of ``params`` is placed sharded on a mesh (over model axes)."""
    return any(isinstance(getattr(leaf, "sharding", None), NamedSharding)
               and any(entry is not None for entry in leaf.sharding.spec)
               for leaf in jax.tree.leaves(params))


def init_like_params(tx: optax.GradientTransformation, params: optax.Params,
                     mesh: Mesh) -> optax.OptState:
    """``tx.init(params)`` with each state leaf sharded as the parameter it
    follows (moments, residuals), on ``mesh`` with explicit axis types.

    Under explicit axes ``zeros_like`` keeps its argument's sharding (with
    automatic axes the compiler may replicate it), so the state is made on a
    copy of ``mesh`` whose axes are explicit; callers place it back on
    ``mesh`` by each leaf's ``sharding.spec``.
    """
    explicit = Mesh(mesh.devices, mesh.axis_names,
                    axis_types=(AxisType.Explicit,) * len(mesh.axis_names))
    moved = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(explicit, a.sharding.spec)),
                         params)
    with jax.set_mesh(explicit):
        return jax.jit(tx.init)(moved)


def put(value: Any, sharding: Sharding) -> jax.Array:
    """``device_put`` that also works when the mesh spans several processes.

    ``device_put`` onto other processes' devices is not allowed, so each
    process fills its own shards from its copy (equal on every process).
    PRNG key arrays travel as their key data.
    """
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    is_key = jax.dtypes.issubdtype(jnp.result_type(value), jax.dtypes.prng_key)
    host = np.asarray(jax.random.key_data(value) if is_key else value)
    out = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.random.wrap_key_data(out, impl=jax.random.key_impl(value)) if is_key else out
