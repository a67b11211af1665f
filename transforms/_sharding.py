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
* `local_replica(tree, axis_name)`: inside the step, each device's replica
  of a tree stacked one replica per device (model averaging, DiLoCo),
  checked against the device count.

A state class marks its per-device fields with a ``per_device_fields``
class attribute (set by the `per_device` decorator); `state_specs` finds
such states anywhere in a tree, so it works through ``optax.chain``,
``optax.partition``, ``optax.masked`` and ``optax.apply_if_finite``.

Inside the mapped step a per-device leaf is this device's block: ``(1,
*shape)`` under ``shard_map``, ``(*shape)`` under ``jax.pmap`` (where the
whole state is stacked, pmap-style). The transformations accept both and
hand back the block shape they received.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["init_sharded", "local_replica", "state_specs"]


def per_device(*fields: str):
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
    def mark(cls: type) -> type:
        unknown = [f for f in fields if f not in getattr(cls, "_fields", ())]
        if unknown:
            raise ValueError(f"per_device: {cls.__name__} has no fields {unknown}")
        cls.per_device_fields = fields  # type: ignore[attr-defined]
        return cls
    return mark


# Other libraries' states with per-device fields: optax.MultiSteps accumulates
# each device's own gradients (its inner transformation's state is read as usual).
_OTHER_PER_DEVICE = {optax.MultiStepsState: ("acc_grads",)}


def _per_device_fields(node) -> tuple[str, ...] | None:
    if not isinstance(node, tuple):
        return None
    return getattr(type(node), "per_device_fields", _OTHER_PER_DEVICE.get(type(node)))


def _has_per_device_fields(node) -> bool:
    return _per_device_fields(node) is not None


