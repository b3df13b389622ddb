"""Cumulative latency tallies an instance reports in ``/v1/conflux/stats`` (step wall time, and the gap
between a request's consecutive token deltas as the instance emits them), so a benchmark can take the
difference of two snapshots and read the quantiles of one rate point: the server's side of a TBT
figure, to set beside what the client measured (a client gap of two steps with one step on the
server is delivery, not the engine).

Prometheus has the same data as histograms (``ray_conflux_iteration_latency_seconds``,
``ray_vllm_inter_token_latency_seconds``); these need no scrape."""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

# upper edges in ms of every bucket but the last (which is unbounded)
EDGES_MS: tuple[float, ...] = (5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 140, 160, 180, 200,
                               250, 300, 400, 500, 750, 1000, 2000, 5000)


class Tally:
    """Counts of observed durations in the buckets of ``EDGES_MS``."""

    def __init__(self) -> None:
        self.counts = [0] * (len(EDGES_MS) + 1)

    def add(self, seconds: float) -> None:
        self.counts[bisect_left(EDGES_MS, 1e3 * seconds)] += 1

    def snapshot(self) -> list[int]:
        return list(self.counts)


def window(before: Sequence[int] | None, after: Sequence[int]) -> list[int]:
    """The counts observed between two snapshots (``before`` None: since the start)."""
    if before is None:
        return list(after)
    if len(before) != len(after):
        raise ValueError(f"tally snapshots differ in length: {len(before)} vs {len(after)}")
    return [a - b for a, b in zip(after, before)]


def quantile_ms(counts: Sequence[int], q: float) -> float | None:
    """The upper edge (ms) of the bucket holding quantile ``q`` of ``counts``; inf for the last bucket,
    None when nothing was counted."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    total = sum(counts)
    if total <= 0:
        return None
    need, seen = q * total, 0
    for i, c in enumerate(counts):
        seen += c
        if c and seen >= need:
            return EDGES_MS[i] if i < len(EDGES_MS) else float("inf")
    return float("inf")


def over_ms(counts: Sequence[int], limit_ms: float) -> int:
    """How many counted durations lie in buckets entirely above ``limit_ms``."""
    start = bisect_left(EDGES_MS, limit_ms) + 1  # bucket i holds (EDGES[i-1], EDGES[i]]
    return sum(counts[start:])
