"""TTFT-aware admission: Moore–Hodgson under a fixed-capacity surrogate (paper §6.4, Alg. 4, App. G).

Requests are taken in EDF order (by TTFT deadline d_i). Before d_i the instance can prefill at
most K_i = max(0, ⌊(d_i − t)/τ⌋·B_0) tokens (B_0: this step's reference budget, τ: TBT SLO, the
iteration length). Keeping a running total C of the admitted requests' remaining prefill m_i,
whenever C > K_i the admitted request with the largest m_i is dropped (max-heap). Because K_i is
nondecreasing in EDF order this maximizes the number of on-time requests under the surrogate
(Moore 1968). The scheduler then serves the admitted set in EDF order and backfills the dropped
ones in SJF order.

``EDFQueue`` keeps the pending requests sorted by deadline with their m_i and d_i in parallel
plain lists, updated incrementally, so that one admission pass is a single tight loop::

    reqs:      [r7,   r2,   r9,   ...]   sorted by (ttft_deadline, seq)
    deadline:  [0.91, 0.95, 1.20, ...]   d_i
    remaining: [6400, 310,  22000, ...]  m_i (updated when a chunk runs)
"""

from __future__ import annotations

import bisect
import heapq
from typing import Sequence

from .requests import SchedRequest


class DeadlineUnattainable(RuntimeError):
    """A request refused at arrival (``SchedulerConfig.reject_unattainable``): Moore–Hodgson admission over
    the queue with it drops it, so under the current load its first token cannot come within the TTFT SLO.
    Picklable (it crosses Ray to the HTTP ingress, which answers 503 ``slo_unattainable``)."""

    def __init__(self, request_id: str, ttft_slo_s: float, backlog_s: float) -> None:
        super().__init__(f"request {request_id}: its TTFT SLO of {ttft_slo_s:g} s cannot be met under the current "
                         f"load ({backlog_s:.1f} s of prefill queued)")
        self.request_id = request_id
        self.ttft_slo_s = ttft_slo_s  # the objective it would miss
        self.backlog_s = backlog_s  # seconds of prefill queued ahead at the reference budget (≈ when to retry)

    def __reduce__(self):
        return (DeadlineUnattainable, (self.request_id, self.ttft_slo_s, self.backlog_s))

_IDX_BITS = 24  # heap keys pack (m, index) into one int: −(m << 24 | index)


def moore_hodgson_indices(remaining: Sequence[int], deadlines: Sequence[float], b0: int, now: float,
                          tau: float) -> list[int]:
    """Indices (into the EDF-sorted inputs) of the requests Moore–Hodgson rejects, in drop order.

    O(R log R). Among equal m_i the later-deadline request is dropped first. Requests whose
    deadline is less than one iteration away (K_i = 0) are all rejected without heap work.
    """
    n = len(remaining)
    start = bisect.bisect_left(deadlines, now + tau)  # K_i = 0 before this index
    while start > 0 and (deadlines[start - 1] - now) // tau >= 1:  # float rounding at the edge
        start -= 1
    rejected = [i for i in range(start) if remaining[i] > 0]
    heap: list[int] = []
    push, pushpop = heapq.heappush, heapq.heappushpop
    total = 0
    for i in range(start, n):
        m = remaining[i]
        total += m
        key = -((m << _IDX_BITS) | i)
        if total > ((deadlines[i] - now) // tau) * b0:
            top = -pushpop(heap, key)  # the largest m among the admitted and i
            total -= top >> _IDX_BITS
            rejected.append(top & ((1 << _IDX_BITS) - 1))
        else:
            push(heap, key)
    return rejected


def moore_hodgson(edf: Sequence[SchedRequest], b0: int, now: float, tau: float
                  ) -> tuple[list[SchedRequest], list[SchedRequest]]:
    """(admitted in EDF order, rejected in drop order) for ``edf`` sorted by ``ttft_deadline``."""
    rej = moore_hodgson_indices([r.remaining_prefill for r in edf], [r.ttft_deadline for r in edf],
                                b0, now, tau)
    dropped = set(rej)
    return [r for i, r in enumerate(edf) if i not in dropped], [edf[i] for i in rej]


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


class EDFQueue:
    """Pending prefills sorted by (ttft_deadline, seq), with d_i and m_i as parallel lists."""

    def __init__(self) -> None:
        self.reqs: list[SchedRequest] = []
        self.deadline: list[float] = []
        self.remaining: list[int] = []

    def __len__(self) -> int:
        return len(self.reqs)

    def _index(self, req: SchedRequest) -> int:
        i = bisect.bisect_left(self.reqs, (req.ttft_deadline, req.seq), key=lambda r: (r.ttft_deadline, r.seq))
        if i >= len(self.reqs) or self.reqs[i] is not req:
            raise KeyError(f"request {req.request_id} not in the EDF queue")
        return i

    def add(self, req: SchedRequest) -> None:
        i = bisect.bisect_right(self.reqs, (req.ttft_deadline, req.seq), key=lambda r: (r.ttft_deadline, r.seq))
        self.reqs.insert(i, req)
        self.deadline.insert(i, req.ttft_deadline)
        self.remaining.insert(i, req.remaining_prefill)

    def remove(self, req: SchedRequest) -> None:
        i = self._index(req)
        del self.reqs[i], self.deadline[i], self.remaining[i]

    def refresh(self, req: SchedRequest) -> None:
        """Re-read m_i of ``req`` after its prefill progressed."""
        self.remaining[self._index(req)] = req.remaining_prefill

    def admission(self, b0: int, now: float, tau: float) -> list[int]:
        """Moore–Hodgson rejected indices for the current queue."""
        return moore_hodgson_indices(self.remaining, self.deadline, b0, now, tau)

    def rejects(self, req: SchedRequest, b0: int, now: float, tau: float) -> bool:
        """Whether Moore–Hodgson over the current queue (``req`` in it) drops ``req``."""
        i = self._index(req)
        return i in self.admission(b0, now, tau)