def state_specs(state, axis_name):
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
      leaf: ``P(axis_name)`` for error-feedback residuals (the fields each
      state class lists in ``per_device_fields``; and the gradient
      accumulators of ``optax.MultiSteps``), ``P()`` for the rest.

    Example:
      >>> import jax, jax.numpy as jnp, optax, qcollect as qc, transforms
      >>> tx = optax.chain(transforms.compressed_all_reduce(
      ...     "data", compressor=qc.onebit(), key=jax.random.key(0)), optax.sgd(0.1))
      >>> specs = transforms.state_specs(
      ...     jax.eval_shape(tx.init, {"w": jnp.zeros((8, 8))}), "data")
      >>> specs[0].residual["w"] == jax.P("data"), specs[0].count == jax.P()
      (True, True)
    """

    specs = _specs(state, axis_name)
    _check_placed(state, specs)
    return specs


def _specs(state, axis_name):
    def spec(node):
        if not _has_per_device_fields(node):
            return P()
        fields = _per_device_fields(node)
        return type(node)(*[
            jax.tree.map(lambda _: P(axis_name), value) if name in fields
            else _specs(value, axis_name)
            for name, value in zip(node._fields, node, strict=True)])

    return jax.tree.map(spec, state, is_leaf=_has_per_device_fields)


def _check_placed(state, specs) -> None:
    """Raises when a per-device leaf of a concrete state sits unplaced on one
    device of several (a ``tx.init`` state): the step's ``shard_map`` would
    cut its first dimension across the devices, or fail to."""
    if jax.device_count() == 1:
        return
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(state), flat_specs,
                                  strict=True):
        if (spec != P() and isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
                and isinstance(leaf.sharding, jax.sharding.SingleDeviceSharding)
                and leaf.size > 0):
            raise ValueError(
                f"the state's per-device leaf {jax.tree_util.keystr(path)} (shape "
                f"{tuple(leaf.shape)}) is not placed on the mesh: it has no leading device "
                f"axis. Make the state with transforms.init_sharded(tx, params, mesh, "
                f"axis_name) instead of tx.init(params), or restore a checkpoint with "
                f"transforms.restore_sharded.")


def init_sharded(tx: optax.GradientTransformation, params, mesh, axis_name):
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

    Example:
      >>> import jax, jax.numpy as jnp, optax, qcollect as qc, transforms
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = transforms.compressed_all_reduce("data", compressor=qc.onebit(),
      ...                                       key=jax.random.key(0))
      >>> state = transforms.init_sharded(tx, {"w": jnp.zeros((8, 8))}, mesh, "data")
      >>> state.residual["w"].shape == (jax.device_count(), 8, 8)
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

    def place(leaf, spec):
        if spec != P():
            leaf = jnp.broadcast_to(leaf[None], (n,) + jnp.shape(leaf))
        return _put(leaf, NamedSharding(mesh, spec))

    return jax.tree.map(place, state, _specs(state, axis_name))


def _place_like_params(leaf, spec, *, mesh, n: int, axis_name):
    """A state leaf made by `init_like_params` on ``mesh``: its own spec, or
    per device (``spec`` not ``P()``) ``P(axis_name, *its spec)``."""
    block = leaf.sharding.spec
    leaf = jax.device_put(leaf, NamedSharding(mesh, block))
    if spec == P():
        return leaf
    return jax.jit(lambda a: jnp.broadcast_to(a[None], (n,) + a.shape),
                   out_shardings=NamedSharding(mesh, P(axis_name, *block)))(leaf)


def _model_sharded(params) -> bool:
    """Some leaf of ``params`` is placed sharded on a mesh (over model axes)."""
    return any(isinstance(getattr(leaf, "sharding", None), NamedSharding)
               and any(entry is not None for entry in leaf.sharding.spec)
               for leaf in jax.tree.leaves(params))


def init_like_params(tx: optax.GradientTransformation, params, mesh):
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


def _put(value, sharding):
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


def device_block(stored, like, axis_name, what: str):
    """A per-device state leaf as this device's value, shaped like ``like``.

    ``stored`` is the block of a ``P(axis_name)`` leaf: ``(1, *shape)`` under
    ``shard_map``, ``(*shape)`` under ``jax.pmap`` or a plain ``tx.init``
    state. A block holding several devices' values means the state was made
    for another device count; that raises instead of silently keeping one.
    """
    size = int(np.prod(jnp.shape(like), dtype=np.int64))
    stored_size = int(np.prod(jnp.shape(stored), dtype=np.int64))
    shape = tuple(jnp.shape(like))
    if stored_size != size or tuple(jnp.shape(stored)) not in (shape, (1,) + shape):
        if size and stored_size % size == 0 and stored_size > size:
            raise _another_device_count(what, stored_size // size, axis_name)
        stored_shape = tuple(jnp.shape(stored))
        if stored_shape[1:] == shape[1:] and stored_shape[:1] != shape[:1]:
            raise ValueError(
                f"{what} has shape {stored_shape} on this device, expected {shape} with a "
                f"leading device axis of 1: the state was not placed per device, so the "
                f"step cut the leaf itself across the devices. Make it with "
                f"transforms.init_sharded (or restore it with transforms.restore_sharded), "
                f"not tx.init")
        raise ValueError(f"{what} has shape {stored_shape}, expected "
                         f"{shape} (or with a leading device axis of 1): "
                         f"the update's leaf has another shape than the one init saw")
    return jnp.reshape(stored, jnp.shape(like))


def _another_device_count(what: str, rows: int, axis_name) -> ValueError:
    """The error for a per-device block of ``rows`` devices' values (not 1)."""
    n = math.prod(int(lax.axis_size(a)) for a in mesh_axes(axis_name))
    return ValueError(
        f"{what} was made for {n * rows} devices along {axis_name!r}, but this mesh has "
        f"{n}: each device's block holds {rows} devices' values. Place per-device values "
        f"with one row per device: transforms.init_sharded for a new state, "
        f"transforms.restore_sharded for a checkpoint (it checks the count).")


