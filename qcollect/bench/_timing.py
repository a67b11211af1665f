"""Side-by-side timing: interleaved repetitions, medians."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np


def time_once(fn: Callable, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def interleaved_medians(calls: dict[str, tuple[Callable, tuple]], repeats: int) -> dict[str, float]:
    """Median seconds per call name, the calls interleaved in every repetition.

    Each call runs once untimed first (compilation, warm caches).
    """
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    samples = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            samples[name].append(time_once(fn, *args))
    return {name: float(np.median(ts)) for name, ts in samples.items()}
