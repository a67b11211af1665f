"""One replica of the parameters per device: the training loop of the
optimizers whose workers step apart (DiLoCo's inner steps, 0/1 Adam's local
steps).

`ReplicaParallel` is a `common.train.DataParallel` whose parameters are
stacked ``(N, ...)`` and sharded ``P("data")``, each device stepping its own
(`transforms.local_replica` inside the step). Evaluation uses the replicas'
mean, which right after a synchronisation is the one model itself.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import transforms
from common.train import DataParallel, all_finite, on_every_device


class ReplicaParallel(DataParallel):
    """Per-device replicas trained with a transformation that takes each
    device's own gradients at its own replica (`transforms.zero_one_adam`,
    `transforms.diloco`).

    Attributes:
      replicated: the same model and mesh with replicated parameters, to
        measure an all-reduce alone (`common.wire_split`).
    """

    def __init__(self, model, mesh):
        super().__init__(model, mesh)
        self.replicated = DataParallel(model, mesh)

    def place(self, params):
        """One replica per device: ``(N, ...)`` on ``P("data")``."""
        sharding = NamedSharding(self.mesh, P(self.axis))

        def place(leaf):
            host = np.asarray(leaf)  # every process passes the same values
            shape = (self.num_devices,) + host.shape
            return jax.make_array_from_callback(
                shape, sharding, lambda index: np.broadcast_to(host, shape)[index])

        return jax.tree.map(place, params)

    def init(self, tx: optax.GradientTransformation, params):
        return transforms.init_sharded(tx, self.params, self.mesh, self.axis)

    def step(self, tx: optax.GradientTransformation, opt_state, *, replicated: bool = True):
        """``step(replicas, state, x, y) -> (replicas, state, losses, finite)``,
        ``finite`` per device (each replica's own)."""
        specs = transforms.state_specs(opt_state, self.axis)
        axis = self.axis

        def body(replicas, state, x, y):
            params = transforms.local_replica(replicas, axis)
            loss, grads = self.grads(params, x, y)
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            return (jax.tree.map(lambda a: a[None], params), state, loss[None],
                    all_finite(params)[None])

        return self.manual(body, (P(axis), specs, P(axis), P(axis)),
                           (P(axis), specs, P(axis), P(axis)))

    def full(self, params):
        """The replicas' mean, replicated (for evaluation)."""
        return on_every_device(params, self.mesh, mean_of_replicas=True)
