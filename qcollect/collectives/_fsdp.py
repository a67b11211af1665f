"""The differentiable gather of sharded training (FSDP / ZeRO-3).

`fsdp_gather` turns each device's parameter shards into the full parameters
for the forward pass with `qcollect.compressed_all_gather`, and its
derivative reduce-scatters the full-size gradient back to the shards with
`qcollect.compressed_reduce_scatter`, so ``jax.grad`` of an ordinary loss of
the gathered parameters runs exactly these two compressed collectives
(`jax.custom_vjp`), and no uncompressed all-reduce. Error feedback on the
gradients (LoCo; QSDP's analysis covers the unbiased case without it) is
explicit state: the residuals are an input of the gather, and their
"gradient" is the next residuals, ``g + residual - contributed``:

    grads, residuals = jax.grad(loss, argnums=(0, 1))(shards, residuals)

Leaves whose ``dimension`` is None are replicated (small leaves: biases,
norms): they pass through the forward unchanged and their gradients are
mean- or sum-all-reduced uncompressed (`qcollect.fused_psum`).

References:
  Rajbhandari et al. (ZeRO), SC 2020 <https://arxiv.org/abs/1910.02054>;
  Wang et al. (ZeRO++), 2023 <https://arxiv.org/abs/2306.10209>, qwZ and qgZ;
  Markov et al. (QSDP), ICML 2023 <https://arxiv.org/abs/2302.02390>;
  Xie et al. (LoCo), 2024 <https://arxiv.org/abs/2407.04480>.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from qcollect._config import per_leaf
from qcollect._payload import Compressor
from qcollect.collectives._algorithms import Exchange
from qcollect.collectives._messages import fused_psum
from qcollect.collectives._result import AxisName
from qcollect.collectives._ring import as_varying
from qcollect.collectives._sharded import compressed_all_gather, compressed_reduce_scatter
from qcollect.compressors._baseline import identity

__all__ = ["fsdp_gather", "fsdp_residuals", "shard_dimensions"]


def shard_dimensions(params: Any, n: int, *, min_size: int = 2 ** 14) -> Any:
    """Which dimension of each leaf to shard over ``n`` devices (None: replicate).

    A leaf of at least ``min_size`` values is sharded on its longest
    dimension whose length is a multiple of ``n`` (the first of equals);
    smaller leaves, and leaves with no such dimension, are replicated.

    Args:
      params: a pytree of arrays (full-size parameters, or their shapes).
      n: the devices of the data axis.
      min_size: the smallest leaf that is sharded (default 16384 values).

    Returns:
      A pytree like ``params`` of ints and None: the ``dimension`` of
      `fsdp_gather` (``jax.tree.map`` over it needs ``is_leaf=lambda d: d
      is None``).

    Example:
      >>> import jax.numpy as jnp, qcollect as qc
      >>> qc.shard_dimensions({"w": jnp.zeros((784, 2048)), "b": jnp.zeros(2048)}, 8)
      {'b': None, 'w': 1}
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")

    def choose(leaf: Any) -> int | None:
        shape = tuple(jnp.shape(leaf))
        if math.prod(shape) < min_size:
            return None
        fits = [d for d in range(len(shape)) if shape[d] % n == 0]
        return max(fits, key=lambda d: (shape[d], -d)) if fits else None

    return jax.tree.map(choose, params)


def fsdp_residuals(params: Any, dimension: Any) -> Any:
    """Zero error-feedback residuals for `fsdp_gather`: float32 zeros of each
    sharded leaf's full shape (per device), a scalar zero for replicated
    leaves. ``params`` are full-size (or their ``jax.ShapeDtypeStruct``)."""
    return jax.tree.map(
        lambda leaf, d: jnp.zeros(() if d is None else jnp.shape(leaf), jnp.float32),
        params, dimension, is_leaf=lambda d: d is None)


