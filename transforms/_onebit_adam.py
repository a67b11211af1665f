"""1-bit Adam: Adam whose momentum, not the gradient, is compressed once the
variance is frozen.

Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
Adam's Convergence Speed" (ICML 2021, arXiv:2102.02888), Algorithm 1:

* warm-up, steps ``0 .. K - 1`` (lines 1-2): Adam on the exact mean of the
  workers' gradients;
* line 3: the second moment ``v`` stops at ``v_K``;
* compression stage, on worker ``i`` (lines 5-8): the local momentum
  ``m_i = b1 m + (1 - b1) g_i`` from the shared ``m``; ``C(m_i + e_i)`` is
  sent and the worker error ``e_i = m_i + e_i - C(m_i + e_i)`` kept;
* on the server (lines 9-11): the average ``a`` of what the workers sent,
  ``C(a + e_s)`` sent back and the server error ``e_s = a + e_s - C(a + e_s)``
  kept;
* on every worker (lines 12-13): ``m`` is what came back, and
  ``x = x - lr * m / sqrt(v_K)``.

Both compressions and both errors are `transforms.compressed_all_reduce`
with ``algorithm="pairwise"`` and Seide's residual
(`transforms.residual_feedback`) run on the local momenta: there is no
central server; the owner of each chunk serves it, re-encodes the chunk's
average and keeps the server error of its chunk, as DeepSpeed's
``compressed_allreduce`` does. During the warm-up the same all-reduce sends
the gradients' exact mean (its ``compress_after``), so one `CompressAfter`
value is the warm-up, the freeze and the start of compression.

Where this deviates from the paper and from DeepSpeed's ``OnebitAdam``:

* Bias corrections as ``optax.adamw``'s (the paper's Algorithm 1 and
  DeepSpeed use none): the warm-up is ``optax.adamw`` on the mean gradient,
  and the frozen ``v`` keeps the correction of its last step, so the step
  size does not jump where compression starts (with ``b2 = 0.999`` and a
  warm-up of 60 steps, ``sqrt(v_K)`` uncorrected is about 4x too small).
* Any qcollect compressor, not only scaled signs (DeepSpeed's scale is one
  ``||x|| / sqrt(n)`` per fused buffer; `qcollect.onebit` keeps two means
  per bucket or column).
* The momentum is float32 whatever the gradients' dtype: it is what error
  feedback accumulates.
* A step whose reduced value is non-finite (any worker's gradient NaN or
  Inf) is skipped: zero update, every part of the state as it was, the
  step count included, so the freeze and the compression stay in step.
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
from transforms._axes import AxisName, ReducingOptimizer
from transforms._feedback import residual_feedback
from transforms._finite import all_finite, keep_if_finite
from transforms._frozen_adam import FrozenAdamState, freeze_schedule
from transforms._phases import CompressAfter
from transforms._policy import CompressorSpec, LeafPredicate

__all__ = ["OneBitAdamState", "onebit_adam"]


class OneBitAdamState(NamedTuple):
    """State of `onebit_adam`.

    Attributes:
      adam: the moments, replicated (``P()``): ``mu`` the shared momentum
        (float32), ``nu`` the second moment, frozen from ``compress_after``
        on, ``count`` and ``nu_count`` (`transforms.FrozenAdamState`).
      sync: the state of the momentum's all-reduce: its ``feedback`` holds
        the worker errors (``residual``) and the server errors
        (``owner_residual``), per device (``P(axis_name)``,
        `transforms.state_specs`).
    """

    adam: FrozenAdamState
    sync: CompressedAllReduceState


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The validated settings of one `onebit_adam`."""

    learning_rate: optax.ScalarOrSchedule
    schedule: CompressAfter
    sync: optax.GradientTransformation
    adam: AdamSettings


