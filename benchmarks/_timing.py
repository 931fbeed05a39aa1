"""Timing helpers the benchmarks share (not a benchmark itself: `make bench` skips files starting with `_`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def added_seconds(off: Callable[[], object], on: Callable[[], object], repeats: int) -> float:
    """Median seconds `on` takes beyond `off`: the two called alternately `repeats` times each (so the machine's load
    falls on both alike), each call timed alone."""
    samples: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(repeats):
        for name, fn in (("off", off), ("on", on)):
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return statistics.median(samples["on"]) - statistics.median(samples["off"])
