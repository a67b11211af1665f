"""Sharded training (FSDP / ZeRO-3) for the examples' training loop.

`ShardedDataParallel` is a `common.train.DataParallel` whose parameters and
optimizer state are sharded over the data axis (`qcollect.shard_dimensions`:
each leaf of at least ``fsdp_min_size`` values on its longest dimension
that divides by the devices; smaller leaves replicated). Its step gathers
the weights with the ``--weight-compressor`` and reduce-scatters the
gradients with the compressor of the run's name, with error feedback
(`transforms.fsdp`); the optimizer steps on the shards.

Compressor names (``--compressors``) for the gradients' reduce-scatter:
``none`` (exact), ``bf16``, ``onebit``, ``qsgd-2``, ``qsgd-4``, ``qsgd-8``.
Weight compressors (``--weight-compressor``): ``none``, ``bf16``, ``int8``
and ``int4`` (block-wise symmetric round-to-nearest over blocks of 2048
values, ZeRO++'s qwZ: ``qc.qsgd(bits, bucket_size=2048, stochastic=False)``).
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms
from common.compressors import Communication
from common.train import DataParallel, on_every_device, placed_bytes

WEIGHT_BLOCK = 2048
WEIGHT_COMPRESSORS = {
    "none": qc.identity,
    "bf16": lambda: qc.cast(jnp.bfloat16),
    "int8": lambda: qc.qsgd(bits=8, bucket_size=WEIGHT_BLOCK, stochastic=False),
    "int4": lambda: qc.qsgd(bits=4, bucket_size=WEIGHT_BLOCK, stochastic=False),
}
GRADIENT_COMPRESSORS = {
    "none": qc.identity,
    "bf16": lambda: qc.cast(jnp.bfloat16),
    "onebit": qc.onebit,
    "qsgd-2": lambda: qc.qsgd(bits=2),
    "qsgd-4": lambda: qc.qsgd(bits=4),
    "qsgd-8": lambda: qc.qsgd(bits=8),
}


def check_names(compressors, weight_compressor: str) -> None:
    """Raises ValueError unless the names are FSDP's (module docstring)."""
    unknown = [n for n in compressors if n not in GRADIENT_COMPRESSORS]
    if unknown:
        raise ValueError(f"compressors: with parallel 'fsdp' the gradients' reduce-scatter "
                         f"takes {', '.join(GRADIENT_COMPRESSORS)}, got {', '.join(unknown)}")
    if weight_compressor not in WEIGHT_COMPRESSORS:
        raise ValueError(f"weight_compressor must be one of {', '.join(WEIGHT_COMPRESSORS)}, "
                         f"got {weight_compressor!r}")


class ShardedDataParallel(DataParallel):
    """A `DataParallel` with parameters and optimizer state sharded (module docstring).

    Args:
      model / mesh: as for `DataParallel` (one ``"data"`` axis, or
        ``("node", "local")``: gradients reduce-scattered uncompressed inside
        a node, compressed across nodes; weights gathered compressed over both).
      weight_compressor: a name of `WEIGHT_COMPRESSORS`.
      min_size: leaves with fewer values are replicated.
      error_feedback: `transforms.residual_feedback()` keeps the gradients'
        residuals, None keeps none (`common.compressors.feedback`).
    """

    def __init__(self, model, mesh=None, *, weight_compressor: str = "none",
                 min_size: int = 2 ** 14, error_feedback=transforms.residual_feedback()):
        super().__init__(model, mesh)
        check_names((), weight_compressor)
        self.weights = WEIGHT_COMPRESSORS[weight_compressor]()
        self.dims = qc.shard_dimensions(self.params, self.num_devices, min_size=min_size)
        self.error_feedback = error_feedback
        self._fsdp = None

    def uncompressed(self) -> ShardedDataParallel:
        """The same sharding with the weights gathered exactly."""
        other = copy.copy(self)
        other.weights, other._fsdp = qc.identity(), None
        return other

    def communication(self, name: str, cfg, key) -> Communication:
        """The gradients go through the gather's derivative (`transforms.fsdp`),
        so the chain before the optimizer is the identity."""
        check_names((name,), "none")
        self._fsdp = transforms.fsdp(self.axis, dimension=self.dims, key=key,
                                     weights=self.weights,
                                     gradients=GRADIENT_COMPRESSORS[name](),
                                     error_feedback=self.error_feedback, exchange=cfg.exchange)
        return Communication(optax.identity())

    def place(self, params):
        return transforms.shard_params(params, self.mesh, self.axis, self.dims)

    def param_specs(self):
        return transforms.shard_specs(self.dims, self.axis)

    def init(self, tx: optax.GradientTransformation, params):
        """``(fsdp state, optimizer state)``: per-device residuals, the
        optimizer's moments sharded like ``params``."""
        if self._fsdp is None:
            raise ValueError("call communication(name, cfg, key) first")
        return (transforms.init_sharded(self._fsdp, self.params, self.mesh, self.axis),
                transforms.init_on_shards(tx, params, self.mesh))

    def step(self, tx: optax.GradientTransformation, opt_state, *, replicated: bool = True):
        """``step(shards, (fsdp state, opt state), x, y) -> (shards, state,
        losses, finite)`` (`DataParallel.step`'s contract)."""
        fsdp, axis = self._fsdp, self.axis
        param_specs = self.param_specs()
        specs = (transforms.state_specs(opt_state[0], axis),
                 transforms.sharded_specs(opt_state[1]))

        def body(shards, state, x, y):
            fstate, tx_state = state
            (loss, grads), fstate = fsdp.value_and_grad(self.loss)(shards, fstate, x, y)
            updates, tx_state = tx.update(grads, tx_state, shards)
            shards = optax.apply_updates(shards, updates)
            bad = sum((~jnp.isfinite(v)).sum(dtype=jnp.int32) for v in jax.tree.leaves(shards))
            return shards, (fstate, tx_state), loss[None], lax.psum(bad, axis) == 0

        return jax.jit(jax.shard_map(body, mesh=self.mesh,
                                     in_specs=(param_specs, specs, P(axis), P(axis)),
                                     out_specs=(param_specs, specs, P(axis), P())))

    def full(self, params):
        """The whole parameters, replicated on every device (for evaluation)."""
        return on_every_device(params, self.mesh)

    def memory(self, params, opt_state) -> dict:
        """Bytes held by one device: parameters, optimizer state, residuals,
        and ``ideal``: the whole parameters and optimizer state over N."""
        total = sum(leaf.nbytes for leaf in jax.tree.leaves((params, opt_state[1])))
        return {"params": placed_bytes(params), "optimizer": placed_bytes(opt_state[1]),
                "error_feedback": placed_bytes(opt_state[0].residual),
                "ideal": total / self.num_devices}
