"""Timing work on a CUDA device: the median of CUDA-event-timed calls (device time, not host time), also
of calls replayed from one captured CUDA graph."""

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


def graph_timed(fn: Callable[[], object], calls: int, reps: int = 20) -> float:
    """Median seconds of one ``fn()`` when ``calls`` of them replay in one captured CUDA graph (as a
    decode step's layers do)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (allocator, autotuning)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_seconds(graph.replay, reps, warmup=3) / calls
