"""Saving and resuming a training run with orbax.

Each run (one compressor) checkpoints into ``{checkpoint_dir}/{name}/step_<n>``:
the replicated parameters, the optimizer state (error-feedback residuals per
device, the rest replicated) and the step count ``n``, which is also the
position in the data order (`common.train.batches` is a function of the seed
and the step). `transforms.restore_sharded` restores onto the mesh and
refuses a checkpoint made for another number of devices, naming both.
"""

from __future__ import annotations

import pathlib
import re

import numpy as np

import transforms

_STEP_DIR = re.compile(r"step_(\d+)")


class Checkpoints:
    """The checkpoints of one run.

    Args:
      directory: the ``--checkpoint-dir`` folder.
      name: the compressor name (one sub-folder per run).
      axis_name: the mesh's data axis.
    """

    def __init__(self, directory: str, name: str, axis_name: str):
        import orbax.checkpoint as ocp

        self.root = pathlib.Path(directory).resolve() / name
        self.axis = axis_name
        self._ckpt = ocp.StandardCheckpointer()

    def save(self, step: int, tree) -> pathlib.Path:
        """Writes ``tree`` as the checkpoint of ``step`` (replacing one of that step)."""
        path = self.root / f"step_{step:08d}"
        self._ckpt.save(path, tree, force=True)
        self._ckpt.wait_until_finished()
        return path

    def latest_step(self) -> int | None:
        steps = [int(m.group(1)) for p in self.root.glob("step_*")
                 if (m := _STEP_DIR.fullmatch(p.name))]
        return max(steps) if steps else None

    def restore(self, step: int, target):
        """The checkpoint of ``step``, placed like ``target``."""
        return transforms.restore_sharded(self._ckpt, self.root / f"step_{step:08d}", target,
                                          self.axis)


def step_of(restored) -> int:
    """The step count stored with a checkpoint."""
    return int(np.asarray(restored["step"].addressable_data(0)))
