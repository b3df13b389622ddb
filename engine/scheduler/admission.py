"""TTFT-aware admission: Moore–Hodgson under a fixed-capacity surrogate (paper §6.4, Alg. 4, App. G).

Requests are taken in EDF order (by TTFT deadline d_i). Before d_i the instance can prefill at
most K_i = max(0, ⌊(d_i − t)/τ⌋·B_0) tokens (B_0: this step's reference budget, τ: TBT SLO, the
iteration length). Keeping a running total C of the admitted requests' remaining prefill m_i,
whenever C > K_i the admitted request with the largest m_i is dropped (max-heap). Because K_i is
nondecreasing in EDF order this maximizes the number of on-time requests under the surrogate
(Moore 1968). The scheduler then serves the admitted set in EDF order and backfills the dropped
ones in SJF order.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from .requests import SchedRequest


def moore_hodgson(edf: Sequence[SchedRequest], b0: int, now: float, tau: float
                  ) -> tuple[list[SchedRequest], list[SchedRequest]]:
    """(admitted in EDF order, rejected) for ``edf`` already sorted by ``ttft_deadline``.

    O(R log R). Among equal m_i the later-deadline request is dropped first.
    """
    heap: list[tuple[int, int]] = []  # (−m_j, −index): max-heap on m, later deadline first
    rejected_idx: list[int] = []
    total = 0
    push, pop = heapq.heappush, heapq.heappop
    for idx, req in enumerate(edf):
        m = req.prompt_len - req.computed
        total += m
        push(heap, (-m, -idx))
        slots = (req.ttft_deadline - now) // tau
        if total > (slots * b0 if slots > 0 else 0):
            neg_m, neg_j = pop(heap)
            total += neg_m
            rejected_idx.append(-neg_j)
    if not rejected_idx:
        return list(edf), []
    dropped = set(rejected_idx)
    admitted = [r for i, r in enumerate(edf) if i not in dropped]
    return admitted, [edf[i] for i in rejected_idx]


def on_time_feasible(remaining: Sequence[int], deadlines: Sequence[float], b0: int, now: float,
                     tau: float) -> bool:
    """Whether all given requests meet their deadlines under the surrogate (EDF prefix check)."""
    total = 0
    for m, d in sorted(zip(remaining, deadlines), key=lambda x: x[1]):
        total += m
        slots = (d - now) // tau
        if total > (slots * b0 if slots > 0 else 0):
            return False
    return True
