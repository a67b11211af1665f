"""A step's wire bytes split between the leaves a compressor takes and the rest,
and between the phases of a phased all-reduce.

`qcollect.wire_bytes` measures a whole compiled training step. To split it,
the same all-reduce (`common.compressors.communication` of the same name
and settings) is compiled twice more, each time alone on one part of the
gradient tree, and measured the same way: the leaves it compresses
(`common.compressors.compressed_leaves`) and the others, which it averages
uncompressed (``lax.pmean``: LayerNorm scales, biases, leaves under
``cfg.min_size``). A collective never mixes the two parts (the all-reduces
fuse only leaves of one compressor), so they add up to the step's bytes.
Phased all-reduces (PowerSGD, GradiVeQ) are split in the phase `train`
reports, the cheapest.

The entropy quantizer's step is planned on the host per batch
(`common.entropy_plan`), which this compile does not see: its compressed
part is the step's bytes minus the measured uncompressed part.

`phase_bytes` gives each phase's bytes per step by name, as `train`
measured them on the compiled step (`qcollect.wire_bytes_by_phase` reads
the phase marks of the transformations' branches).
"""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms
from common.compressors import compressed_leaves


def part(tree, keep: list[bool]):
    """``tree`` with the leaves not kept (flatten order) replaced by None, an
    empty subtree; the kept leaves keep their paths.

    Example:
      >>> part({"a": 1, "b": 2}, [False, True])
      {'a': None, 'b': 2}
    """
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([leaf if k else None
                              for leaf, k in zip(leaves, keep, strict=True)])


def update_bytes(dp, tx, tree, branches: str = "max") -> int:
    """Bytes per device that ``tx.update`` sends for gradients shaped like
    ``tree`` on ``dp``'s mesh (compiled, never run; 0 for an empty tree).

    Args:
      dp: a `common.train.DataParallel` (its mesh, data axis and placement).
      tx: a gradient all-reduce, e.g. `Communication.tx`.
      tree: arrays shaped like the gradients.
      branches: ``"max"`` or ``"min"``, the phase of a conditional to count.
    """
    if not jax.tree.leaves(tree):
        return 0
    grads = dp.place(tree)
    state = dp.init(tx, grads)
    specs = transforms.state_specs(state, dp.axis)

    def body(g, s):
        return tx.update(lax.pcast(g, dp.axis, to="varying"), s)

    fn = dp.manual(body, (P(), specs), (P(), specs))
    return qc.wire_bytes(fn, grads, state, branches=branches)


def wire_split(dp, name: str, cfg, total: int) -> tuple[int, int]:
    """``(compressed, uncompressed)`` bytes per step and device of ``name``'s
    all-reduce on ``dp``'s parameters.

    Args:
      dp: a `common.train.DataParallel`.
      name: a compressor name (`common.compressors`).
      cfg: the run's `TrainConfig`.
      total: the step's measured bytes (`RunResult.wire_bytes`); used only for
        the entropy quantizer.
    """
    comm = dp.communication(name, cfg, jax.random.key(cfg.seed))
    if not comm.replicated:  # ``local`` reduces nothing: its measured step is all there is
        return 0, total
    keep = compressed_leaves(name, cfg, dp.params)
    branches = "min" if comm.phased else "max"
    uncompressed = update_bytes(dp, comm.tx, part(dp.params, [not k for k in keep]), branches)
    if comm.entropy is not None:
        return total - uncompressed, uncompressed
    return update_bytes(dp, comm.tx, part(dp.params, keep), branches), uncompressed


def phase_bytes(result) -> dict[str, int]:
    """Measured bytes per step and device of each phase of a run's all-reduce.

    ``RunResult.wire_bytes_by_phase``, by the names the transformation
    marks its phases with (`qcollect.wire_bytes_by_phase` of the compiled
    step): PowerSGD ``{"exact": ..., "compressed": ...}``, GradiVeQ
    ``{"lead-in": ..., "sampling": ..., "compressed": ...}``, and the other
    compressors ``{"exact": ..., "compressed": ...}`` with ``cfg.compress_after``;
    ``{"steady": ...}`` for an all-reduce of one phase. ``RunResult.phases``
    says which steps fall in which.

    Example:
      >>> from common.train import RunResult
      >>> r = RunResult("qsgd-4", [], [], [], 100, 100, 0.0, 0.0)
      >>> phase_bytes(r)
      {'steady': 100}
      >>> r.wire_bytes_by_phase = {"compressed": 100, "exact": 800}
      >>> phase_bytes(r)
      {'compressed': 100, 'exact': 800}
    """
    return dict(result.wire_bytes_by_phase) or {"steady": result.wire_bytes}
