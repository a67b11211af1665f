"""`compressed_model_averaging`: local SGD whose periodic weight exchange is
compressed (Oland and Raj exchange weights, not gradients).

The data-parallel scheme of Oland and Raj (section 2): every replica trains
on its own data with no gradient communication, and periodically the workers
exchange their *weights*, compressed (Algorithm 1), "such that they all end
up having the exact same averaged weights". On step ``t`` (``state.count``):

* ``(t + 1) % every_k != 0``: the updates pass through unchanged; nothing is
  communicated.
* otherwise each replica's would-be new weights ``w = params + updates``
  (float32) are averaged over ``axis_name`` through ``compressor`` and the
  update becomes ``mean(decoded w) - params``, so after
  ``optax.apply_updates`` every replica holds the compressed average. The
  phase is a `lax.cond` on the step count, identical on all devices, with
  the collectives inside the averaging branch, so the local steps really
  send nothing (`qcollect.wire_bytes` counts the larger branch, i.e. the
  averaging step).

Collective: ``qc.compressed_all_reduce(..., algorithm="pairwise",
fuse=False)``. The entropy quantizer is not linear, so payloads cannot be
summed on a ring; an all-gather of whole payloads would quantize once but
send ``N - 1`` payloads per device, against ``2 (N - 1) / N`` for pairwise
exchange (each device's chunk encoded once and sent to its owner, which
decodes, averages, re-encodes once with a new codebook -- the paper's
"whenever a worker ... averages the weights it received with its own, and
sends along the results, it must first adapt the quantization and encoding
meta-data" -- and a ring all-gather of the owner's payloads). Every device
decodes the same gathered payloads, so the averages agree bit for bit (after
``optax.apply_updates`` the replicas agree up to the rounding of ``params +
(avg - params)``, one float32 ulp of the weights). Each value is quantized
twice (origin and owner): the error of the average is at most half a bin of
the origins' chunk ranges plus half a bin of the owner's chunk range (bin
width ``(w_max - w_min) / 2**N`` with ``N >= floor``). Every layer is
reduced on its own (``fuse=False``; an entropy-coded leaf is never fused
anyway, its groups being whole leaves) and every device's share of it gets
its own ``[w_min, w_max]``, bit-width and code, as in Algorithm 1's
per-layer loop.

Static sizes (entropy): the bit-width ``N`` and Huffman stream length depend
on the data, and one jitted step cannot change shapes. The default
compressor therefore encodes *unplanned*: each chunk's payload carries the
worst-case capacity, ``2**ceiling`` 4-bit code lengths and ``ceil(n_chunk *
ceiling / 32)`` stream words, which can never overflow. A payload thus costs
about ``ceiling`` bits per value (plus the code table per chunk) whatever
the Huffman code needs (``c.plan``; docs/transforms.md, "Compressed model
averaging", has the measured bits per value and per parameter). To send
less, pass a planned compressor (``compressor=lambda path, leaf:
c.with_plan(plans[path])``, one plan per leaf sized for a chunk of
``ceil(leaf.size / N)`` values, with margin): a plan too small for some
chunk sets that payload's range to NaN, and the average then turns
non-finite (below), never silently wrong.

Leaves with fewer than ``min_size`` values (default 0, as in every
transform) are averaged uncompressed (``lax.pmean``). Pass about 4096 with
the entropy compressor: each compressed chunk carries a
``2**ceiling``-entry code table (512 bytes at ``ceiling=10``), so below a
few thousand values float32 moves fewer bytes (Grubic et al. 3.2.2
likewise keep small matrices in full precision).

Non-finite weights: compressors map NaN/Inf to non-finite output (a
non-finite value makes its chunk's ``[w_min, w_max]`` non-finite), and
``pmean`` propagates them, so a replica with non-finite weights in a leaf
makes the average of (at least the affected chunks of) that leaf non-finite
on *every* replica after the averaging step: it is never hidden in a finite
average. The state holds only the count and key, so nothing in it can be
poisoned; the count advances on every step so the schedule stays identical
on all devices. Between averaging steps a non-finite update passes through
to its own replica only. To skip bad steps, wrap the inner optimizer, not
this transformation: ``optax.chain(optax.apply_if_finite(inner, k),
compressed_model_averaging(...))`` (wrapping this one would let devices
disagree on running the collectives).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

import qcollect as qc
from qcollect.checks import check_floating_leaves, check_int, check_key
from transforms._axes import AxisName, check_axis, to_varying
from transforms._blocks import leaves_like
from transforms._policy import (
    CompressorSpec,
    check_compressor,
    group_indices,
    leaf_compressors,
    sum_uncompressed,
)

__all__ = ["ModelAveragingState", "compressed_model_averaging"]


class ModelAveragingState(NamedTuple):
    """State of `compressed_model_averaging` (the same on every device).

    Attributes:
      count: int32 step count; step ``t`` averages when ``(t + 1) % every_k == 0``.
      key: PRNG key; the averaging at step ``t`` uses ``fold_in(key, t)``, then
        the collective folds in the device index.
    """

    count: jax.Array
    key: jax.Array


def compressed_model_averaging(axis_name: AxisName, *, every_k: int, key: jax.Array,
                               compressor: CompressorSpec | None = None,
                               min_size: int = 0) -> optax.GradientTransformation:
    """Local SGD with a compressed average of the weights every ``every_k`` steps.

    Every replica trains on its own data; on every ``every_k``-th step the
    would-be new weights ``params + updates`` are averaged over ``axis_name``
    through ``compressor`` (pairwise exchange, each layer on its own) and the
    update becomes ``average - params``. docs/transforms.md ("Compressed
    model averaging") has the details. Use it last in a chain (it needs ``params``)::

        optax.chain(optax.sgd(lr), compressed_model_averaging("data", every_k=8, key=k))

    Args:
      axis_name: the data-parallel axis (``shard_map`` or ``pmap``). The
        replicas' parameters (and the inner optimizer's state) really differ
        between averages, so they are per device: stacked along a leading
        device axis (``P(axis_name)`` under ``shard_map``).
      every_k: average every ``every_k`` steps, an integer >= 1.
      key: PRNG key (the same on every device) for stochastic compressors.
      compressor: a qcollect `Compressor`, or ``f(path, leaf) -> Compressor |
        None`` per leaf (None: uncompressed). Default ``qc.entropy()``
        (the paper's sections 4, 5.1-5.2), unplanned.
      min_size: leaves with fewer values are averaged uncompressed
        (``qc.fused_psum``); an integer >= 0. The default, 0, compresses
        every leaf, as in every transform; with the entropy compressor
        ``min_size=4096`` sends fewer bytes (each chunk carries a code
        table: docs/transforms.md, "Compressed model averaging").

    Returns:
      An ``optax.GradientTransformation``; ``update(updates, state, params)``.

    Raises:
      ValueError: a setting out of its range (naming it). ``update`` raises
        ValueError without ``params``, or (at trace time) when ``updates``
        and ``params`` are not one tree, naming the first differing leaf
        path, or a leaf's shapes differ, naming it and both shapes.

    References:
      Oland, Raj, ICASSP 2015: section 2 (periodic synchronous weight
      exchange), section 3.4 and Algorithms 1-2 (the compressor);
      Dryden et al., MLHPC 2016 <https://doi.org/10.1109/MLHPC.2016.004>,
      section 3.4 (pairwise exchange).

    Example:
      >>> import jax, jax.numpy as jnp, optax, transforms
      >>> tx = optax.chain(optax.sgd(0.1),
      ...                  transforms.compressed_model_averaging(
      ...                      "data", every_k=4, key=jax.random.key(0)))
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> int(state[1].count)
      0
    """
    every_k = check_int("every_k", every_k)
    key = check_key("key", key)
    min_size = check_int("min_size", min_size, low=0)
    compressor = check_compressor("compressor", compressor, allow_none=True)
    settings = _Settings(axis_name=axis_name, every_k=every_k, min_size=min_size,
                         compressor=qc.entropy() if compressor is None else compressor)
    return optax.GradientTransformation(functools.partial(_init, key=key),
                                        functools.partial(_update, settings=settings))


class _Settings(NamedTuple):
    """The validated static settings of one `compressed_model_averaging`."""

    axis_name: AxisName
    every_k: int
    min_size: int
    compressor: CompressorSpec


def _init(params: optax.Params, *, key: jax.Array) -> ModelAveragingState:
    del params
    return ModelAveragingState(jnp.zeros([], jnp.int32), key)


def _update(updates: optax.Updates, state: ModelAveragingState,
            params: optax.Params | None = None, *,
            settings: _Settings) -> tuple[optax.Updates, ModelAveragingState]:
    """Local steps pass ``updates`` through; every ``every_k``-th step
    returns ``average - params`` instead (`_average`)."""
    if params is None:
        raise ValueError("compressed_model_averaging needs params: call "
                         "update(updates, state, params)")
    axis_name = settings.axis_name
    check_axis(axis_name)
    check_floating_leaves(updates, "updates")
    leaves, treedef = jax.tree.flatten(updates)
    weights = _weights_of(updates, params)
    comps = leaf_compressors(params, settings.compressor, min_size=settings.min_size)
    step_key = jax.random.fold_in(state.key, state.count)
    next_count = optax.safe_int32_increment(state.count)
    out = lax.cond(next_count % settings.every_k == 0,  # equal on every device
                   lambda ups, ws: _average(ups, ws, comps, step_key, axis_name),
                   lambda ups, ws: to_varying(list(ups), axis_name),
                   leaves, weights)
    return treedef.unflatten(out), ModelAveragingState(count=next_count, key=state.key)


def _weights_of(updates: optax.Updates, params: optax.Params) -> list[Any]:
    """The leaves of ``params`` at the leaves of ``updates``, each of its update's shape."""
    weights = leaves_like(updates, params, "compressed_model_averaging",
                          against="the tree of params", where="the params",
                          hint="Pass update the params these updates are for.")
    for (path, u), w in zip(jax.tree_util.tree_leaves_with_path(updates), weights, strict=True):
        if jnp.shape(u) != jnp.shape(w):
            raise ValueError(f"the update of {jax.tree_util.keystr(path) or 'the root'} "
                             f"has shape {tuple(jnp.shape(u))}, but its params have shape "
                             f"{tuple(jnp.shape(w))}: updates and params must be one tree "
                             f"of equal shapes")
    return weights


def _average(updates: list[jax.Array], weights: list[jax.Array],
             comps: list[qc.Compressor | None], step_key: jax.Array,
             axis_name: AxisName) -> list[jax.Array]:
    """``mean(w) - params`` per leaf, ``w = params + updates`` averaged over
    ``axis_name``: through each group of equal compressors (group ``g`` draws
    ``fold_in(step_key, g)``), exactly for the leaves without one."""
    new = [w.astype(jnp.float32) + u.astype(jnp.float32)
           for u, w in zip(updates, weights, strict=True)]
    avg = sum_uncompressed(new, [c is not None for c in comps], axis_name, mean=True)
    for g, (c, members) in enumerate(group_indices(comps).items()):
        result = qc.compressed_all_reduce(
            [new[i] for i in members], axis_name, c, jax.random.fold_in(step_key, g),
            algorithm="pairwise", mean=True, fuse=False)
        for j, i in enumerate(members):
            avg[i] = result.value[j].astype(jnp.float32)
    return to_varying([(a - w.astype(jnp.float32)).astype(u.dtype)
                       for a, w, u in zip(avg, weights, updates, strict=True)], axis_name)
