"""0/1 Adam: Adam whose variance is refreshed on a doubling schedule and whose
workers take local steps between 1-bit synchronisations of their momenta.

Lu et al., "Maximizing Communication Efficiency for Large-scale Training via
0/1 Adam" (ICLR 2023, arXiv:2202.06009), Algorithm 1, on worker ``i`` at
step ``t`` with the schedule's sets ``T_v`` and ``T_u``
(`transforms.ZeroOneSchedule`):

* ``t`` in ``T_v`` (a refresh, phase ``"exact"``): the gradients' exact mean
  (or through the schedule's ``refresh_compressor``, phase ``"lead-in"``)
  ``g``; ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``; every worker
  steps ``x = x - lr m / sqrt(v)`` and the step is a synchronisation point.
* otherwise the local momentum ``m_i = b1 m_i + (1 - b1) g_i`` and the
  accumulator ``u_i = u_i + lr m_i``; the worker steps ``x_i = x_i - lr m_i /
  sqrt(v)`` with the variance as it stands.
* ``t`` in ``T_u`` (a sync, ``"compressed"``): the accumulators' average
  ``u`` through the compressed all-reduce with worker and server error
  feedback (`transforms.compressed_all_reduce`, ``algorithm="pairwise"``,
  `transforms.residual_feedback`); every worker's momentum becomes
  ``u / sum(lr)`` (the learning rates since the last sync), its parameters
  the last sync point's minus ``u / sqrt(v)``, and ``u_i = 0``.
* other steps (``"inner"``) send nothing.

Before ``freeze_after`` every step synchronises (``T_u`` holds them all),
so the replicas stay one model and the refreshes see it; after it the
variance is frozen and syncs thin out to every ``local_steps`` steps.

Where this deviates from the paper and from DeepSpeed's ``ZeroOneAdam``:

* Bias corrections as ``optax.adamw``'s (the paper and DeepSpeed use none),
  so with a refresh at every step before ``freeze_after`` the run is
  ``optax.adamw`` on the mean gradient up to it; the accumulator sums
  ``lr * m_hat`` and the momentum set at a sync is its weighted mean, bias
  correction undone.
* DeepSpeed compresses the gradient at the steps between refreshes and
  the accumulator after the freeze, and zeroes both error feedbacks at the
  freeze (they held another quantity); here both stages send the
  accumulator (before the freeze ``lr m_hat_i`` of one step), as the
  paper's Algorithm 1 does, so the errors carry over.
* Decoupled weight decay (Loshchilov and Hutter) on the local steps at the
  worker's parameters, and at a sync on the sync point over the summed
  learning rates, so every replica lands on one point without sending it.
* A refresh whose mean is non-finite is skipped by every worker (zero
  update, the state as it was, the count too, so the schedule waits); a
  worker whose own gradient is non-finite at another step leaves its
  momentum, accumulator and parameters as they were and still joins the
  step's sync, so the other workers never see its values.

Parameters are per worker (each device's replica: stacked ``(N, ...)`` on
``P(axis_name)``, `transforms.local_replica` inside the step), as for
`transforms.diloco`; after a sync they agree up to the rounding of
``x + (sync point - x)``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import qcollect as qc
from qcollect.checks import check_floating_leaves
from transforms._adam import AdamSettings
from transforms._all_reduce import CompressedAllReduceState, compressed_all_reduce
from transforms._axes import (
    AxisName,
    ReducingOptimizer,
    check_axis,
    check_local_gradients,
    cond_matching_types,
)
from transforms._blocks import as_block
from transforms._feedback import residual_feedback
from transforms._finite import all_finite
from transforms._phases import COMPRESSED, INNER
from transforms._placement import per_device
from transforms._policy import CompressorSpec, LeafPredicate
from transforms._state import read_per_device
from transforms._zero_one_schedule import ZeroOneSchedule

__all__ = ["ZeroOneAdamState", "zero_one_adam"]


@per_device("momentum", "accumulator")
class ZeroOneAdamState(NamedTuple):
    """State of `zero_one_adam`.

    Attributes:
      momentum: each worker's momentum ``m_i`` (float32), ``P(axis_name)``;
        ``mu`` after a sync.
      accumulator: each worker's ``u_i``, the sum of ``lr * m_hat_i`` since
        the last sync (float32), ``P(axis_name)``.
      mu: the momentum of the last sync (float32, the same on every device):
        what every ``m_i`` was set to, and what a refresh steps from.
      nu: the variance ``v`` (float32, the same on every device).
      anchor: the parameters at the last sync (float32, the same on every device).
      lr_sum: the learning rates summed since the last sync (float32 scalar).
      sync: the accumulators' all-reduce state: worker and server errors per
        device (`transforms.CompressedAllReduceState`).
      count: int32 steps taken; the schedule is ``schedule.at(count)``.
      nu_count: int32 refreshes taken (the variance's bias correction).
    """

    momentum: Any
    accumulator: Any
    mu: Any
    nu: Any
    anchor: Any
    lr_sum: jax.Array
    sync: CompressedAllReduceState
    count: jax.Array
    nu_count: jax.Array


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The validated settings of one `zero_one_adam`."""

    axis_name: AxisName
    learning_rate: optax.ScalarOrSchedule
    schedule: ZeroOneSchedule
    sync: optax.GradientTransformation
    adam: AdamSettings
    key: jax.Array


def zero_one_adam(axis_name: AxisName, *, learning_rate: optax.ScalarOrSchedule,
                  freeze_after: int | ZeroOneSchedule, key: jax.Array,
                  compressor: CompressorSpec = qc.onebit(), b1: float = 0.9, b2: float = 0.999,
                  eps: float = 1e-8, weight_decay: float = 0.0, mask: Any = None,
                  algorithm: qc.Algorithm = "pairwise", min_size: int = 0,
                  compress_if: LeafPredicate | None = None,
                  bucket_bytes: int | None = qc.BUCKET_BYTES) -> optax.GradientTransformation:
    """0/1 Adam (Lu et al. 2023, Algorithm 1): the whole optimizer, its
    all-reduces inside, each worker with its own replica.

    Feed it each device's own gradients at its own replica and pass that
    replica as ``params``; the updates take the replica to its next point
    (a local step, or the new sync point). The module's docstring has the
    algorithm and where it deviates from the paper and DeepSpeed.

    Args:
      axis_name: the data-parallel axis (``shard_map`` or ``pmap``).
      learning_rate: a step size or an optax schedule of the step count.
      freeze_after: F as an int (the other settings of
        `transforms.ZeroOneSchedule` at DeepSpeed's defaults: 16 refreshes
        per spacing, up to 16 local steps, 16 syncs per spacing) or a
        `transforms.ZeroOneSchedule`.
      key: PRNG key for stochastic compressors (the same on every device).
      compressor: what the accumulated momenta go through (default
        `qcollect.onebit`), or ``f(path, leaf)`` per leaf.
      b1, b2, eps: Adam's (``optax.adamw``'s defaults).
      weight_decay: decoupled weight decay, >= 0.
      mask: which leaves decay, as ``optax.adamw``'s (e.g. `transforms.matrices`).
      algorithm, min_size, compress_if, bucket_bytes: the sync's all-reduce,
        as in `transforms.compressed_all_reduce` (``"pairwise"``: the owner
        of each chunk re-encodes its average and keeps the server error).

    Returns:
      An ``optax.GradientTransformation`` whose state is a `ZeroOneAdamState`.

    Raises:
      ValueError: a setting out of range, naming it; ``update`` without
        ``params``; integer or already-reduced gradients.

    References:
      Lu et al., 0/1 Adam, ICLR 2023 <https://arxiv.org/abs/2202.06009>,
      Algorithm 1; DeepSpeed ``ZeroOneAdam``
      <https://www.deepspeed.ai/tutorials/zero-one-adam/>.

    Example:
      >>> import jax, jax.numpy as jnp, transforms
      >>> tx = transforms.zero_one_adam("data", learning_rate=1e-3, freeze_after=100,
      ...                               key=jax.random.key(0))
      >>> state = tx.init({"w": jnp.zeros((4, 64))})
      >>> state.accumulator["w"].shape, int(state.count)
      ((4, 64), 0)
    """
    schedule = (freeze_after if isinstance(freeze_after, ZeroOneSchedule)
                else ZeroOneSchedule(freeze_after))
    sync = compressed_all_reduce(
        axis_name, compressor=compressor, key=key, algorithm=algorithm, min_size=min_size,
        compress_if=compress_if, bucket_bytes=bucket_bytes, error_feedback=residual_feedback())
    settings = _Settings(
        axis_name=axis_name, learning_rate=learning_rate, schedule=schedule, sync=sync,
        adam=AdamSettings(b1, b2, eps, weight_decay, mask), key=key)
    return ReducingOptimizer(functools.partial(_init, settings=settings),
                             functools.partial(_update, settings=settings))


def _init(params: optax.Params, *, settings: _Settings) -> ZeroOneAdamState:
    check_floating_leaves(params, "params")
    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    count = jnp.zeros([], jnp.int32)
    return ZeroOneAdamState(
        momentum=zeros, accumulator=zeros, mu=zeros, nu=zeros,
        anchor=jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params),
        lr_sum=jnp.zeros([], jnp.float32), sync=settings.sync.init(params), count=count,
        nu_count=count)


