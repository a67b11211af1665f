"""`powersgd`: an optax transformation with the semantics of PyTorch's
``powerSGD_hook`` (Vogels et al., PowerSGD, Algorithm 1).

For ``start_iter`` steps every leaf is averaged uncompressed (``qc.fused_psum``),
as the hook's warm-up with ``start_powerSGD_iter``. After that, every leaf
that is a matrix (two or more dimensions) and where a rank-``r`` factorization
pays (`qcollect.powersgd_should_compress`) is compressed by one power
iteration with warm start; vectors, scalars and small matrices stay
uncompressed. Leaves are viewed as matrices channels-last by default
(``matrix_view="last"``: a Flax conv kernel ``(kh, kw, in, out)`` is
``(kh kw in, out)``); ``matrix_view="first"`` is the hook's
``view(shape[0], -1)`` for PyTorch's channels-first layouts. The phase
switch is a ``lax.cond`` on the step count, which is the same on every
device, with the collectives inside its branches.

Compressed leaves of one matrix view shape form a class. Each leaf's
large work (its matrix ``M_i = g_i + e_i``, the products ``M_i Q`` and
``M_i^T P``, the decode ``P Q^T`` and its local error) runs on the leaf's
own arrays; the class's small factors (``Q``, ``P``, their Gram-Schmidt and
the overflow checks of the products) are stacked, so that work is traced
once per shape, not per leaf, and no leaf is copied into a stack. The
payloads are sent as the leaves' own (the same buckets and sums), so the
results are those of a leaf-by-leaf step up to float32 rounding
(`tests/test_tx_powersgd.py` checks it against a leaf-by-leaf float64
reference on MLP-sized leaves over several steps).
One difference: the overflow-safe paths (`qcollect.orthogonalize`, the
products) decide per class, so where one leaf's product overflows (or a
gradient is non-finite, a step whose state is kept anyway) its class-mates
take the power-of-two rescaled path too, which gives the same values
unless they hold subnormal-range entries.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
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
)


class PowerSGDState(NamedTuple):
    """State of `powersgd`.

    Attributes:
      residuals: per device (``P(axis_name)``, see `transforms.state_specs`):
        float32 tree like the gradients, each compressed leaf's local error
        ``M_i - M^`` (PyTorch's ``error_dict``). Leaves that are not
        compressed, or all of them without error feedback, are
        ``optax.MaskedNode()``.
      q: replicated: each compressed leaf's ``Q`` memory, float32 ``(m, r)``
        for its ``(n, m)`` matrix view (``matrix_view``; PyTorch's
        ``q_memory_dict``); the same on every device. ``optax.MaskedNode()``
        for leaves that are not compressed, or for all leaves without warm
        start.
      count: int32 step count; steps ``count < start_iter`` are uncompressed.
      key: PRNG key. It draws the first ``Q`` of every leaf in ``init`` and,
        without warm start, a fresh ``Q`` at step ``t`` from
        ``fold_in(key, t)``. It is never folded with the device index: ``Q``
        must be shared by all devices.
    """

    residuals: Any
    q: Any
    count: jax.Array
    key: jax.Array

    per_device_fields = ("residuals",)


def _ring_sum(payloads, axis_name):
    """Sums payloads in the compressed domain: a ring all-reduce of their words.

    The leaves' payloads are fused into float32 buffers of up to 4 MiB
    (`qcollect.BUCKET_BYTES`), so one ring runs per bucket and round, as
    PyTorch all-reduces all ``P`` (or ``Q``) of a bucket at once.
    """
    if not payloads:
        return []
    return qc.compressed_all_reduce(payloads, axis_name, qc.identity(),
                                    algorithm="ring").value


def _ring_sum_classes(stacked, classes, axis_name):
    """`_ring_sum` of each class's stacked ``(k, ...)`` payloads, sent as
    the leaves' own payloads in leaf order (so the buckets and the sums are
    those of a leaf-by-leaf step); returns the sums stacked per class."""
    order = sorted((i, shape, j) for shape, members in classes.items()
                   for j, i in enumerate(members))
    sums = _ring_sum([stacked[shape][j] for _, shape, j in order], axis_name)
    by_class = {shape: [None] * len(members) for shape, members in classes.items()}
    for (_, shape, j), total in zip(order, sums, strict=True):
        by_class[shape][j] = total
    return {shape: jnp.stack(parts) for shape, parts in by_class.items()}


def powersgd(axis_name, *, rank: int, key: jax.Array, start_iter: int = 1_000,
             warm_start: bool = True, error_feedback: bool = True,
             min_compression_rate: float = 2.0, mean: bool = True,
             matrix_view: str = "last") -> optax.GradientTransformation:
    """PowerSGD all-reduce of the gradients, as PyTorch's ``powerSGD_hook``.

    Steps ``0 .. start_iter - 1``: every leaf is averaged (or summed)
    uncompressed (``qc.fused_psum``), nothing else happens. From step ``start_iter`` on, per
    leaf:

    * leaves with ``ndim <= 1``, or whose ``(n, m)`` matrix view
      (`qcollect.powersgd_matrix_shape`: ``prod(shape[:-1]) x shape[-1]``
      with ``matrix_view="last"``, ``shape[0] x prod(shape[1:])`` with
      ``"first"``) fails ``(n + m) r min_compression_rate < n m`` with
      ``r = min(n, m, rank)``, are averaged uncompressed;
    * the others: ``M_i = g_i + e_i`` (error feedback), ``P = sum_i M_i Q``
      (round one, `qcollect.powersgd` ``side="right"`` payloads summed by a
      compressed-domain ring), ``P = orthogonalize(P)``,
      ``Q = sum_i M_i^T P / N`` (round two, ``side="left"``), update
      ``M^ = P Q^T`` (the mean; ``N M^`` with ``mean=False``) and the local
      error ``e_i = M_i - M^``. With warm start ``Q`` is kept for the next
      step; without it every step draws a fresh orthogonalized Gaussian
      ``Q`` from ``fold_in(key, step)``, the same on all devices.

    Each round sends ``4 r (n + m)`` bytes per compressed leaf instead of
    ``4 n m``, in fused ring all-reduces (one per 4 MiB bucket). Since the local
    errors of the devices average to ``mean_i M_i - M^``, error feedback
    telescopes: the sum of the updates plus the mean of the residuals equals
    the sum of the mean gradients. Uncompressed leaves keep no residual
    (PyTorch's bucket-wide error is ``g_i - mean g`` there, which averages to
    zero and so never changes an update).

    Non-finite gradients: NaN or Inf in any device's gradient makes the
    reduced update non-finite on every device (``P``, then ``Q``, then
    ``M^`` inherit it), so that flag agrees across devices without another
    collective. Such a step passes the non-finite update on and leaves the
    residuals and the ``Q`` memory unchanged (never poisoned); chain
    ``optax.apply_if_finite(inner, ...)`` *after* this transformation to
    skip the step.

    Args:
      axis_name: the data-parallel axis (``shard_map`` or ``pmap``).
      rank: approximation rank ``r >= 1`` (PyTorch's
        ``matrix_approximation_rank``); a leaf uses ``min(n, m, rank)``.
      key: PRNG key for the random ``Q`` (the same on every device).
      start_iter: uncompressed steps before PowerSGD starts, >= 0
        (PyTorch's ``start_powerSGD_iter``, default 1000).
      warm_start: reuse ``Q`` from the previous step (default True).
      error_feedback: keep the local errors (default True).
      min_compression_rate: > 0; a leaf is compressed only when it shrinks
        at least this much (PyTorch's default 2).
      mean: average over devices (default) rather than sum.
      matrix_view: how a leaf becomes an ``(n, m)`` matrix. ``"last"``
        (default) suits JAX/Flax channels-last kernels: a dense kernel
        ``(in, out)`` is itself, a conv kernel ``(kh, kw, in, out)`` is
        ``(kh kw in, out)``. ``"first"`` is PyTorch's ``view(shape[0], -1)``
        and matches ``powerSGD_hook`` on channels-first layouts (a conv
        weight ``(out, in, kh, kw)`` is ``(out, in kh kw)``). For the same
        layer the two views are transposes of each other (same compression
        decision and bytes); the view that does not match the layout can
        leave kernels uncompressed (a Flax ``(3, 3, 32, 64)`` kernel under
        ``"first"`` is ``(3, 6144)``, left uncompressed at every rank >= 2
        with the default ``min_compression_rate``).

    Returns:
      An ``optax.GradientTransformation``; ``update(grads, state, params=None)``
      returns updates in the gradients' dtypes and a `PowerSGDState`.

    Raises:
      ValueError: ``rank < 1``, ``start_iter < 0``,
        ``min_compression_rate <= 0`` or ``matrix_view`` not ``"last"`` or
        ``"first"``. ``update`` raises ValueError (at trace time) on gradients
        that are not the tree ``init`` saw, naming the first differing leaf
        path, or whose leaf has another shape, naming it and both shapes.

    References:
      T. Vogels, S. P. Karimireddy, M. Jaggi. PowerSGD: Practical Low-Rank
      Gradient Compression for Distributed Optimization (NeurIPS 2019),
      Algorithm 1 (one power iteration, warm start) and Algorithm 2 (error
      feedback); PyTorch ``torch.distributed.algorithms.ddp_comm_hooks.
      powerSGD_hook``. The ring sum of linear payloads follows Yu et al.,
      GradiVeQ, Algorithm 1.

    Example:
      >>> import jax, optax, transforms
      >>> tx = optax.chain(
      ...     transforms.powersgd("data", rank=4, key=jax.random.key(0), start_iter=10),
      ...     optax.sgd(0.1, momentum=0.9))
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
    if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
        raise ValueError(f"start_iter must be an integer >= 0, got {start_iter!r}")
    if (isinstance(min_compression_rate, bool)
            or not isinstance(min_compression_rate, int | float)
            or not min_compression_rate > 0):
        raise ValueError(f"min_compression_rate must be a number > 0, got "
                         f"{min_compression_rate!r}")
    if matrix_view not in ("last", "first"):
        raise ValueError(f"matrix_view must be one of ('last', 'first'), got {matrix_view!r}")

    def compressed(leaf) -> bool:
        return qc.powersgd_should_compress(jnp.shape(leaf), rank,
                                           min_compression_rate=min_compression_rate,
                                           view=matrix_view)

    def first_q(k, leaf):
        return qc.powersgd_init(k, jnp.shape(leaf), rank, view=matrix_view)

    def init(params):
        leaves, treedef = jax.tree.flatten(params)
        res, qs = [], []
        for i, leaf in enumerate(leaves):
            c = compressed(leaf)
            res.append(jnp.zeros(jnp.shape(leaf), jnp.float32) if c and error_feedback
                       else optax.MaskedNode())
            qs.append(first_q(jax.random.fold_in(key, i), leaf) if c and warm_start
                      else optax.MaskedNode())
        return PowerSGDState(treedef.unflatten(res), treedef.unflatten(qs),
                             jnp.zeros([], jnp.int32), key)

    def check_entries(leaf, residual, q, path):
        """Raises unless ``init`` of a leaf of this shape made these (stored) entries."""
        shape = tuple(jnp.shape(leaf))
        c = compressed(leaf)
        kept = [not isinstance(e, optax.MaskedNode) for e in (residual, q)]
        if kept != [c and error_feedback, c and warm_start]:
            was = (f" (its local error has shape {tuple(jnp.shape(residual))})"
                   if kept[0] else "")
            raise ValueError(f"the leaf {path} of shape {shape} is {'' if c else 'not '}"
                             f"compressed, but init saw it {'un' if c else ''}compressed{was}: "
                             f"the update's leaf has another shape than the one init saw")
        if kept[1]:
            _, m = qc.powersgd_matrix_shape(shape, view=matrix_view)
            expected = (m, qc.powersgd_rank(shape, rank, view=matrix_view))
            if tuple(jnp.shape(q)) != expected:
                raise ValueError(f"the PowerSGD Q memory of {path} has shape "
                                 f"{tuple(jnp.shape(q))}, expected {expected} for the leaf of "
                                 f"shape {shape}: the update's leaf has another shape than the "
                                 f"one init saw")

    def reduce(xs):
        return qc.fused_psum(list(xs), axis_name, mean=mean)

    def plain(leaves, residuals, qs, count, state_key):
        del count, state_key
        return reduce(leaves), residuals, qs

    def power(leaves, residuals, qs, count, state_key):
        n_dev = lax.axis_size(axis_name)
        step_key = jax.random.fold_in(state_key, count)
        out = sum_uncompressed(leaves, [compressed(g) for g in leaves], axis_name, mean=mean)
        new_res, new_q = list(residuals), list(qs)
        # Compressed leaves of one matrix view shape form a class. The large
        # per-leaf work (M_i = g_i + e_i, the products with M_i, the decode,
        # the local error) runs on each leaf's own matrix; the small factors
        # of the class (Q, P, their Gram-Schmidt, the overflow checks) are
        # stacked, so the program holds one copy of that work per shape, and
        # no leaf is copied into a stack.
        classes: dict[tuple[int, int], list[int]] = {}
        mats = {}
        for i, g in enumerate(leaves):
            if not compressed(g):
                continue
            mat = jnp.asarray(g, jnp.float32)
            if error_feedback:
                mat = mat + residuals[i]
            mats[i] = qc.powersgd_matrix(mat, view=matrix_view)
            classes.setdefault(mats[i].shape, []).append(i)
        factors = {}
        for shape, members in classes.items():
            if warm_start:
                factors[shape] = qc.powersgd_normalize(jnp.stack([qs[i] for i in members]))
            else:
                keys = jnp.stack([jax.random.fold_in(step_key, i) for i in members])
                leaf = leaves[members[0]]
                factors[shape] = jax.vmap(lambda k, leaf=leaf: first_q(k, leaf))(keys)
        # Round one: P = sum_i M_i Q, summed per leaf (the buckets and sums
        # of the leaves' own payloads), then orthogonalized.
        p_sum = _ring_sum_classes(
            {s: qc.powersgd_p([mats[i] for i in classes[s]], factors[s]) for s in classes},
            classes, axis_name)
        ps = {s: qc.orthogonalize(p) for s, p in p_sum.items()}
        # Round two: Q = sum_i M_i^T P / N; M^ = P Q^T, the mean's approximation.
        q_sum = _ring_sum_classes(
            {s: qc.powersgd_q([mats[i] for i in classes[s]], ps[s]) for s in classes},
            classes, axis_name)
        for shape, members in classes.items():
            q_mean = q_sum[shape] / n_dev
            approx = qc.powersgd_reconstruct(ps[shape], q_mean, stacked=False)
            for j, i in enumerate(members):
                mine = approx[j] if mean else approx[j] * n_dev
                out[i] = mine.reshape(jnp.shape(leaves[i])).astype(leaves[i].dtype)
                if error_feedback:
                    new_res[i] = (mats[i] - approx[j]).reshape(jnp.shape(leaves[i]))
                if warm_start:
                    new_q[i] = q_mean[j]
        return out, new_res, new_q

    def update(grads, state, params=None):
        del params
        check_local_gradients(grads, axis_name)
        leaves, treedef = jax.tree.flatten(grads)
        stored = leaves_like(grads, state.residuals, "PowerSGD local errors")
        stored_q = leaves_like(grads, state.q, "PowerSGD Q memory")
        paths = [jax.tree_util.keystr(p) or "the root"
                 for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
        residuals, qs = [], []
        for g, r, q, path in zip(leaves, stored, stored_q, paths, strict=True):
            residuals.append(None if isinstance(r, optax.MaskedNode) else device_block(
                r, g, axis_name, f"the PowerSGD local error of {path}"))
            check_entries(g, r, q, path)
            qs.append(None if isinstance(q, optax.MaskedNode) else q)
        args = (leaves, residuals, qs, state.count, state.key)
        if start_iter == 0:
            out, new_res, new_q = power(*args)
        else:
            # The count is the same on every device, so every device takes
            # the same branch and runs the same collectives.
            out, new_res, new_q = lax.cond(state.count < start_iter, plain, power, *args)
        finite = all_finite(out)
        new_res = [b if o is None else as_block(keep_if_finite(finite, n, o), b)
                   for n, o, b in zip(new_res, residuals, stored, strict=True)]
        new_q = [optax.MaskedNode() if o is None else keep_if_finite(finite, n, o)
                 for n, o in zip(new_q, qs, strict=True)]
        new_state = PowerSGDState(
            residuals=treedef.unflatten(new_res),
            q=treedef.unflatten(new_q),
            count=state.count + 1,
            key=state.key,
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init, update)