def local_replica(tree, axis_name):
    """This device's replica of a tree stacked one replica per device.

    Where the replicas really differ (`transforms.compressed_model_averaging`,
    `transforms.diloco`), the parameters (and the inner optimizer's state)
    are stacked along a leading device axis and sharded ``P(axis_name)``;
    inside ``jax.shard_map`` each leaf arrives as a ``(1, *shape)`` block.
    This returns the blocks without that axis, and raises where a block
    holds several replicas (a tree stacked for another device count, which
    ``a[0]`` would silently cut down to one replica per device). Under
    ``jax.pmap`` leaves already are the device's own and come back as they are.

    Args:
      tree: the step's per-device arguments (parameters, optimizer state).
      axis_name: the data axis they are stacked along.

    Returns:
      ``tree`` with each leaf's leading axis of size 1 removed.

    Raises:
      ValueError: a leaf has no leading axis, or one of another size than 1;
        the message names the leaf and both device counts.

    Example:
      >>> import functools, jax, jax.numpy as jnp, transforms
      >>> n = jax.device_count()
      >>> mesh = jax.make_mesh((n,), ("data",))
      >>> @jax.jit
      ... @functools.partial(jax.shard_map, mesh=mesh, in_specs=jax.P("data"),
      ...                    out_specs=jax.P("data"))
      ... def norms(replicas):
      ...     w = transforms.local_replica(replicas, "data")["w"]  # (3, 4): this device's
      ...     return jnp.linalg.norm(w)[None]
      >>> replicas = jax.device_put({"w": jnp.ones((n, 3, 4))},
      ...                           jax.NamedSharding(mesh, jax.P("data")))
      >>> norms(replicas).shape == (n,)
      True
    """
    if not _tracks_varying(axis_name):
        return tree

    def take(path, leaf):
        rows = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
        if rows != 1:
            what = f"the per-device leaf {jax.tree_util.keystr(path) or 'the root'}"
            if not rows:
                raise ValueError(f"{what} of shape {tuple(jnp.shape(leaf))} has no leading "
                                 f"device axis: stack one replica per device along "
                                 f"{axis_name!r} (P({axis_name!r}))")
            raise _another_device_count(what, rows, axis_name)
        return leaf[0]

    return jax.tree_util.tree_map_with_path(take, tree)


def leaves_like(tree, stored, what: str, *, against: str = "the one init saw",
                where: str = "the state",
                hint: str = "Initialise the state with the same parameter tree.") -> list:
    """``stored``'s entries at the leaves of ``tree`` (``flatten_up_to``).

    Raises:
      ValueError: the two trees differ (the update's gradients are not the
        tree ``init`` saw), naming the first path where they part.
    """
    treedef = jax.tree.structure(tree)
    try:
        return treedef.flatten_up_to(stored)
    except (ValueError, TypeError):
        pass
    keystr = jax.tree_util.keystr
    got = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    saw = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        stored, is_leaf=lambda x: isinstance(x, optax.MaskedNode) or hasattr(x, "shape"))[0]]
    first = next((i for i, (a, b) in enumerate(zip(got, saw, strict=False)) if a != b),
                 min(len(got), len(saw)))
    here = got[first] if first < len(got) else "(no more leaves)"
    there = saw[first] if first < len(saw) else "(no more leaves)"
    raise ValueError(f"the update's tree is not {against} ({what}): first difference "
                     f"at leaf {first}: {here or 'the root'} in the update, {there or 'the root'} "
                     f"in {where} ({len(got)} leaves against {len(saw)}). {hint}")


def as_block(value, stored):
    """``value`` back in the block shape ``stored`` arrived in."""
    return jnp.reshape(value, jnp.shape(stored))


def check_local_gradients(grads, axis_name) -> None:
    """Raises when gradients are already summed over ``axis_name``.

    Under ``shard_map``, ``jax.grad`` with respect to replicated (``P()``)
    parameters transposes their implicit broadcast into an uncompressed
    ``psum``: such gradients are invariant along the axis and the compressed
    all-reduce would sum them a second time. Differentiate with respect to
    ``lax.pcast(params, axis_name, to="varying")`` to get this device's own
    gradients. Under ``jax.pmap`` (no such types) nothing is checked.
    """
    if not _tracks_varying(axis_name):
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        if not _varies_along(leaf, axis_name) and int(np.prod(jnp.shape(leaf))) > 0:
            raise ValueError(
                f"the gradient {jax.tree_util.keystr(path) or 'leaf'} is invariant along "
                f"{axis_name!r}, but the update needs each device's own gradients. Either "
                f"jax.grad was taken with respect to replicated parameters, which sums "
                f"the gradients with an uncompressed psum: differentiate with respect to "
                f"jax.lax.pcast(params, {axis_name!r}, to='varying'). Or the gradients come "
                f"from state placed replicated (P()), such as gradient accumulators: place "
                f"the state with transforms.init_sharded and transforms.state_specs, which "
                f"put the accumulators of transforms.accumulate and optax.MultiSteps per "
                f"device.")