def fsdp_gather(shards: Any, residuals: Any, key: jax.Array, axis_name: AxisName, *,
                dimension: Any, weights: Compressor | None = None,
                gradients: Compressor | None = None, mean: bool = True,
                exchange: Exchange = "permute") -> Any:
    """The full parameters from this device's shards; differentiable.

    Forward: `qcollect.compressed_all_gather` of the sharded leaves with
    ``weights``. Backward (the derivative, under ``jax.grad``): the
    cotangent of the gathered parameters (this device's full-size gradient)
    plus ``residuals`` is reduce-scattered with ``gradients``
    (`qcollect.compressed_reduce_scatter`), so the gradient of ``shards`` is
    this device's shard of the devices' mean (or sum) gradient, and the
    gradient of ``residuals`` is the next residuals, ``g + residuals -
    contributed`` (error feedback;
    docs/collectives.md#sharded-training-reduce-scatter-and-all-gather).

    Args:
      shards: pytree, this device's shard of each sharded leaf (``P(axis)``
        on its ``dimension``) and the whole of each replicated leaf.
      residuals: like `fsdp_residuals`: per device, float32, each sharded
        leaf's full shape; a scalar for replicated leaves. Zeros and a
        ``gradients`` without error in ``x - contributed`` (identity) keep
        them zero.
      key: PRNG key of this step (fold in the step count), the same on every
        device; used by stochastic compressors.
      axis_name: the data axis (or ``(outer, inner)``: `compressed_reduce_scatter`).
      dimension: a pytree like ``shards`` of ints (the sharded dimension)
        and None (replicated), e.g. from `shard_dimensions`.
      weights: the all-gather's compressor (default ``qc.identity()``);
        for ZeRO++'s qwZ, ``qc.qsgd(bits=8, bucket_size=2048,
        stochastic=False)``.
      gradients: the reduce-scatter's compressor (default ``qc.identity()``).
      mean: the gradient is the mean over devices (default), else the sum.
      exchange: as for `compressed_reduce_scatter`.

    Returns:
      The gathered parameters, full-size, typed varying along ``axis_name``
      (each device's loss differentiates its own copy, so no automatic
      all-reduce is inserted by the transpose).

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("d",))
      >>> dims = {"w": 0}
      >>> def grads(shards, residuals, x):
      ...     def loss(s, r):
      ...         p = qc.fsdp_gather(s, r, jax.random.key(0), "d", dimension=dims)
      ...         return jnp.sum(x[0] @ p["w"])
      ...     return jax.grad(loss, argnums=(0, 1))(shards, residuals)
      >>> step = jax.shard_map(grads, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
      >>> w = {"w": jnp.zeros((4, 1))}
      >>> r = qc.fsdp_residuals({"w": jnp.zeros((8, 1))}, dims)  # 2 devices' full-size rows
      >>> x = jnp.array([[[1.0, 2.0, 3.0, 4.0]], [[3.0, 2.0, 1.0, 0.0]]])
      >>> g, r = step(*jax.device_put((w, r, x), NamedSharding(mesh, P("d"))))
      >>> g["w"].ravel().tolist()  # the mean of the two devices' gradients
      [2.0, 2.0, 2.0, 2.0]
    """
    weights = identity() if weights is None else weights
    gradients = identity() if gradients is None else gradients
    plan = _plan(shards, residuals, dimension)

    @jax.custom_vjp
    def run(shards: Any, residuals: Any, key: jax.Array) -> Any:
        del residuals
        return _gathered(plan, plan.treedef.flatten_up_to(shards), key, axis_name, weights)

    def forward(shards: Any, residuals: Any, key: jax.Array) -> tuple[Any, tuple[Any, Any]]:
        return run(shards, residuals, key), (residuals, key)

    def backward(saved: tuple[Any, jax.Array], cotangent: Any) -> tuple[Any, Any, None]:
        residual_tree, step_key = saved
        grads, new_res = _cotangents(plan, plan.treedef.flatten_up_to(cotangent),
                                     plan.treedef.flatten_up_to(residual_tree), step_key,
                                     axis_name, gradients, mean=mean, exchange=exchange)
        return plan.treedef.unflatten(grads), plan.treedef.unflatten(new_res), None

    run.defvjp(forward, backward)
    return run(shards, residuals, key)


