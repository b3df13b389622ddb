"""Timing work on a CUDA device: the median of CUDA-event-timed calls (device time, not host time)."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``repeats`` CUDA-event-timed calls, after ``warmup`` untimed ones
    (the first call of a shape loads kernels and grows the allocator)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)
