"""`powersgd`: an optax transformation with the semantics of PyTorch's
``powerSGD_hook`` (Vogels et al., PowerSGD, Algorithm 1).

For ``compress_after`` steps every leaf is averaged uncompressed
(``qc.fused_psum``), as the hook's ``start_powerSGD_iter``. After that, every leaf
that is a matrix (two or more dimensions) and where a rank-``r`` factorization
pays (`qcollect.powersgd_should_compress`) is compressed by one power
iteration with warm start; vectors, scalars and small matrices stay
uncompressed. The phase switch is a ``lax.cond`` on the step count, which is
the same on every device, with the collectives inside its branches, marked
``"exact"`` and ``"compressed"`` (`qcollect.phase`):
`qcollect.wire_bytes_by_phase` of a step measures each, and the schedule
(``transforms.CompressAfter(K).spans(steps)``) says which steps of a run
fall in which.

``compress_after`` defaults to 10 (``start_iter`` is its deprecated name).
Vogels et al.'s Algorithm 1 compresses from the first step. PyTorch's hook
runs 1000 uncompressed steps by default (``start_powerSGD_iter``; its
docstring: the start of training is the most sensitive to inexact
gradients) and the authors' ``powersgd`` package 100
(``start_compressing_after_num_steps``), counts meant for runs of tens of
thousands of steps. A fixed count cannot know the run's length: 1000 leaves
a run of a few hundred steps uncompressed from start to end, and its wire
bytes those of a plain all-reduce. 10 keeps the first, largest updates
exact and nearly every step of a short run compressed; pass
``compress_after=1000`` for the hook's schedule. (The exact steps leave the ``Q``
memory and the error feedback as ``init`` made them.)

Matrix views: a leaf becomes an ``(n, m)`` matrix
(`qcollect.powersgd_matrix_shape`). ``matrix_view="last"`` (default) suits
JAX/Flax channels-last kernels: ``prod(shape[:-1]) x shape[-1]``, so a dense
kernel ``(in, out)`` is itself and a conv kernel ``(kh, kw, in, out)`` is
``(kh kw in, out)``. ``"first"`` is PyTorch's ``view(shape[0], -1)``,
``shape[0] x prod(shape[1:])``, and matches ``powerSGD_hook`` on
channels-first layouts (a conv weight ``(out, in, kh, kw)`` is ``(out, in kh
kw)``). For the same layer the two views are transposes of each other (same
compression decision and bytes); the view that does not match the layout can
leave kernels uncompressed (a Flax ``(3, 3, 32, 64)`` kernel under
``"first"`` is ``(3, 6144)``, left uncompressed at every rank >= 2 with the
default ``min_compression_rate``). A leaf is compressed when ``(n + m) r
min_compression_rate < n m`` with ``r = min(n, m, rank)``.

One compressed step, per leaf: ``M_i = g_i + e_i`` (error feedback),
``P = sum_i M_i Q`` (round one, `qcollect.powersgd` ``side="right"``
payloads summed by a compressed-domain ring), ``P = orthogonalize(P)``,
``Q = sum_i M_i^T P / N`` (round two, ``side="left"``), update ``M^ = P
Q^T`` (the mean; ``N M^`` with ``mean=False``) and the local error ``e_i =
M_i - M^``. With warm start ``Q`` is kept for the next step; without it every
step draws a fresh orthogonalized Gaussian ``Q`` from ``fold_in(key,
step)``, the same on all devices. Each round sends ``4 r (n + m)`` bytes per
compressed leaf instead of ``4 n m``, in fused ring all-reduces (one per
4 MiB bucket). Since the local errors of the devices average to ``mean_i M_i
- M^``, error feedback telescopes: the sum of the updates plus the mean of
the residuals equals the sum of the mean gradients. Uncompressed leaves keep
no residual (PyTorch's bucket-wide error is ``g_i - mean g`` there, which
averages to zero and so never changes an update).

Non-finite gradients: NaN or Inf in any device's gradient makes the reduced
update non-finite on every device (``P``, then ``Q``, then ``M^`` inherit
it), so that flag agrees across devices without another collective. Such a
step passes the non-finite update on and leaves the residuals and the ``Q``
memory unchanged (never poisoned); chain ``optax.apply_if_finite(inner,
...)`` *after* this transformation to skip the step.

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

import dataclasses
import functools
import warnings
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax import lax

import qcollect as qc
from qcollect.checks import check_choice, check_float, check_int, check_key
from transforms._axes import AxisName, check_local_gradients
from transforms._blocks import leaves_like
from transforms._feedback import ResidualFeedback, keeps_residual, residual_feedback
from transforms._finite import all_finite, keep_if_finite
from transforms._phases import (
    COMPRESSED,
    EXACT,
    POWERSGD_COMPRESS_AFTER,
    CompressAfter,
    as_schedule,
)
from transforms._placement import per_device
from transforms._policy import LeafPredicate, group_indices, leaf_choices, sum_uncompressed
from transforms._residual import add_residual, residual_of
from transforms._state import (
    check_entries,
    kept_per_device,
    leaf_paths,
    read_per_device,
    zeros_or_masked,
)


@per_device("residuals")
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
      count: int32 step count; steps ``count < compress_after`` are uncompressed.
      key: PRNG key. It draws the first ``Q`` of every leaf in ``init`` and,
        without warm start, a fresh ``Q`` at step ``t`` from
        ``fold_in(key, t)``. It is never folded with the device index: ``Q``
        must be shared by all devices.
    """

    residuals: Any
    q: Any
    count: jax.Array
    key: jax.Array