class _Step(NamedTuple):
    """One step's values, leaf by leaf (flatten order), for the branches."""

    g: list[jax.Array]        # this worker's gradients, float32
    m: list[jax.Array]        # this worker's momenta
    u: list[jax.Array]        # this worker's accumulators
    x: list[jax.Array]        # this worker's parameters, float32
    mu: list[jax.Array]
    nu: list[jax.Array]
    anchor: list[jax.Array]
    lr: jax.Array
    t: jax.Array              # the count after this step
    state: ZeroOneAdamState
    treedef: Any


class _Out(NamedTuple):
    """What a branch returns: the updates (float32) and the next state's parts."""

    updates: list[jax.Array]
    m: list[jax.Array]
    u: list[jax.Array]
    mu: list[jax.Array]
    nu: list[jax.Array]
    anchor: list[jax.Array]
    lr_sum: jax.Array
    sync: CompressedAllReduceState
    nu_count: jax.Array
    advance: jax.Array        # the step counts (False: skipped, non-finite refresh)


def _update(grads: optax.Updates, state: ZeroOneAdamState, params: optax.Params | None = None,
            *, settings: _Settings) -> tuple[optax.Updates, ZeroOneAdamState]:
    """One step of Algorithm 1: a refresh, a sync or a local step (`ZeroOneSchedule.at`)."""
    s = settings
    if params is None:
        raise ValueError("zero_one_adam needs params: update(grads, state, params) with this "
                         "device's own replica (transforms.local_replica)")
    check_axis(s.axis_name)
    check_local_gradients(grads, s.axis_name)
    leaves, treedef = jax.tree.flatten(grads)
    stored_m, m = read_per_device(grads, state.momentum, s.axis_name, "the 0/1 Adam momentum",
                                  field_name="0/1 Adam momenta")
    stored_u, u = read_per_device(grads, state.accumulator, s.axis_name,
                                  "the 0/1 Adam accumulator", field_name="0/1 Adam accumulators")
    x = treedef.flatten_up_to(params)
    lr = s.learning_rate(state.count) if callable(s.learning_rate) else s.learning_rate
    step = _Step(g=[leaf.astype(jnp.float32) for leaf in leaves], m=m, u=u,
                 x=[p.astype(jnp.float32) for p in x], mu=treedef.flatten_up_to(state.mu),
                 nu=treedef.flatten_up_to(state.nu),
                 anchor=treedef.flatten_up_to(state.anchor), lr=jnp.asarray(lr, jnp.float32),
                 t=optax.safe_increment(state.count), state=state, treedef=treedef)
    flags = s.schedule.at(state.count)
    out = cond_matching_types(
        flags.refresh, functools.partial(_refresh, step, s),
        lambda: cond_matching_types(flags.sync, functools.partial(_synchronise, step, s),
                                    functools.partial(_local, step, s)))
    updates = treedef.unflatten([v.astype(p.dtype) for v, p in zip(out.updates, x, strict=True)])
    return updates, ZeroOneAdamState(
        momentum=treedef.unflatten([as_block(v, b) for v, b in zip(out.m, stored_m, strict=True)]),
        accumulator=treedef.unflatten([as_block(v, b)
                                       for v, b in zip(out.u, stored_u, strict=True)]),
        mu=treedef.unflatten(out.mu), nu=treedef.unflatten(out.nu),
        anchor=treedef.unflatten(out.anchor), lr_sum=out.lr_sum,
        sync=out.sync, count=jnp.where(out.advance, step.t, state.count),
        nu_count=out.nu_count)


