"""`gradiveq`: GradiVeQ's schedule of sampled, PCA-fitted and compressed steps.

Yu et al., "GradiVeQ: Vector Quantization for Bandwidth-Efficient Gradient
Aggregation in Distributed CNN Training" (NeurIPS 2018), sections 2 and 3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import qcollect as qc
from transforms._policy import sum_uncompressed
from transforms._sharding import (
    all_finite,
    as_block,
    check_local_gradients,
    device_block,
    keep_if_finite,
    leaves_like,
    mesh_axes,
)

#: Default compressor of the warm-up and sampling steps (section 3: QSGD).
_QSGD4 = qc.qsgd(bits=4)


class GradiVeQState(NamedTuple):
    """State of `gradiveq`.

    Leaves that are not compressed are ``optax.MaskedNode()`` in every
    per-leaf field. Only ``residual`` differs per device (``P(axis_name)``,
    see `transforms.state_specs`); every other field is computed from
    aggregated data and is the same on every device.

    Attributes:
      residual: per device: float32 tree like the gradients, what error
        feedback still owes, ``input - contributed`` (``MaskedNode`` without
        error feedback).
      samples: per compressed leaf, float32 ``(L_t, s * K)``: slot ``i`` holds
        the ``s`` sampled slices of the aggregated (summed over devices)
        gradient of the ``i``-th sampling step of the current cycle.
      valid: bool ``(L_t,)``: which slots hold a sample of this cycle (a step
        with non-finite gradients writes none).
      basis: per compressed leaf, float32 ``(K, r)``: ``U_d`` with ``r`` static
        columns; columns ``d..r-1`` are zero. All zero before the first fit.
      mean: per compressed leaf, float32 ``(K,)``: the whitening vector ``mu``.
      rank: per compressed leaf, int32 scalar: ``d`` of eq. (6) (or the fixed
        rank); 0 before the first fit.
      key: PRNG key; step ``t`` uses ``fold_in(key, t)``.
      count: int32 step count.
      cycle_start: int32 step at which the current cycle began (``warmup_steps``,
        then every ``L_t + L_c`` steps, or the step after a stop-early vote).
        The phase is ``(count - cycle_start) mod (L_t + L_c)`` compared with
        ``L_t``: values equal on all devices.
    """

    residual: Any
    samples: Any
    valid: jax.Array
    basis: Any
    mean: Any
    rank: Any
    key: jax.Array
    count: jax.Array
    cycle_start: jax.Array

    per_device_fields = ("residual",)


class _Leaf(NamedTuple):
    slice_size: int    # K
    columns: int       # r, static basis width
    sampled: int       # s, slices sampled per step
    num_slices: int    # full slices in the leaf


def _check_int(name, value, low, high=None):
    bad = isinstance(value, bool) or not isinstance(value, (int, np.integer))
    if bad or value < low or (high is not None and value > high):
        upper = "inf" if high is None else str(high)
        raise ValueError(f"{name} must be an integer in [{low}, {upper}], got {value!r}")
    return int(value)


def _sample_rows(flat, leaf: _Leaf):
    """The ``s`` evenly spaced full slices of a flat leaf, concatenated: ``(s * K,)``."""
    k = leaf.slice_size
    starts = [(j * leaf.num_slices) // leaf.sampled * k for j in range(leaf.sampled)]
    return jnp.concatenate([flat[a:a + k] for a in starts])


def _aggregate_sampled(xs, axis_name, compressor, key, algorithm, unroll=qc.UNROLL_BUCKETS):
    """Sum over devices through the sample compressor (or exactly): (sums, contributed)."""
    if compressor is None:
        sums = qc.fused_psum(list(xs), axis_name)
        return sums, list(xs), jnp.zeros((), jnp.int32)
    result = qc.compressed_all_reduce(xs, axis_name, compressor, key, algorithm=algorithm,
                                      unroll_buckets=unroll)
    return (list(result.value), [c.astype(jnp.float32) for c in result.contributed],
            jnp.zeros((), jnp.int32))


def _aggregate_pca(xs, bases, means, axis_name, key, stop_loss=None,
                   unroll=qc.UNROLL_BUCKETS):
    """Compressed-domain ring sum, one PCA compressor per leaf.

    Leaves of one shape and basis shape form a class. Where
    `qcollect.runs_batched` says so for ``unroll`` (by default: leaves of at
    most 4 MiB, or more than 16 larger ones), a class runs as one batch
    (`jax.vmap` over the leaves, each with its own basis, mean and key): the
    program holds one ring per class, not per leaf, and each hop carries the
    whole class's payloads in one message, for the price of a copy of the
    leaves into a stack (the rule and its measurements are those of the
    buckets of `qcollect.compressed_all_reduce`). Other classes run leaf by
    leaf. Results are the leaves' own either way.

    Returns ``(sums, contributed, votes)``: ``votes`` is the number of devices
    whose local compression loss (eq. 7) over ``||x||^2`` exceeds
    ``stop_loss`` (0 without it).
    """
    # The payloads summed: one per device, or one per node when hierarchical.
    axes = mesh_axes(axis_name)
    n = int(lax.axis_size(axes[0] if len(axes) == 2 else axis_name))

    def reduce_leaf(x, u, mu, leaf_key):
        result = qc.compressed_all_reduce(x, axis_name, qc.pca(u, mu, num_workers=n),
                                          leaf_key, algorithm="ring")
        return result.value.astype(jnp.float32), result.contributed.astype(jnp.float32)

    sums, contributed = [None] * len(xs), [None] * len(xs)
    classes: dict[tuple, list[int]] = {}
    for j, arrays in enumerate(zip(xs, bases, means, strict=True)):
        signature = tuple((jnp.shape(a), jnp.result_type(a)) for a in arrays)
        classes.setdefault(signature, []).append(j)
    for members in classes.values():
        keys = [jax.random.fold_in(key, j) for j in members]
        nbytes = int(np.prod(jnp.shape(xs[members[0]]))) * jnp.result_type(xs[members[0]]).itemsize
        if not qc.runs_batched(len(members), nbytes, unroll):
            for j, leaf_key in zip(members, keys, strict=True):
                sums[j], contributed[j] = reduce_leaf(xs[j], bases[j], means[j], leaf_key)
            continue
        stacked = [jnp.stack([arrays[j] for j in members]) for arrays in (xs, bases, means)]
        class_sums, class_contributed = jax.vmap(reduce_leaf)(*stacked, jnp.stack(keys))
        for t, j in enumerate(members):
            sums[j], contributed[j] = class_sums[t], class_contributed[t]
    if stop_loss is None:
        return sums, contributed, jnp.zeros((), jnp.int32)
    loss = sum(jnp.sum((x - c) ** 2) for x, c in zip(xs, contributed, strict=True))
    energy = sum(jnp.sum(x ** 2) for x in xs)
    vote = (loss > stop_loss * energy).astype(jnp.int32)
    return sums, contributed, lax.psum(vote, axis_name)


def _fill_invalid(samples, valid):
    """Rows of slots without a sample replaced by copies of valid rows (cyclically)."""
    slots = valid.shape[0]
    order = jnp.argsort(jnp.logical_not(valid), stable=True)   # valid slots first
    nvalid = jnp.maximum(jnp.sum(valid.astype(jnp.int32)), 1)
    rank_of = jnp.cumsum(jnp.logical_not(valid).astype(jnp.int32)) - 1
    source = jnp.where(valid, jnp.arange(slots), order[jnp.mod(rank_of, nvalid)])
    return samples[source]


def gradiveq(axis_name, *, key: jax.Array, slice_size: int | Callable,
             loss_threshold: float | None = None, rank: int | None = None,
             max_rank: int | None = None, warmup_steps: int = 0, sample_steps: int = 100,
             compressed_steps: int = 400, sample_slices: int = 1, min_size: int = 0,
             compress_if: Callable | None = None,
             sample_compressor: qc.Compressor | None = _QSGD4,
             sample_algorithm: str = "auto", stop_loss: float | None = None,
             mean: bool = True, error_feedback: bool = True,
             unroll_buckets: int | str | None = qc.UNROLL_BUCKETS) -> optax.GradientTransformation:
    """GradiVeQ: PCA compressors fitted on aggregated gradients, summed on a ring.

    The step count picks the phase, so every device takes the same branch
    (`lax.cond`, collectives inside the branches):

    * warm-up, ``t < warmup_steps``: the compressed leaves are summed through
      ``sample_compressor`` (`qcollect.compressed_all_reduce`, by default
      QSGD-4 with the pairwise algorithm, section 3: "we will apply a scalar
      quantization technique such as QSGD to these iterations"), or exactly
      (``lax.psum``) when it is None.
    * then cycles of ``L_t + L_c`` steps. The first ``L_t = sample_steps``
      aggregate like the warm-up and store ``s = sample_slices`` evenly
      spaced ``K``-value slices of every compressed leaf's aggregated sum in a
      static ``(L_t, s * K)`` buffer; ``s = 1`` is the paper's first slice and
      compressor reuse factor ``s = inf``, more slices are pooled into the
      same fit. At the end of the ``L_t``-th step `qcollect.pca_fit` turns the
      buffer into ``U_d`` and ``mu`` per leaf (eq. 6). The fit reads aggregated
      data only, so it is identical on all devices without communication.
    * the next ``L_c = compressed_steps`` steps send every slice as
      ``U_d^T (g - mu / N)`` (eq. 3) through the compressed-domain ring of
      Algorithm 1 (`qcollect.compressed_all_reduce` with `qcollect.pca`,
      ``algorithm="ring"``) and decode once (eq. 4-5). Then the next cycle
      samples again and refreshes the compressors.
    * optional stop-early (section 3, "Number of compressed iterations"):
      with ``stop_loss`` each device computes its local compression loss,
      eq. (7) ``||g_n - (U_d g'_n + mu / N)||^2`` summed over the compressed
      leaves, relative to ``||g_n||^2``; if more than half of the devices
      exceed ``stop_loss`` (one ``lax.psum`` of the votes), the compressed
      phase ends and the next step starts a new cycle with sampling.

    Static rank: with ``rank=d`` the basis has ``d`` columns. With
    ``loss_threshold=lambda``, eq. (6) picks the smallest ``d`` whose explained
    energy reaches ``1 - lambda``; the shapes cannot depend on it, so the basis
    has ``r = min(max_rank, K)`` columns of which ``d..r-1`` are zero. The wire
    always carries ``r`` float32 coefficients per slice (compression ``K / r``);
    the accuracy is that of ``d`` (zero columns send zeros). If ``d > r``
    the fit keeps ``r`` columns and loses more than ``lambda``; ``state.rank``
    still reports ``d``, and error feedback keeps what is lost.

    Error feedback (``input = g + residual``, ``residual = input -
    contributed``, float32) runs in all phases; in the compressed phase the
    residual is this device's local compression loss, the vector whose norm is
    eq. (7). Leaves with fewer than ``max(min_size, K)`` values, or failing
    ``compress_if`` (default: at least 2 dimensions, i.e. conv and dense
    kernels; section 2, footnote 3 keeps biases out), are averaged exactly
    (``qc.fused_psum``) every step. The update is the mean (or sum) over devices.

    The ring cuts each leaf into ``N`` chunks of whole slices
    (`qcollect.compressed_all_reduce` never splits a slice or lets one span
    two leaves): the leaf is zero-padded to whole slices (a last partial
    slice is compressed with zeros after it) and to a multiple of ``N``
    slices, so a leaf with fewer than ``N`` slices also sends ``d``
    coefficients for each zero slice of padding.

    Flattening: Flax kernels ``(H, W, D, F)`` and ``(in, out)`` flatten
    row-major with ``F`` (``out``) innermost, Fig. 3a's order; pick ``K`` a
    multiple of ``F * D`` (section 3, "Slice size K").

    Non-finite gradients: the reduced update is then non-finite on every
    device (both aggregations propagate NaN/Inf), and that is what the step
    decides on, so all devices agree. Such a step keeps the residuals, writes
    no sample (its slot is marked invalid in ``state.valid``) and leaves
    basis and mean alone; the count still advances. At a fit, invalid slots
    are filled with copies of the cycle's valid samples; with none at all the
    previous compressors are kept. The non-finite update is passed on: chain
    ``optax.apply_if_finite`` after this transformation to skip it.

    Args:
      axis_name: the data-parallel axis (``shard_map`` or ``pmap``).
      key: PRNG key for the sample compressor (the same on every device).
      slice_size: ``K >= 1``, values per slice, or ``f(path, leaf) -> K | None``
        per leaf (None: uncompressed).
      loss_threshold: ``lambda`` in [0, 1) of eq. (6); needs ``max_rank``.
        Exactly one of ``loss_threshold`` and ``rank``.
      rank: a fixed ``d >= 1`` (at most every compressed leaf's ``K``).
      max_rank: with ``loss_threshold``: static cap ``r >= 1`` on basis
        columns (clipped to ``K``).
      warmup_steps: steps before the first cycle, ``>= 0``.
      sample_steps: ``L_t >= 1``, sampling steps per cycle.
      compressed_steps: ``L_c >= 1``, compressed steps per cycle.
      sample_slices: slices sampled per leaf and step, ``>= 1`` (clipped to the
        leaf's number of slices).
      min_size: leaves with fewer values go uncompressed, ``>= 0``.
      compress_if: optional predicate ``(path, leaf) -> bool``; default
        ``leaf.ndim >= 2``.
      sample_compressor: a qcollect `Compressor` for warm-up and sampling
        steps, or None for exact sums.
      sample_algorithm: its `qcollect.compressed_all_reduce` algorithm
        (``"auto"``: pairwise for non-linear compressors).
      stop_loss: None (run all ``L_c`` compressed steps) or a relative
        local compression loss in (0, inf) above which a device votes to stop.
      mean: average over devices (default) rather than sum.
      error_feedback: keep residuals (default True).
      unroll_buckets: which classes of leaves of one shape (compressed
        phase) and of equal buckets (warm-up and sampling) run as one batch
        (default ``"auto"``, `qcollect.runs_batched`); None: never. See
        `qcollect.compressed_all_reduce`.

    Returns:
      An ``optax.GradientTransformation``; its state is a `GradiVeQState`.

    Raises:
      ValueError: a setting out of its range (naming it). ``update`` raises
        ValueError (at trace time) on gradients that are not the tree ``init``
        saw, naming the first differing leaf path, or whose leaf has another
        shape, naming it and both shapes.

    References:
      GradiVeQ, section 2 (eq. 2-5, Algorithm 1) and section 3 ("System
      Overview", eq. 6, eq. 7, Fig. 6).

    Example:
      >>> import jax, optax, transforms
      >>> tx = optax.chain(
      ...     transforms.gradiveq("data", key=jax.random.key(0), slice_size=64,
      ...                         loss_threshold=0.05, max_rank=8, warmup_steps=10,
      ...                         sample_steps=20, compressed_steps=80),
      ...     optax.adam(1e-3))
    """
    if (loss_threshold is None) == (rank is None):
        raise ValueError("exactly one of loss_threshold and rank must be given, got "
                         f"loss_threshold={loss_threshold!r}, rank={rank!r}")
    if loss_threshold is not None:
        ok = isinstance(loss_threshold, (int, float, np.floating)) and not isinstance(
            loss_threshold, bool)
        if not ok or not 0.0 <= float(loss_threshold) < 1.0:
            raise ValueError(f"loss_threshold must be a number in [0, 1), got {loss_threshold!r}")
        if max_rank is None:
            raise ValueError("max_rank (an integer in [1, inf]) is required with loss_threshold: "
                             "the static number of basis columns")
        max_rank = _check_int("max_rank", max_rank, 1)
    else:
        rank = _check_int("rank", rank, 1)
        if max_rank is not None:
            raise ValueError(f"max_rank applies to loss_threshold only, got max_rank={max_rank!r}")
    if not callable(slice_size):
        slice_size = _check_int("slice_size", slice_size, 1)
    warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
    sample_steps = _check_int("sample_steps", sample_steps, 1)
    compressed_steps = _check_int("compressed_steps", compressed_steps, 1)
    sample_slices = _check_int("sample_slices", sample_slices, 1)
    min_size = _check_int("min_size", min_size, 0)
    qc.runs_batched(1, 0, unroll_buckets)  # ValueError naming unroll_buckets
    if sample_compressor is not None and not isinstance(sample_compressor, qc.Compressor):
        raise ValueError("sample_compressor must be a qcollect Compressor or None, got "
                         f"{type(sample_compressor).__name__}")
    if sample_algorithm not in ("auto",) + qc.ALGORITHMS:
        raise ValueError(f"sample_algorithm must be one of {('auto',) + qc.ALGORITHMS}, "
                         f"got {sample_algorithm!r}")
    if stop_loss is not None:
        ok = isinstance(stop_loss, (int, float, np.floating)) and not isinstance(stop_loss, bool)
        if not ok or not 0.0 < float(stop_loss) < np.inf:
            raise ValueError(f"stop_loss must be None or a number in (0, inf), got {stop_loss!r}")
        stop_loss = float(stop_loss)
    cycle = sample_steps + compressed_steps

    def plan(tree) -> list[_Leaf | None]:
        out = []
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            size = int(np.prod(np.shape(leaf)))
            k = slice_size(path, leaf) if callable(slice_size) else slice_size
            if k is not None:
                k = _check_int(f"slice_size for {jax.tree_util.keystr(path)}", k, 1)
            chosen = (compress_if(path, leaf) if compress_if is not None
                      else np.ndim(leaf) >= 2)
            if k is None or not chosen or size < max(min_size, k):
                out.append(None)
                continue
            if rank is not None and rank > k:
                raise ValueError(f"rank must be an integer in [1, {k}] (the slice size of "
                                 f"{jax.tree_util.keystr(path)}), got {rank!r}")
            columns = rank if rank is not None else min(max_rank, k)
            out.append(_Leaf(k, columns, min(sample_slices, size // k), size // k))
        return out

    def init(params):
        leaves, treedef = jax.tree.flatten(params)
        plans = plan(params)

        def per_leaf(fn):
            return treedef.unflatten([fn(p, lf) if p is not None else optax.MaskedNode()
                                      for p, lf in zip(plans, leaves, strict=True)])

        residual = per_leaf(lambda p, lf: jnp.zeros(jnp.shape(lf), jnp.float32)
                            if error_feedback else optax.MaskedNode())
        return GradiVeQState(
            residual=residual,
            samples=per_leaf(lambda p, lf: jnp.zeros((sample_steps, p.sampled * p.slice_size),
                                                     jnp.float32)),
            valid=jnp.zeros((sample_steps,), jnp.bool_),
            basis=per_leaf(lambda p, lf: jnp.zeros((p.slice_size, p.columns), jnp.float32)),
            mean=per_leaf(lambda p, lf: jnp.zeros((p.slice_size,), jnp.float32)),
            rank=per_leaf(lambda p, lf: jnp.zeros((), jnp.int32)),
            key=key,
            count=jnp.zeros([], jnp.int32),
            cycle_start=jnp.full([], warmup_steps, jnp.int32),
        )

    def check_entries(p, leaf, entries, path):
        """Raises unless ``init`` of a leaf of this shape made these state entries."""
        shape = tuple(np.shape(leaf))
        want = {} if p is None else {
            "residual": shape, "samples": (sample_steps, p.sampled * p.slice_size),
            "basis": (p.slice_size, p.columns), "mean": (p.slice_size,), "rank": ()}
        if not error_feedback:
            want.pop("residual", None)
        for name, entry in entries.items():
            if isinstance(entry, optax.MaskedNode) == (name in want):
                c, res = p is not None, entries["residual"]
                was = ("" if isinstance(res, optax.MaskedNode)
                       else f" (its residual has shape {tuple(jnp.shape(res))})")
                raise ValueError(f"the leaf {path} of shape {shape} is {'' if c else 'not '}"
                                 f"compressed, but init saw it {'un' if c else ''}compressed"
                                 f"{was}: the update's leaf has another shape than the one "
                                 f"init saw")
            if name in want and tuple(jnp.shape(entry)) != want[name]:
                raise ValueError(f"the GradiVeQ {name} of {path} has shape "
                                 f"{tuple(jnp.shape(entry))}, expected {want[name]} for the "
                                 f"leaf of shape {shape}: the update's leaf has another shape "
                                 f"than the one init saw")

    def fit(samples, valid, plans):
        out_basis, out_mean, out_rank = [], [], []
        for buf, p in zip(samples, plans, strict=True):
            rows = _fill_invalid(buf, valid)
            if rank is not None:
                result = qc.pca_fit(rows, slice_size=p.slice_size, rank=rank, slices="all")
            else:
                result = qc.pca_fit(rows, slice_size=p.slice_size, loss_threshold=loss_threshold,
                                    max_rank=p.columns, slices="all")
            out_basis.append(result.basis.astype(jnp.float32))
            out_mean.append(result.mean.astype(jnp.float32))
            out_rank.append(jnp.asarray(result.rank, jnp.int32))
        return out_basis, out_mean, out_rank

    def update(grads, state, params=None):
        del params
        check_local_gradients(grads, axis_name)
        leaves, treedef = jax.tree.flatten(grads)
        plans = plan(grads)
        n = int(lax.axis_size(axis_name))
        flat = {name: leaves_like(grads, getattr(state, name), f"GradiVeQ {name}")
                for name in ("residual", "samples", "basis", "mean", "rank")}
        paths = [jax.tree_util.keystr(p) or "the root"
                 for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
        stored = flat["residual"]
        flat["residual"] = [r if isinstance(r, optax.MaskedNode) else device_block(
                                r, g, axis_name, f"the error-feedback residual of {path}")
                            for r, g, path in zip(stored, leaves, paths, strict=True)]
        for i, (p, g, path) in enumerate(zip(plans, leaves, paths, strict=True)):
            check_entries(p, g, {name: vals[i] for name, vals in flat.items()}, path)
        idx = [i for i, p in enumerate(plans) if p is not None]
        cplans = [plans[i] for i in idx]
        count = state.count
        step_key = jax.random.fold_in(state.key, count)

        out = sum_uncompressed(leaves, [p is not None for p in plans], axis_name, mean=mean)
        xs = [leaves[i].astype(jnp.float32) + (flat["residual"][i] if error_feedback else 0.0)
              for i in idx]

        since = count - state.cycle_start
        pos = jnp.mod(jnp.maximum(since, 0), cycle)
        compressing = (since >= 0) & (pos >= sample_steps)
        sampling = (since >= 0) & (pos < sample_steps)
        if idx:
            bases = [flat["basis"][i] for i in idx]
            means = [flat["mean"][i] for i in idx]
            sums, contributed, votes = lax.cond(
                compressing,
                lambda: _aggregate_pca(xs, bases, means, axis_name, step_key, stop_loss,
                                       unroll_buckets),
                lambda: _aggregate_sampled(xs, axis_name, sample_compressor, step_key,
                                           sample_algorithm, unroll_buckets))
            for j, i in enumerate(idx):
                value = sums[j] / n if mean else sums[j]
                out[i] = value.astype(leaves[i].dtype)
        out = [o.astype(leaf.dtype) for o, leaf in zip(out, leaves, strict=True)]
        # Non-finite anywhere makes the reduced update non-finite everywhere,
        # so this flag agrees across devices without another collective.
        finite = all_finite(out)

        new = {name: list(vals) for name, vals in flat.items()}
        valid = state.valid
        # A cycle ends after L_c compressed steps, or early on a majority vote.
        ended = compressing & (pos == cycle - 1)
        if idx and stop_loss is not None:
            ended = ended | (compressing & finite & (2 * votes > n))
        cycle_start = jnp.where(ended, count + 1, state.cycle_start)
        if idx:
            slot = jnp.clip(pos, 0, sample_steps - 1)
            write = sampling & finite
            for j, i in enumerate(idx):
                if error_feedback:
                    new["residual"][i] = as_block(keep_if_finite(
                        finite, xs[j] - contributed[j], flat["residual"][i]), stored[i])
                rows = _sample_rows(sums[j].reshape(-1), cplans[j])
                written = lax.dynamic_update_index_in_dim(flat["samples"][i], rows, slot, 0)
                new["samples"][i] = jnp.where(write, written, flat["samples"][i])
            valid = jnp.where(sampling, valid.at[slot].set(finite), valid)
            do_fit = sampling & (pos == sample_steps - 1) & jnp.any(valid)
            old = ([flat["basis"][i] for i in idx], [flat["mean"][i] for i in idx],
                   [flat["rank"][i] for i in idx])
            fitted = lax.cond(do_fit, lambda: fit([new["samples"][i] for i in idx], valid,
                                                  cplans), lambda: old)
            for name, vals in zip(("basis", "mean", "rank"), fitted, strict=True):
                for j, i in enumerate(idx):
                    new[name][i] = vals[j]
        new_state = GradiVeQState(
            residual=treedef.unflatten(new["residual"]),
            samples=treedef.unflatten(new["samples"]),
            valid=valid,
            basis=treedef.unflatten(new["basis"]),
            mean=treedef.unflatten(new["mean"]),
            rank=treedef.unflatten(new["rank"]),
            key=state.key,
            count=count + 1,
            cycle_start=cycle_start,
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init, update)