#: How a leaf becomes a matrix (`qcollect.powersgd_matrix_shape`).
MatrixView = Literal["last", "first"]

#: ``(updates, local errors, Q memory)`` of one step, leaf by leaf.
_Step = tuple[list[jax.Array], list[Any], list[Any]]

#: The matrix view shape of a class of compressed leaves.
_Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The validated static settings of one `powersgd` transformation."""

    axis_name: AxisName
    rank: int
    compress_after: CompressAfter
    warm_start: bool
    error_feedback: bool
    min_compression_rate: float
    mean: bool
    matrix_view: MatrixView
    compress_if: LeafPredicate | None = None

    def compresses(self, leaf: Any) -> bool:
        """Whether a rank-``rank`` factorization of the leaf's matrix view pays."""
        return qc.powersgd_should_compress(jnp.shape(leaf), self.rank,
                                           min_compression_rate=self.min_compression_rate,
                                           view=self.matrix_view)

    def compressed(self, tree: Any) -> list[bool]:
        """Which leaves of ``tree`` (flatten order) are compressed: those
        ``compress_if`` admits whose factorization pays (`compresses`)."""
        return [c is not None for c in leaf_choices(
            tree, lambda path, leaf: True if self.compresses(leaf) else None,
            compress_if=self.compress_if)]

    def first_q(self, key: jax.Array, leaf: Any) -> jax.Array:
        """A fresh orthogonalized Gaussian ``Q`` for the leaf."""
        return qc.powersgd_init(key, jnp.shape(leaf), self.rank, view=self.matrix_view)