def onebit_adam(axis_name: AxisName, *, learning_rate: optax.ScalarOrSchedule,
                compress_after: int | CompressAfter, key: jax.Array,
                compressor: CompressorSpec = qc.onebit(), b1: float = 0.9, b2: float = 0.999,
                eps: float = 1e-8, weight_decay: float = 0.0, mask: Any = None,
                algorithm: qc.Algorithm = "pairwise", min_size: int = 0,
                compress_if: LeafPredicate | None = None,
                bucket_bytes: int | None = qc.BUCKET_BYTES) -> optax.GradientTransformation:
    """1-bit Adam (Tang et al. 2021, Algorithm 1): the whole optimizer, the
    all-reduce inside.

    Feed it each device's own gradients (as `transforms.compressed_all_reduce`)
    and apply its updates to replicated parameters; it returns
    ``-learning_rate * (m_hat / (sqrt(v_hat) + eps) + weight_decay * params)``
    like ``optax.adamw``. The module's docstring has the algorithm and where
    it deviates from the paper and DeepSpeed.

    Args:
      axis_name: the data-parallel axis (``shard_map`` or ``pmap``).
      learning_rate: a step size or an optax schedule of the step count.
      compress_after: the warm-up, an int ``K >= 1`` or a
        `transforms.CompressAfter`: exact Adam for ``K`` steps, then the
        variance frozen and the momentum compressed (Tang et al. use 15-25%
        of the steps); phases ``"exact"`` and ``"compressed"``. With
        ``CompressAfter(K, warm_up=qc.cast("bfloat16"))`` the warm-up's
        mean goes as bfloat16 (phase ``"lead-in"``; a quantizer there can
        freeze ``v`` at 0: `transforms.CompressAfter` says why).
      key: PRNG key for stochastic compressors (the same on every device).
      compressor: what the momentum goes through (default `qcollect.onebit`,
        signs and two means per 64 values), or ``f(path, leaf)`` per leaf.
      b1, b2, eps: Adam's (``optax.adamw``'s defaults).
      weight_decay: decoupled weight decay (Loshchilov and Hutter), >= 0;
        needs ``params`` in ``update``.
      mask: which leaves decay, as ``optax.adamw``'s (e.g. `transforms.matrices`).
      algorithm: ``"pairwise"`` (default: the owner re-encodes and keeps
        the server error), ``"auto"`` or ``"ring"`` (linear compressors:
        summed compressed, no server error).
      min_size, compress_if, bucket_bytes: which leaves are compressed and
        how they are fused, as in `transforms.compressed_all_reduce`; the
        others' momenta are averaged exactly.

    Returns:
      An ``optax.GradientTransformation`` whose state is a `OneBitAdamState`.

    Raises:
      ValueError: a setting out of range, naming it; invariant or integer
        gradients (from the all-reduce).

    References:
      Tang et al., 1-bit Adam, ICML 2021 <https://arxiv.org/abs/2102.02888>,
      Algorithm 1; DeepSpeed ``OnebitAdam``
      <https://www.deepspeed.ai/tutorials/onebit-adam/>.

    Example:
      >>> import jax, jax.numpy as jnp, transforms
      >>> tx = transforms.onebit_adam("data", learning_rate=1e-3, compress_after=100,
      ...                             key=jax.random.key(0))
      >>> state = tx.init({"w": jnp.zeros((4, 64))})
      >>> state.sync.feedback.residual["w"].shape   # the worker error
      (4, 64)
    """
    schedule = freeze_schedule(compress_after, "compress_after")
    sync = compressed_all_reduce(
        axis_name, compressor=compressor, key=key, algorithm=algorithm, min_size=min_size,
        compress_if=compress_if, bucket_bytes=bucket_bytes, compress_after=schedule,
        error_feedback=residual_feedback())
    settings = _Settings(
        learning_rate=learning_rate, schedule=schedule, sync=sync,
        adam=AdamSettings(b1, b2, eps, weight_decay, mask))
    return ReducingOptimizer(functools.partial(_init, settings=settings),
                             functools.partial(_update, settings=settings))


def _init(params: optax.Params, *, settings: _Settings) -> OneBitAdamState:
    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    count = jnp.zeros([], jnp.int32)
    return OneBitAdamState(adam=FrozenAdamState(count, zeros, zeros, count),
                           sync=settings.sync.init(params))


def _update(grads: optax.Updates, state: OneBitAdamState, params: optax.Params | None = None,
            *, settings: _Settings) -> tuple[optax.Updates, OneBitAdamState]:
    """One step of Algorithm 1: the warm-up's Adam on the exact mean, or the
    compressed momentum with the frozen variance; skipped when non-finite."""
    s, adam = settings, state.adam
    check_floating_leaves(grads, "grads")
    if s.adam.weight_decay and params is None:
        raise ValueError("onebit_adam with weight_decay needs params: update(grads, state, "
                         "params)")
    warm = s.schedule.at(adam.count)
    # What each worker sends: its gradient in the warm-up, its local
    # momentum m_i = b1 m + (1 - b1) g_i after (Algorithm 1, line 5).
    local = jax.tree.map(
        lambda g, m: jnp.where(warm, g.astype(jnp.float32), s.adam.b1 * m + (1 - s.adam.b1) * g),
        grads, adam.mu)
    reduced, sync = s.sync.update(local, state.sync)
    mu = jax.tree.map(lambda new, r: jnp.where(warm, new, r),
                      optax.tree.update_moment(reduced, adam.mu, s.adam.b1, 1), reduced)
    nu = jax.tree.map(lambda new, old: jnp.where(warm, new, old),
                      optax.tree.update_moment_per_elem_norm(reduced, adam.nu, s.adam.b2, 2),
                      adam.nu)
    count = optax.safe_increment(adam.count)
    nu_count = jnp.where(warm, optax.safe_increment(adam.nu_count), adam.nu_count)
    step = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + s.adam.eps),
                        optax.tree.bias_correction(mu, s.adam.b1, count),
                        optax.tree.bias_correction(nu, s.adam.b2, nu_count))
    if s.adam.weight_decay:
        decay = optax.add_decayed_weights(s.adam.weight_decay, s.adam.mask)
        step, _ = decay.update(step, decay.init(params), params)
    lr = s.learning_rate(adam.count) if callable(s.learning_rate) else s.learning_rate
    finite = all_finite(reduced)
    updates = jax.tree.map(
        lambda u, g: jnp.where(finite, -lr * u, 0.0).astype(g.dtype), step, grads)
    new = OneBitAdamState(FrozenAdamState(count, mu, nu, nu_count), sync)
    return updates, keep_if_finite(finite, new, state)
