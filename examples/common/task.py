"""What the training loop (`common.train.train`) needs of a data set: a `Task`.

A task gives the global batches of every step and the evaluation recorded
during a run. Two exist: `Classification` (MNIST: shuffled image batches,
test accuracy) and `common.text.NextBytes` (random text windows, validation
bits per byte). Batch ``i`` of a task depends only on the seed and ``i``, so
a run resumed from a checkpoint at step ``i`` sees the same data as one never
interrupted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from common.train import DataParallel


class Task(Protocol):
    """A data set for `common.train.train`.

    Attributes:
      metric: the evaluation's label in the progress bar (``acc``, ``bpb``).
      train_size: training examples; an epoch is ``train_size // global batch``
        steps (a run's length when ``cfg.steps`` is 0, the default checkpoint
        interval).
    """

    metric: str
    train_size: int

    def batches(self, global_batch: int, steps: int, seed: int,
                start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Global batches ``(inputs, targets)`` ``start .. steps - 1``."""
        ...

    def evaluate(self, dp: DataParallel, params) -> float:
        """The evaluation `train` records every ``cfg.eval_every`` steps."""
        ...


def batches(data, global_batch: int, steps: int, seed: int, start: int = 0):
    """Global batches ``start .. steps - 1``: one permutation per epoch, remainder
    dropped; batch ``i`` is the same whatever ``start`` is (for resuming)."""
    n = len(data.x_train)
    if global_batch > n:
        raise ValueError(f"the global batch ({global_batch}) is larger than the training set ({n})")
    rng = np.random.default_rng(seed)
    per_epoch = n // global_batch
    order = None
    for i in range(steps):
        if i % per_epoch == 0:
            order = rng.permutation(n)
        if i < start:
            continue
        rows = order[(i % per_epoch) * global_batch:(i % per_epoch + 1) * global_batch]
        yield data.x_train[rows], data.y_train[rows]


@dataclasses.dataclass(frozen=True)
class Classification:
    """An `MNIST` as a `Task`: shuffled image batches (`batches`), test accuracy.

    Example:
      >>> from common.mnist import load_mnist
      >>> task = Classification(load_mnist())                   # doctest: +SKIP
      >>> task.train_size, task.metric                          # doctest: +SKIP
      (60000, 'acc')
    """

    data: object
    metric: str = "acc"

    @property
    def train_size(self) -> int:
        return len(self.data.x_train)

    def batches(self, global_batch: int, steps: int, seed: int, start: int = 0):
        return batches(self.data, global_batch, steps, seed, start)

    def evaluate(self, dp: DataParallel, params) -> float:
        return dp.accuracy(params, self.data.x_test, self.data.y_test)


def as_task(data) -> Task:
    """``data`` itself when it is a `Task`, else an `MNIST` as a `Classification`."""
    return data if hasattr(data, "evaluate") else Classification(data)