def powersgd(axis_name: AxisName, *, rank: int, key: jax.Array,
             compress_after: int | CompressAfter | None = None, warm_start: bool = True,
             error_feedback: ResidualFeedback | None = residual_feedback(),
             min_compression_rate: float = 2.0, mean: bool = True,
             matrix_view: MatrixView = "last", compress_if: LeafPredicate | None = None,
             start_iter: int | None = None) -> optax.GradientTransformation:
    """PowerSGD all-reduce of the gradients, as PyTorch's ``powerSGD_hook``.

    Steps ``0 .. compress_after - 1``: every leaf is averaged (or summed)
    uncompressed (``qc.fused_psum``). From step ``compress_after`` on, each leaf
    whose matrix view a rank-``r`` factorization shrinks is sent as the two
    factors of one power iteration with warm start and error feedback
    (Algorithms 1 and 2); the others go uncompressed. The two phases are
    marked ``"exact"`` and ``"compressed"`` (`qcollect.wire_bytes_by_phase`,
    ``CompressAfter(K).spans(steps)``). docs/transforms.md ("GradiVeQ and
    PowerSGD") has the details.

    Args:
      axis_name: the data-parallel axis (``shard_map`` or ``pmap``).
      rank: approximation rank ``r >= 1`` (PyTorch's
        ``matrix_approximation_rank``); a leaf uses ``min(n, m, rank)``.
      key: PRNG key for the random ``Q`` (the same on every device).
      compress_after: exact steps first, >= 0 or a `transforms.CompressAfter`
        (PyTorch's ``start_powerSGD_iter``, default 1000; here None: 10, for
        runs of a few hundred steps: docs/transforms.md, "What each phase sends").
      warm_start: reuse ``Q`` from the previous step (default True).
      error_feedback: `transforms.residual_feedback()` (default: the local
        errors, Algorithm 2) or None (True, False: deprecated).
      min_compression_rate: > 0; a leaf is compressed only when it shrinks
        at least this much (PyTorch's default 2).
      mean: average over devices (default) rather than sum.
      matrix_view: how a leaf becomes an ``(n, m)`` matrix: ``"last"``
        (default, channels-last: ``prod(shape[:-1]) x shape[-1]``) or
        ``"first"`` (PyTorch's ``view(shape[0], -1)``).
      compress_if: optional predicate ``(path, leaf) -> bool``: the leaves
        it rejects go uncompressed, as those the rank does not shrink
        (`transforms.matrices` keeps embeddings exact, say).
      start_iter: deprecated name of ``compress_after`` (DeprecationWarning).

    Returns:
      An ``optax.GradientTransformation``; ``update(grads, state, params=None)``
      returns updates in the gradients' dtypes and a `PowerSGDState`.

    Raises:
      ValueError: ``rank < 1``, ``compress_after < 0``, both it and ``start_iter``,
        ``min_compression_rate <= 0`` or ``matrix_view`` not ``"last"`` or
        ``"first"``. ``update`` raises ValueError (at trace time) on gradients
        that are not the tree ``init`` saw, naming the first differing leaf
        path, or whose leaf has another shape, naming it and both shapes.

    References:
      Vogels, Karimireddy, Jaggi, `PowerSGD: Practical Low-Rank Gradient
      Compression for Distributed Optimization
      <https://arxiv.org/abs/1905.13727>`_, NeurIPS 2019,
      Algorithm 1 (one power iteration, warm start) and Algorithm 2 (error
      feedback); PyTorch ``torch.distributed.algorithms.ddp_comm_hooks.
      powerSGD_hook``; `the authors' package
      <https://github.com/epfml/powersgd>`_ (``Config``); the ring sum of
      linear payloads follows
      Yu et al., `GradiVeQ: Vector Quantization for Bandwidth-Efficient
      Gradient Aggregation in Distributed CNN Training
      <https://arxiv.org/abs/1811.03617>`_, NeurIPS 2018,
      Algorithm 1.

    Example:
      >>> import jax, optax, transforms
      >>> tx = optax.chain(
      ...     transforms.powersgd("data", rank=4, key=jax.random.key(0), compress_after=10),
      ...     optax.sgd(0.1, momentum=0.9))
    """
    settings = _Settings(
        axis_name=axis_name, rank=check_int("rank", rank),
        compress_after=_compress_after(compress_after, start_iter), warm_start=warm_start,
        error_feedback=keeps_residual(error_feedback, "powersgd"),
        min_compression_rate=check_float("min_compression_rate", min_compression_rate),
        mean=mean, matrix_view=check_choice("matrix_view", matrix_view, get_args(MatrixView)),
        compress_if=compress_if)
    key = check_key("key", key)
    return optax.GradientTransformation(functools.partial(_init, key=key, settings=settings),
                                        functools.partial(_update, settings=settings))


