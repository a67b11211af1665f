"""DiLoCo in the examples' training loop: one replica per device, an outer step every H.

`DiLoCoParallel` is a `common.replicas.ReplicaParallel` (each worker's
replica, stacked ``(N, ...)`` and sharded ``P("data")``) whose
transformation is `transforms.diloco`: the run's
optimizer is the inner optimizer, and the gradient all-reduce of the run's
compressor name (`common.compressors.communication`: ``none`` is the exact
float32 mean, ``qsgd-4`` four bits with error feedback, ...) averages the
outer gradients. Evaluation uses the replicas' mean, which at the end of a
round without fragments is the global model itself.

Bytes: only synchronising steps send; `round_bytes` measures what one round
sends (each fragment's all-reduce compiled alone) and a run's
``wire_bytes`` is that over H, the mean per step (`mean_bytes`, which adds
the exact all-reduces of ``diloco_sync_first`` synchronous steps first).
"""

from __future__ import annotations

import optax

import transforms
from common.compressors import Communication
from common.replicas import ReplicaParallel
from common.wire_split import part, update_bytes

#: What the outer gradients may go through: the all-reduces of one phase.
OUTER_COMPRESSORS = ("none", "bf16", "onebit", "qsgd-2", "qsgd-4", "qsgd-8", "threshold",
                     "adaptive")


class DiLoCoParallel(ReplicaParallel):
    """Replicas per device trained with `transforms.diloco` (module docstring).

    Args:
      model / mesh: as for `DataParallel` (one ``"data"`` axis).
      cfg: the run's config: ``diloco_every`` (H), ``fragments``,
        ``diloco_delay``, ``outer_lr`` and ``outer_momentum`` (Nesterov;
        0: plain SGD, SparseLoCo's).
    """

    def __init__(self, model, mesh, cfg):
        super().__init__(model, mesh)
        self.cfg = cfg

    def communication(self, name: str, cfg, key) -> Communication:
        """The outer gradients' all-reduce of ``name``; phased: inner steps send nothing."""
        if name not in OUTER_COMPRESSORS:
            raise ValueError(f"outer_compressor must be one of {', '.join(OUTER_COMPRESSORS)}, "
                             f"got {name!r}")
        return super().communication(name, cfg, key)._replace(phased=True)

    def outer(self) -> optax.GradientTransformation:
        momentum = self.cfg.outer_momentum
        return optax.sgd(self.cfg.outer_lr, momentum=momentum or None, nesterov=momentum > 0)

    def transformation(self, comm: Communication, optimizer) -> optax.GradientTransformation:
        return transforms.diloco(self.axis, inner=optimizer, every=self.cfg.diloco_every,
                                 outer=self.outer(), reduce=comm.tx,
                                 fragments=self.cfg.fragments, delay=self.cfg.diloco_delay,
                                 sync_first=self.cfg.diloco_sync_first)

    def mean_bytes(self, name: str, key, steps: int) -> int:
        """Bytes per device per step over a run of ``steps``: the
        ``diloco_sync_first`` synchronous steps (an exact all-reduce each),
        then a round's bytes every H steps."""
        warm = self.cfg.diloco_sync_first
        exact = self.replicated.communication("none", self.cfg, key)
        rounds = (steps - warm) / self.cfg.diloco_every
        total = (warm * update_bytes(self.replicated, exact.tx, self.params)
                 + rounds * self.round_bytes(name, key))
        return round(total / steps)

    def round_bytes(self, name: str, key) -> int:
        """Bytes per device of one round: each fragment's all-reduce of its
        leaves, compiled alone on a replicated-parameter `DataParallel`."""
        comm = self.replicated.communication(name, self.cfg, key)
        masks = transforms.fragment_masks(self.params, self.cfg.fragments)
        return sum(update_bytes(self.replicated, comm.tx, part(self.params, mask))
                   for mask in masks)
