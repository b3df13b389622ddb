"""Prefill priority orders per policy (paper Alg. 1 lines 1-4, and the FCFS / SRPT baselines).

Each returns an iterator; the scheduler consumes it only until the step's budget is exhausted,
so the lazy orders (SRPT, SJF backfill, the admitted EDF walk) never do more than they must.

    fcfs: arrival order
    srpt: smallest remaining prefill m_i first, ties by arrival ("++" in the paper)
    slo : Moore–Hodgson admitted set in EDF order, then the rejected ones in SJF order
"""

from __future__ import annotations

import heapq
from typing import Iterable, Iterator

from .admission import EDFQueue
from .requests import SchedRequest


def fcfs_order(arrival: Iterable[SchedRequest]) -> Iterator[SchedRequest]:
    return iter(arrival)


def sjf_order(reqs: Iterable[SchedRequest]) -> Iterator[SchedRequest]:
    """Shortest remaining prefill first, ties by arrival sequence; lazy (heap)."""
    heap = [(r.remaining_prefill, r.seq, r) for r in reqs]
    heapq.heapify(heap)
    while heap:
        yield heapq.heappop(heap)[2]


def slo_order(edf: EDFQueue, b0: int, now: float, tau: float) -> Iterator[SchedRequest]:
    rejected = edf.admission(b0, now, tau)
    reqs = list(edf.reqs)  # snapshot: the caller does not mutate the queue while iterating
    if not rejected:
        yield from reqs
        return
    dropped = set(rejected)
    for i, r in enumerate(reqs):
        if i not in dropped:
            yield r
    yield from sjf_order(reqs[i] for i in rejected)