def _compress_after(compress_after: int | CompressAfter | None,
                    start_iter: int | None) -> CompressAfter:
    """``compress_after`` as a schedule (None: the default, 10), or the
    deprecated ``start_iter`` (warning); ValueError when both are given."""
    if start_iter is None:
        schedule = as_schedule(POWERSGD_COMPRESS_AFTER if compress_after is None
                               else compress_after)
        if schedule.warm_up is not None:
            raise ValueError("powersgd's compress_after takes no warm_up compressor: its first "
                             "steps are exact (a CompressAfter without warm_up)")
        return schedule
    warnings.warn("powersgd(start_iter=...) is deprecated: pass compress_after=...",
                  DeprecationWarning, stacklevel=3)
    if compress_after is not None:
        raise ValueError(f"start_iter={start_iter} and compress_after={compress_after!r}: "
                         "start_iter is compress_after's older name; pass one")
    return as_schedule(start_iter, "start_iter")


def _init(params: optax.Params, *, key: jax.Array, settings: _Settings) -> PowerSGDState:
    leaves, treedef = jax.tree.flatten(params)
    residuals: list[Any] = []
    qs: list[Any] = []
    for i, (leaf, compressed) in enumerate(zip(leaves, settings.compressed(params),
                                               strict=True)):
        residuals.append(zeros_or_masked(leaf, compressed and settings.error_feedback))
        qs.append(settings.first_q(jax.random.fold_in(key, i), leaf)
                  if compressed and settings.warm_start else optax.MaskedNode())
    return PowerSGDState(treedef.unflatten(residuals), treedef.unflatten(qs),
                         jnp.zeros([], jnp.int32), key)


def _expected_shapes(leaf: Any, compressed: bool,
                     settings: _Settings) -> dict[str, tuple[int, ...] | None]:
    """The entries `_init` keeps for a leaf of this shape, and their shapes."""
    if not compressed:
        return {}
    shape = tuple(jnp.shape(leaf))
    _, m = qc.powersgd_matrix_shape(shape, view=settings.matrix_view)
    want: dict[str, tuple[int, ...] | None] = {
        "local error": None,  # checked by read_per_device
        "Q memory": (m, qc.powersgd_rank(shape, settings.rank, view=settings.matrix_view))}
    if not settings.error_feedback:
        del want["local error"]
    if not settings.warm_start:
        del want["Q memory"]
    return want


def _update(grads: optax.Updates, state: PowerSGDState, params: optax.Params | None = None,
            *, settings: _Settings) -> tuple[optax.Updates, PowerSGDState]:
    """One step: the reduced update (mean or sum over devices) and the next state."""
    del params
    check_local_gradients(grads, settings.axis_name)
    leaves, treedef = jax.tree.flatten(grads)
    stored, residuals = read_per_device(grads, state.residuals, settings.axis_name,
                                        "the PowerSGD local error",
                                        field_name="PowerSGD local errors")
    stored_q = leaves_like(grads, state.q, "PowerSGD Q memory")
    which = settings.compressed(grads)
    for leaf, residual, q, path, compressed in zip(leaves, residuals, stored_q, leaf_paths(grads),
                                                   which, strict=True):
        check_entries(path, leaf, compressed,
                      {"local error": residual, "Q memory": q},
                      _expected_shapes(leaf, compressed, settings), owner="PowerSGD")
    qs = [None if isinstance(q, optax.MaskedNode) else q for q in stored_q]

    def plain(leaves: list[jax.Array], residuals: list[Any], qs: list[Any], count: jax.Array,
              key: jax.Array) -> _Step:
        del count, key
        with qc.phase(EXACT):
            summed = qc.fused_psum(list(leaves), settings.axis_name, mean=settings.mean)
        # In the gradients' dtypes, as the compressed branch returns them (the
        # mean of integer gradients is a float).
        return [s.astype(g.dtype) for s, g in zip(summed, leaves, strict=True)], residuals, qs

    def power(leaves: list[jax.Array], residuals: list[Any], qs: list[Any], count: jax.Array,
              key: jax.Array) -> _Step:
        with qc.phase(COMPRESSED):
            return _power_step(leaves, residuals, qs, jax.random.fold_in(key, count), which,
                               settings)

    args = (leaves, residuals, qs, state.count, state.key)
    if settings.compress_after.steps == 0:
        out, new_residuals, new_qs = power(*args)
    else:
        # The count is the same on every device, so every device takes
        # the same branch and runs the same collectives.
        out, new_residuals, new_qs = lax.cond(settings.compress_after.at(state.count), plain, power,
                                              *args)
    finite = all_finite(out)
    return treedef.unflatten(out), PowerSGDState(
        residuals=treedef.unflatten(kept_per_device(new_residuals, residuals, stored, finite)),
        q=treedef.unflatten([optax.MaskedNode() if old is None else keep_if_finite(finite, new, old)
                             for new, old in zip(new_qs, qs, strict=True)]),
        count=optax.safe_int32_increment(state.count),
        key=state.key,
    )


