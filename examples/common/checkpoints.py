"""Saving and resuming a training run with orbax.

Each run (one compressor) checkpoints into ``{checkpoint_dir}/{name}/step_<n>``:
the replicated parameters, the optimizer state (error-feedback residuals per
device, the rest replicated) and the step count ``n``, which is also the
position in the data order (`common.task.Task.batches` is a function of the seed
and the step). Host-side state that shapes the compiled step (the entropy
quantizer's current plans and margin) goes beside it as JSON,
``step_<n>.json``, written before the arrays so that every complete
checkpoint has it. `transforms.restore_sharded` restores onto the mesh and
refuses a checkpoint made for another number of devices, naming both.
"""

from __future__ import annotations

import json
import pathlib
import re

import jax
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

    def path(self, step: int) -> pathlib.Path:
        return self.root / f"step_{step:08d}"

    def save(self, step: int, tree, host_state: dict | None = None) -> pathlib.Path:
        """Writes ``tree`` (and ``host_state``, JSON) as the checkpoint of ``step``,
        replacing one of that step. Every process calls it (orbax writes each
        process's shards); process 0 writes the JSON."""
        path = self.path(step)
        side = path.with_suffix(".json")
        if jax.process_index() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if host_state is None:
                side.unlink(missing_ok=True)
            else:
                side.write_text(json.dumps(host_state, sort_keys=True) + "\n")
        self._ckpt.save(path, tree, force=True)
        self._ckpt.wait_until_finished()
        return path

    def latest_step(self) -> int | None:
        """The last complete checkpoint's step (orbax renames a checkpoint into
        ``step_<n>`` only once it is written), or None."""
        steps = [int(m.group(1)) for p in self.root.glob("step_*")
                 if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
        return max(steps) if steps else None

    def restore(self, step: int, target):
        """The checkpoint of ``step``, placed like ``target`` (shapes, dtypes,
        shardings); ValueError if it was made for another device count."""
        return transforms.restore_sharded(self._ckpt, self.path(step), target, self.axis)

    def host_state(self, step: int) -> dict | None:
        """The JSON saved with ``step``'s checkpoint, or None."""
        side = self.path(step).with_suffix(".json")
        return json.loads(side.read_text()) if side.exists() else None


def step_of(restored) -> int:
    """The step count stored with a checkpoint."""
    return int(np.asarray(restored["step"].addressable_data(0)))
