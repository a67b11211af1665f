"""Side-by-side timing: interleaved repetitions, medians.

Every repetition runs each call once, one after the other, so a slow moment
of a shared machine hits every column alike instead of one method's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

#: A timed call: the function and its positional arguments.
Call = tuple[Callable[..., Any], tuple[Any, ...]]


def time_once(fn: Callable[..., Any], *args: Any) -> float:
    """Seconds of one ``fn(*args)``, until its result is ready."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def interleaved_medians(calls: Mapping[str, Call], repeats: int) -> dict[str, float]:
    """Median seconds per call name, the calls interleaved in every repetition.

    Each call runs once untimed first (compilation, warm caches).
    """
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            samples[name].append(time_once(fn, *args))
    return {name: float(np.median(ts)) for name, ts in samples.items()}
