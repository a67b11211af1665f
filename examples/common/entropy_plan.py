"""Host-side plans for the entropy quantizer during training.

Oland & Raj's bit-width ``N = H + c`` and Huffman stream length depend on the
data, but a compiled step has static shapes. Unplanned payloads are sized for
the worst case (``ceiling`` bits per value), which sends ~10 bits per value
whatever Huffman achieves. So, as the design asks, the sizes are planned on
the host between steps and one compiled step is cached per plan:

1. every ``entropy_replan_every`` steps, one jitted program computes, for every
   compressed leaf, what `qcollect.EntropyCompressor.plan` asks for on each
   of the ``N`` chunks `qcollect.compressed_all_reduce` will encode: this
   device's ``gradient + residual`` (the pairwise reduce-scatter) and the sum
   over devices (the owner's re-encoding), then the maximum over devices;
2. the stream length gets a margin (x1.08, rounded up on a grid of 2^(1/16)
   steps so that small drifts reuse a compiled step) and the bit-width is the
   largest asked for;
3. a plan too small for some chunk makes that step's update non-finite
   (the payload's range is NaN, never a silently wrong value): the step is
   then discarded and rerun with a plan measured on that batch with the
   margin grown x1.25 (again on a further overflow), which then shrinks back
   by x1.25 per plan. (Doubling it, as before, kept the next few plans at up
   to twice the stream words the gradients needed:
   `examples/parity_diagnostics.py` shows it per layer and plan.)

Checkpoints keep the current plans and margin (`Planner.host_state`), so a
resumed run compiles the same step and continues bit-identically.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms
from common.compressors import entropy_transform
from common.devices import local_values

MARGIN = 1.08
GROWTH = 1.25
MAX_RETRIES = 6


def _fed_back(grads, feedback) -> list:
    """Per leaf of ``grads`` (flatten order), what error feedback adds to this
    device's gradient before it is encoded: the residual
    (`transforms.ResidualState`), or minus the estimate ``g_i``
    (`transforms.EF21State`: EF21 encodes the gradient's change);
    ``optax.MaskedNode()`` where nothing is added."""
    treedef = jax.tree.structure(grads)
    if isinstance(feedback, transforms.EF21State):
        return [r if isinstance(r, optax.MaskedNode) else -r
                for r in treedef.flatten_up_to(feedback.local_estimate)]
    return treedef.flatten_up_to(feedback.residual)


def _round_up(words: int, margin: float) -> int:
    if words <= 0:
        return 0
    return int(math.ceil(2 ** (math.ceil(16 * math.log2(words * margin)) / 16)))


class Planner:
    """Plans, compiles and caches the entropy training step of one run."""

    def __init__(self, dp, compressor: qc.EntropyCompressor, cfg, axis_name, key,
                 optimizer: optax.GradientTransformation):
        self.dp, self.c, self.cfg, self.axis, self.key = dp, compressor, cfg, axis_name, key
        self.optimizer = optimizer
        self.margin = MARGIN
        self.plans = None
        self._steps: dict = {}
        self._measure = None
        self._state = None

    def needs(self, params, opt_state, x, y):
        """Per compressed leaf (inside the mapped step): the largest bit-width
        asked for, and the stream words asked for by this batch's shares:
        the devices' own (the gradient with its error feedback, `_fed_back`;
        the reduce-scatter; mean and largest over devices and shares) and the
        owners' (the sums, which they re-encode; largest)."""
        _, grads = self.dp.grads(lax.pcast(params, self.axis, to="varying"), x, y)
        residuals = _fed_back(grads, opt_state[0].feedback)
        n = self.dp.num_devices
        chosen = transforms.leaf_compressors(grads, self.c, min_size=self.cfg.min_size)
        out = {}
        flat_grads = jax.tree_util.tree_leaves_with_path(grads)
        for (path, g), r, c in zip(flat_grads, residuals, chosen, strict=True):
            if c is None:
                continue
            v = g.astype(jnp.float32)
            if not isinstance(r, optax.MaskedNode):  # this device's block (1, *shape)
                v = v + r.reshape(g.shape)
            # Exactly the shares compressed_all_reduce will encode.
            (mine, valid), (total, _) = (qc.leaf_chunks(a, self.c, n)
                                         for a in (v, lax.psum(v, self.axis)))
            keys = jax.random.split(self.key, n)
            if valid is None:  # no padding inside any share
                own, owner = (jax.vmap(self.c.plan)(shares, keys) for shares in (mine, total))
            else:
                plan = lambda share, key, count: self.c.plan(share, key, valid=count)  # noqa: E731
                own, owner = (jax.vmap(plan)(shares, keys, valid) for shares in (mine, total))
            out[jax.tree_util.keystr(path)] = {
                "bits": lax.pmax(jnp.maximum(own.bits.max(), owner.bits.max()), self.axis),
                "own_mean": lax.pmean(own.words.mean(), self.axis),
                "own_max": lax.pmax(own.words.max(), self.axis),
                "owner_max": lax.pmax(owner.words.max(), self.axis)}
        return out

    def _needed(self, params, opt_state, x, y):
        """Per compressed leaf: (bits, words) asked for, maximum over shares and devices."""
        return {path: (need["bits"], jnp.maximum(need["own_max"], need["owner_max"]))
                for path, need in self.needs(params, opt_state, x, y).items()}

    @property
    def compiles(self) -> int:
        return len(self._steps)

    def _compiled(self, plans):
        key = tuple(sorted(plans.items()))
        if key not in self._steps:
            tx = optax.chain(entropy_transform(self.c, plans, self.cfg, self.axis, self.key),
                             self.optimizer)
            self._steps[key] = self.dp.step(tx, self._state)
        return self._steps[key]

    def step(self, params, opt_state, x, y, *, margin: float | None = None):
        """Measures the sizes this batch needs; the compiled step for them.

        ``margin``: this plan's (default: the current one, which shrinks back
        to ``MARGIN`` by ``GROWTH`` per plan after an overflow grew it).
        """
        if self._measure is None:
            self._state = opt_state
            self._measure = self.dp.shard_map(
                self._needed, transforms.state_specs(opt_state, self.axis), P())
        needed = jax.device_get(self._measure(params, opt_state, x, y))
        margin = self.margin if margin is None else margin
        plans = {path: qc.EntropyPlan(int(bits), _round_up(int(words), margin))
                 for path, (bits, words) in needed.items()}
        self.margin = max(MARGIN, margin / GROWTH)
        self.plans = plans
        return self._compiled(plans)

    def host_state(self) -> dict:
        """What a checkpoint keeps of the planner: the current plans and margin
        (JSON values; `resume` takes them back)."""
        return {"margin": self.margin,
                "plans": {path: [plan.bits, plan.words] for path, plan in self.plans.items()}}

    def resume(self, saved: dict, opt_state):
        """The compiled step for the plans of a checkpoint (`host_state`), so that
        a resumed run replans at the same steps, with the same margin, as a run
        never interrupted."""
        self._state = opt_state
        self.margin = saved["margin"]
        self.plans = {path: qc.EntropyPlan(int(bits), int(words))
                      for path, (bits, words) in saved["plans"].items()}
        return self._compiled(self.plans)

    def retry(self, params, opt_state, x, y):
        """After an overflow: grow the margin and rerun the step; (step, outputs)."""
        margin = self.margin
        for _ in range(MAX_RETRIES):
            margin *= GROWTH
            step = self.step(params, opt_state, x, y, margin=margin)
            out = jax.block_until_ready(step(params, opt_state, x, y))
            if local_values(out[3]).all():
                return step, out
        raise FloatingPointError("the entropy step stays non-finite with larger plans: "
                                 "the gradients themselves are not finite")