def _corrected(values: list[jax.Array], decay: float, count: jax.Array) -> list[jax.Array]:
    """optax's bias correction ``value / (1 - decay ** count)`` of each value."""
    return optax.tree.bias_correction(values, decay, count)


def _denominators(nu: list[jax.Array], nu_count: jax.Array, s: _Settings) -> list[jax.Array]:
    """``sqrt(v_hat) + eps`` of each leaf."""
    return [jnp.sqrt(v) + s.adam.eps for v in _corrected(nu, s.adam.b2, nu_count)]


def _decay(values: list[jax.Array], step: _Step, s: _Settings) -> list[jax.Array]:
    """``weight_decay * value`` where ``mask`` decays the leaf, else 0."""
    if not s.adam.weight_decay:
        return [jnp.zeros_like(v) for v in values]
    tree = step.treedef.unflatten(values)
    decay = optax.add_decayed_weights(s.adam.weight_decay, s.adam.mask)
    out, _ = decay.update(jax.tree.map(jnp.zeros_like, tree), decay.init(tree), tree)
    return step.treedef.flatten_up_to(out)


def _own_moments(step: _Step, s: _Settings
                 ) -> tuple[list[jax.Array], list[jax.Array], jax.Array]:
    """This worker's ``m_i`` and ``u_i + lr * m_hat_i`` after its gradient,
    and whether that gradient is finite (if not, both as they were)."""
    own = all_finite(step.g)
    b1 = s.adam.b1
    m = [jnp.where(own, b1 * m + (1 - b1) * g, m) for m, g in zip(step.m, step.g, strict=True)]
    u = [jnp.where(own, u + step.lr * mh, u)
         for u, mh in zip(step.u, _corrected(m, s.adam.b1, step.t), strict=True)]
    return m, u, own


