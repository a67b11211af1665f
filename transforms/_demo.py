"""DeMo: decoupled momentum, of which only the fast DCT components travel.

Peng, Quesnelle and Kingma, "DeMo: Decoupled Momentum Optimization"
(arXiv:2411.19870), Algorithm 1. Each worker keeps its own momentum, never
averaged; each step, on worker ``i``:

* ``m_i = beta * m_i + lr * g_i`` (line 3, with the learning rate inside
  as the reference implementation has it);
* ``q_i``: the ``k`` largest DCT coefficients of each chunk of ``s`` values
  of ``m_i`` (line 4, `qcollect.dct_components`);
* ``m_i = m_i - IDCT(q_i)`` (line 5): what was sent leaves the momentum, so
  the momentum is its own error feedback;
* ``Q``: the mean over workers of ``IDCT(q_j)``, from an all-gather of the
  sparse words (line 6);
* ``x = x - lr * sign(Q)`` (line 7; signum, as the paper's experiments),
  decoupled weight decay ``x = x - lr * weight_decay * x`` before.

Where it deviates: the chunks are 1-D (``s`` consecutive values of each
flattened leaf, each leaf padded to a multiple of ``s`` so no chunk holds
two leaves) where the reference takes 2-D blocks of matrices; the
coefficients travel as bfloat16 with a uint8 index (3 bytes each); a step
whose gathered components are non-finite is skipped (zero update, the
momenta as they were). All the leaves' chunks go in one all-gather per
word type; its bytes are read from the compiled program like every other.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

import qcollect as qc
from qcollect.checks import check_float, check_floating_leaves, check_int
from transforms._axes import AxisName, ReducingOptimizer, check_local_gradients
from transforms._finite import all_finite
from transforms._placement import per_device
from transforms._state import kept_per_device, read_per_device

__all__ = ["DeMoState", "decoupled_momentum"]


@per_device("momentum")
class DeMoState(NamedTuple):
    """State of `decoupled_momentum`.

    Attributes:
      momentum: each device's own momentum (float32, like the parameters),
        ``P(axis_name)``: never averaged, what it has not sent yet.
      count: int32 steps taken (replicated).
    """

    momentum: Any
    count: jax.Array


@dataclasses.dataclass(frozen=True)
class _Settings:
    axis_name: AxisName
    learning_rate: optax.ScalarOrSchedule
    chunk_size: int
    top_k: int
    beta: float
    weight_decay: float
    mask: Any
    sign: bool
    value_dtype: Any


def decoupled_momentum(axis_name: AxisName, *, learning_rate: optax.ScalarOrSchedule,
                       chunk_size: int = 64, top_k: int = 2, beta: float = 0.999,
                       weight_decay: float = 0.0, mask: Any = None, sign: bool = True,
                       value_dtype: Any = jnp.bfloat16) -> optax.GradientTransformation:
    """DeMo (Peng, Quesnelle and Kingma 2024, Algorithm 1): the whole
    optimizer, each device's momentum decoupled, its fast DCT components
    all-gathered.

    Feed it each device's own gradients and apply its updates to replicated
    parameters. Per step each device sends ``3 * top_k`` bytes per
    ``chunk_size`` values to each other device (``top_k / chunk_size`` of
    the coefficients); the module's docstring has the algorithm.

    Args:
      axis_name: the data-parallel axis.
      learning_rate: a step size or an optax schedule of the step count.
      chunk_size: values per DCT chunk ``s``, 2 to 65,536.
      top_k: coefficients sent per chunk, 1 to ``chunk_size``.
      beta: the momentum's decay, in ``[0, 1)`` (the reference's 0.999).
      weight_decay: decoupled weight decay, >= 0 (needs ``params``).
      mask: which leaves decay, as ``optax.adamw``'s.
      sign: the update is ``sign(Q)`` (default, the paper's) or ``Q``.
      value_dtype: the coefficients' dtype on the wire (bfloat16 or float32).

    Returns:
      An ``optax.GradientTransformation`` with `DeMoState`.

    Raises:
      ValueError: a setting out of range, naming it; invariant or integer gradients.

    References:
      Peng, Quesnelle and Kingma, DeMo: Decoupled Momentum Optimization, 2024
      <https://arxiv.org/abs/2411.19870>, Algorithm 1.

    Example:
      >>> import jax.numpy as jnp, transforms
      >>> tx = transforms.decoupled_momentum("data", learning_rate=1e-3, top_k=4)
      >>> tx.init({"w": jnp.zeros((8, 64))}).momentum["w"].shape
      (8, 64)
    """
    chunk_size = check_int("chunk_size", chunk_size, low=2, high=65536)
    settings = _Settings(
        axis_name, learning_rate, chunk_size, check_int("top_k", top_k, low=1, high=chunk_size),
        check_float("beta", beta, low=0.0, low_inclusive=True, high=1.0, high_inclusive=False),
        check_float("weight_decay", weight_decay, low=0.0, low_inclusive=True), mask,
        bool(sign), jnp.dtype(value_dtype))
    if settings.value_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"value_dtype must be bfloat16 or float32, got {value_dtype!r}")
    return ReducingOptimizer(
        lambda params: DeMoState(jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32),
                                              params), jnp.zeros([], jnp.int32)),
        functools.partial(_update, settings=settings))


def _chunks(leaves: list[jax.Array], size: int) -> jax.Array:
    """Every leaf flattened and zero-padded to whole chunks, side by side: ``(chunks, size)``."""
    rows = [jnp.pad(leaf.reshape(-1), (0, -leaf.size % size)).reshape(-1, size)
            for leaf in leaves]
    return jnp.concatenate(rows) if rows else jnp.zeros((0, size), jnp.float32)


def _unchunk(chunks: jax.Array, like: list[jax.Array]) -> list[jax.Array]:
    """`_chunks` undone: each leaf's values back in its shape."""
    out, start = [], 0
    for leaf in like:
        rows = math.ceil(leaf.size / chunks.shape[1])
        out.append(chunks[start:start + rows].reshape(-1)[:leaf.size].reshape(leaf.shape))
        start += rows
    return out


def _update(grads: optax.Updates, state: DeMoState, params: optax.Params | None = None, *,
            settings: _Settings) -> tuple[optax.Updates, DeMoState]:
    """One step of Algorithm 1 (lines 3-7); skipped when non-finite."""
    s = settings
    check_floating_leaves(grads, "grads")
    check_local_gradients(grads, s.axis_name)
    if s.weight_decay and params is None:
        raise ValueError("decoupled_momentum with weight_decay needs params: update(grads, "
                         "state, params)")
    leaves, treedef = jax.tree.flatten(grads)
    stored, old = read_per_device(grads, state.momentum, s.axis_name, "the DeMo momentum",
                                  field_name="DeMo momenta")
    lr = s.learning_rate(state.count) if callable(s.learning_rate) else s.learning_rate
    momenta = _chunks([s.beta * m + lr * g.astype(jnp.float32) for m, g in zip(
        cast(list[jax.Array], old), leaves, strict=True)], s.chunk_size)
    sent = qc.dct_components(momenta, s.top_k, value_dtype=s.value_dtype)
    kept = _unchunk(momenta - qc.from_dct_components(sent, s.chunk_size), leaves)
    n = jax.lax.axis_size(s.axis_name)
    gathered = [qc.all_gather_invariant(word, s.axis_name).reshape(n, *word.shape)
                for word in sent]
    merged = qc.DCTComponents(*(jnp.moveaxis(w, 0, 1).reshape(w.shape[1], -1)
                                for w in gathered))
    shared = qc.from_dct_components(merged, s.chunk_size) / n
    finite = all_finite(shared)
    direction = _unchunk(jnp.sign(shared) if s.sign else shared, leaves)
    step = treedef.unflatten(direction)
    if s.weight_decay:
        decay = optax.add_decayed_weights(s.weight_decay, s.mask)
        step, _ = decay.update(step, decay.init(params), params)
    updates = jax.tree.map(lambda u, g: jnp.where(finite, -lr * u, 0.0).astype(g.dtype),
                           step, grads)
    momentum = treedef.unflatten(kept_per_device(kept, old, stored, finite))
    return updates, DeMoState(momentum, jnp.where(finite, optax.safe_increment(state.count),
                                                  state.count))