def _power_step(leaves: list[jax.Array], residuals: list[Any], qs: list[Any],
                step_key: jax.Array, which: list[bool], settings: _Settings) -> _Step:
    """One compressed step: ``(updates, local errors, Q memory)``, leaf by leaf.

    Compressed leaves of one matrix view shape form a class. The large
    per-leaf work (``M_i = g_i + e_i``, the products with ``M_i``, the decode,
    the local error) runs on each leaf's own matrix; the small factors of the
    class (``Q``, ``P``, their Gram-Schmidt, the overflow checks) are stacked,
    so the program holds one copy of that work per shape, and no leaf is
    copied into a stack.
    """
    axis_name = settings.axis_name
    n_dev = lax.axis_size(axis_name)
    out = sum_uncompressed(leaves, which, axis_name, mean=settings.mean)
    new_residuals, new_qs = list(residuals), list(qs)
    mats = _matrices(leaves, residuals, which, settings)
    classes = group_indices([mats[i].shape if i in mats else None for i in range(len(leaves))])
    factors = _start_factors(classes, leaves, qs, step_key, settings)
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
            mine = approx[j] if settings.mean else approx[j] * n_dev
            out[i] = mine.reshape(jnp.shape(leaves[i])).astype(leaves[i].dtype)
            if settings.error_feedback:
                new_residuals[i] = residual_of(mats[i], approx[j]).reshape(jnp.shape(leaves[i]))
            if settings.warm_start:
                new_qs[i] = q_mean[j]
    return out, new_residuals, new_qs


def _matrices(leaves: list[jax.Array], residuals: list[Any], which: list[bool],
              settings: _Settings) -> dict[int, jax.Array]:
    """``M_i = g_i + e_i`` (float32) of each compressed leaf ``i``, as its matrix view."""
    mats = {}
    for i, (g, residual, compressed) in enumerate(zip(leaves, residuals, which, strict=True)):
        if compressed:
            mat = add_residual(jnp.asarray(g, jnp.float32),
                               residual if settings.error_feedback else None)
            mats[i] = qc.powersgd_matrix(mat, view=settings.matrix_view)
    return mats


def _start_factors(classes: dict[_Shape, list[int]], leaves: list[jax.Array], qs: list[Any],
                   step_key: jax.Array, settings: _Settings) -> dict[_Shape, jax.Array]:
    """Each class's stacked ``Q`` to start the power iteration from: the
    normalized memory with warm start, else fresh from ``step_key``."""
    factors = {}
    for shape, members in classes.items():
        if settings.warm_start:
            factors[shape] = qc.powersgd_normalize(jnp.stack([qs[i] for i in members]))
        else:
            keys = jnp.stack([jax.random.fold_in(step_key, i) for i in members])
            leaf = leaves[members[0]]
            factors[shape] = jax.vmap(lambda k, leaf=leaf: settings.first_q(k, leaf))(keys)
    return factors


def _ring_sum(payloads: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
    """Sums payloads in the compressed domain: a ring all-reduce of their words.

    The leaves' payloads are fused into float32 buffers of up to 4 MiB
    (`qcollect.BUCKET_BYTES`), so one ring runs per bucket and round, as
    PyTorch all-reduces all ``P`` (or ``Q``) of a bucket at once.
    """
    if not payloads:
        return []
    return qc.compressed_all_reduce(payloads, axis_name, qc.identity(),
                                    algorithm="ring").value


def _ring_sum_classes(stacked: dict[_Shape, jax.Array], classes: dict[_Shape, list[int]],
                      axis_name: AxisName) -> dict[_Shape, jax.Array]:
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