class _Plan(NamedTuple):
    """Which leaves of the shards `fsdp_gather` gathers, along which
    dimension, and the shards themselves (whose dtypes the gradients take)."""

    treedef: Any
    dims: list[int | None]
    leaves: list[Any]

    @property
    def sharded(self) -> list[int]:
        return [i for i, d in enumerate(self.dims) if d is not None]

    @property
    def replicated(self) -> list[int]:
        return [i for i, d in enumerate(self.dims) if d is None]


def _plan(shards: Any, residuals: Any, dimension: Any) -> _Plan:
    """The `_Plan` of `fsdp_gather`'s arguments, checked (`_check`)."""
    leaves, treedef = jax.tree.flatten(shards)
    dims = _leaf_dimensions(treedef, dimension)
    _check(leaves, _leaf_residuals(treedef, residuals), dims)
    return _Plan(treedef, dims, leaves)


def _gathered(plan: _Plan, leaves: list[Any], key: jax.Array, axis_name: AxisName,
              weights: Compressor) -> Any:
    """The forward pass: the sharded leaves all-gathered with ``weights``, the
    replicated ones as they are, all typed varying along ``axis_name``."""
    full = list(leaves)
    sharded = plan.sharded
    if sharded:
        gathered = compressed_all_gather(
            [leaves[i] for i in sharded], axis_name, weights, key,
            gather_dimension=[plan.dims[i] for i in sharded]).value
        for i, g in zip(sharded, gathered, strict=True):
            full[i] = g
    return plan.treedef.unflatten([as_varying(f, axis_name) for f in full])


def _cotangents(plan: _Plan, g: list[Any], res: list[Any], key: jax.Array, axis_name: AxisName,
                gradients: Compressor, *, mean: bool,
                exchange: Exchange) -> tuple[list[Any], list[Any]]:
    """The backward pass, leaf by leaf: ``(gradients of the shards, next
    residuals)`` from the full-size cotangents ``g`` and the residuals
    ``res``: the sharded leaves' ``g + res`` reduce-scattered with
    ``gradients`` (the residual keeps what it lost), the replicated leaves'
    ``g`` all-reduced uncompressed (their residual stays zero)."""
    grads: list[Any] = [None] * len(g)
    new_res = list(res)
    sharded, replicated = plan.sharded, plan.replicated
    if sharded:
        inputs = [g[i].astype(jnp.float32) + res[i] for i in sharded]
        out = compressed_reduce_scatter(
            inputs, axis_name, gradients, key, mean=mean, exchange=exchange,
            scatter_dimension=[plan.dims[i] for i in sharded])
        for i, x, v, c in zip(sharded, inputs, out.value, out.contributed, strict=True):
            grads[i] = v.astype(plan.leaves[i].dtype)
            new_res[i] = x - c.astype(jnp.float32)
    if replicated:
        summed = fused_psum([g[i] for i in replicated], axis_name, mean=mean)
        for i, v in zip(replicated, summed, strict=True):
            grads[i] = v.astype(plan.leaves[i].dtype)
            new_res[i] = jnp.zeros_like(res[i])
    return grads, new_res


def _leaf_dimensions(treedef: Any, dimension: Any) -> list[int | None]:
    return per_leaf(treedef, dimension,
                    lambda v: v is None or isinstance(v, int) and not isinstance(v, bool),
                    "dimension", "an int or None")


def _leaf_residuals(treedef: Any, residuals: Any) -> list[Any]:
    return per_leaf(treedef, residuals, lambda v: False, "residuals",
                    "arrays (qc.fsdp_residuals makes them)")


def _check(leaves: list[Any], residuals: list[Any], dims: list[int | None]) -> None:
    for leaf, residual, d in zip(leaves, residuals, dims, strict=True):
        if d is None:
            continue
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < jnp.ndim(leaf):
            raise ValueError(f"dimension {d!r} is not a dimension of a shard of shape "
                             f"{jnp.shape(leaf)}")
        full = list(jnp.shape(leaf))
        if jnp.shape(residual)[:d] + jnp.shape(residual)[d + 1:] != tuple(
                full[:d] + full[d + 1:]):
            raise ValueError(f"residuals: a shard of shape {tuple(full)} needs its full-size "
                             f"residual (dimension {d} N times longer), got "
                             f"{jnp.shape(residual)} (qc.fsdp_residuals makes them)")