def _varying_axes(leaf) -> frozenset:
    """The mesh axes ``leaf`` is typed as varying along (empty outside shard_map)."""
    return varying_axes_of(jax.typeof(leaf))


def varying_axes_of(aval) -> frozenset:
    """The mesh axes an abstract value (``jax.typeof``, a jaxpr's ``out_avals``)
    is typed as varying along."""
    mat = getattr(aval, "mat", None)
    axes = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)
    return frozenset(axes or ())


def mesh_axes(axis_name) -> tuple:
    """The mesh axes of a data axis: ``"data"`` -> ``("data",)``, a tuple as is."""
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _varies_along(leaf, axis_name) -> bool:
    return set(mesh_axes(axis_name)) <= _varying_axes(leaf)


def check_axis(axis_name) -> None:
    """Raises unless every axis of ``axis_name`` is bound here.

    A transformation's update runs inside ``jax.shard_map`` (or ``jax.pmap``)
    over its data axis; a name that is not one of the mapped axes would
    otherwise fail deep inside a collective (a ``NameError``, or an
    ``AssertionError`` without a message from ``lax.pmean``).

    Raises:
      ValueError: naming ``axis_name``, the axis that is not bound, and the
        axes that are (the mapped axes of the current mesh).
    """
    for axis in mesh_axes(axis_name):
        try:
            lax.axis_index(axis)
        except NameError:
            mesh = jax.sharding.get_abstract_mesh()
            mapped = tuple(getattr(mesh, "manual_axes", ()) or ())
            others = tuple(a for a in getattr(mesh, "axis_names", ()) if a not in mapped)
            bound = (f"the mapped axes here are {', '.join(map(repr, mapped))}" if mapped
                     else "no mesh axis is mapped here")
            if others:
                bound += f" (the mesh's other axes, {', '.join(map(repr, others))}, are not)"
            raise ValueError(
                f"axis_name {axis_name!r}: {axis!r} is not a bound axis: {bound}. Run the "
                f"update inside jax.shard_map (or jax.pmap) over {axis!r}, or make the "
                f"transformation with the data axis the step maps over.") from None


def _tracks_varying(axis_name) -> bool:
    """True inside ``shard_map`` over ``axis_name`` with its type check (not pmap).

    Raises:
      ValueError: ``axis_name`` is not bound here (`check_axis`).
    """
    check_axis(axis_name)
    return _varies_along(lax.axis_index(axis_name), axis_name)


def to_varying(tree, axis_name):
    """Every leaf typed varying along ``axis_name`` (a no-op under ``jax.pmap``)."""
    if not _tracks_varying(axis_name):
        return tree

    def cast(leaf):
        missing = tuple(a for a in mesh_axes(axis_name) if a not in _varying_axes(leaf))
        return lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(cast, tree)


def keep_if_finite(finite, new, old):
    """``new`` where ``finite`` (a scalar bool), else ``old``, leaf by leaf.

    Every transformation here leaves its state as it was on a step whose
    reduced update is non-finite; the update is non-finite on every device
    alike, so all devices keep or advance together.
    """
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def all_finite(tree) -> jax.Array:
    """Scalar bool: every value of every leaf of ``tree`` is finite."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.array(True)
    flags = jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves])
    # XLA folds the reduction of a stack of scalars into a chain of ands and
    # copies that chain into every consumer (each leaf's `keep_if_finite`):
    # a program quadratic in the leaves. Behind an identity gather, which it
    # never copies, the flags are reduced once.
    flags = flags.at[jnp.arange(len(leaves))].get(
        mode="promise_in_bounds", indices_are_sorted=True, unique_indices=True)
    return jnp.all(flags)