def _moved(anchor: list[jax.Array], step: _Step) -> list[jax.Array]:
    """The updates that take this worker's parameters to ``anchor``."""
    return [a - x for a, x in zip(anchor, step.x, strict=True)]


def _refresh(step: _Step, s: _Settings) -> _Out:
    """``t`` in ``T_v``: the exact mean, both moments, one step from the sync
    point; skipped on every worker when the mean is non-finite."""
    st = step.state
    low_bits = s.schedule.refresh_compressor
    with qc.phase(s.schedule.refresh_phase):
        if low_bits is None:
            mean = qc.fused_psum(step.g, s.axis_name, mean=True)
        else:  # no error feedback, as a warm-up compressor's steps
            mean = qc.compressed_all_reduce(step.g, s.axis_name, low_bits, jax.random.fold_in(
                s.key, st.count), mean=True).value
        ok = all_finite(mean)
        m = [s.adam.b1 * m + (1 - s.adam.b1) * g for m, g in zip(step.mu, mean, strict=True)]
        nu = [s.adam.b2 * v + (1 - s.adam.b2) * g * g for v, g in zip(step.nu, mean, strict=True)]
        nu_count = optax.safe_increment(st.nu_count)
        anchor = [a - step.lr * (mh / d + wd) for a, mh, d, wd in zip(
            step.anchor, _corrected(m, s.adam.b1, step.t), _denominators(nu, nu_count, s),
            _decay(step.anchor, step, s), strict=True)]
        keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(ok, new, old))
        return _Out(updates=[jnp.where(ok, d, 0.0) for d in _moved(anchor, step)],
                    m=keep(m, step.m), u=step.u, mu=keep(m, step.mu), nu=keep(nu, step.nu),
                    anchor=keep(anchor, step.anchor), lr_sum=st.lr_sum, sync=st.sync,
                    nu_count=jnp.where(ok, nu_count, st.nu_count), advance=ok)


def _synchronise(step: _Step, s: _Settings) -> _Out:
    """``t`` in ``T_u``: the accumulators' compressed average; every worker's
    momentum and parameters set from it, its accumulator emptied."""
    st = step.state
    with qc.phase(COMPRESSED):
        _, u, _ = _own_moments(step, s)
        lr_sum = st.lr_sum + step.lr
        mean, sync = s.sync.update(step.treedef.unflatten(u), st.sync)
        mean = [w.astype(jnp.float32) for w in step.treedef.flatten_up_to(mean)]
        ok = all_finite(mean)  # the same on every worker
        anchor = [jnp.where(ok, a - w / d - lr_sum * wd, a) for a, w, d, wd in zip(
            step.anchor, mean, _denominators(step.nu, st.nu_count, s),
            _decay(step.anchor, step, s), strict=True)]
        # The momentum the sync implies: the accumulator's lr-weighted mean of
        # m_hat, bias correction undone (Algorithm 1: m = u / sum(lr)).
        undo = 1 - s.adam.b1 ** step.t.astype(jnp.float32)
        mu = [jnp.where(ok, w / lr_sum * undo, m) for w, m in zip(mean, step.mu, strict=True)]
        m = [jnp.where(ok, new, m) for new, m in zip(mu, step.m, strict=True)]
        return _Out(updates=[jnp.where(ok, d, 0.0) for d in _moved(anchor, step)], m=m,
                    u=[jnp.where(ok, jnp.zeros_like(v), v) for v in step.u], mu=mu, nu=step.nu,
                    anchor=anchor, lr_sum=jnp.where(ok, 0.0, st.lr_sum), sync=sync,
                    nu_count=st.nu_count, advance=ok)


def _local(step: _Step, s: _Settings) -> _Out:
    """A local step: this worker's momentum and accumulator advance and it
    steps with the variance as it stands; nothing is sent."""
    st = step.state
    with qc.phase(INNER):
        m, u, own = _own_moments(step, s)
        moves = [-step.lr * (mh / d + wd) for mh, d, wd in zip(
            _corrected(m, s.adam.b1, step.t), _denominators(step.nu, st.nu_count, s),
            _decay(step.x, step, s), strict=True)]
        return _Out(updates=[jnp.where(own, v, 0.0) for v in moves], m=m, u=u, mu=step.mu,
                    nu=step.nu,
                    anchor=step.anchor, lr_sum=st.lr_sum + step.lr, sync=st.sync,
                    nu_count=st.nu_count, advance=jnp.array(True))
