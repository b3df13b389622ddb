"""The ``slo`` policy's prefill order, with bounded waits for what admission defers.

Moore–Hodgson admission (``admission.py``, Alg. 4) splits the waiting requests into the admitted set
(served in EDF order) and the given-up ones (deferred: they will miss their TTFT deadline under the
surrogate). The paper backfills the deferred ones after every admitted request; under sustained
overload new admitted arrivals keep coming and a deferred request waits without bound (one H200,
2K/128 Poisson near the knee: TTFT p99 12.3 s against FCFS's 0.87 s). Here::

    1. overdue:  deferred requests that have waited >= max_wait, in arrival order
    2. admitted: EDF order (the paper)
    3. deferred: the rest of the given-up ones, shortest step-token work first (the paper's SJF backfill)

so a deferred request's wait is bounded by ``max_wait`` plus the overdue ones ahead of it (served in
arrival order, as FCFS would). When admission's predictions have been going wrong (``outcomes.py``:
rolling accuracy below its threshold) the order is plain arrival order (FCFS) until they are right again;
admission still runs every step, so its predictions keep being judged and the router's load stays the
admitted work.

Predictions: the first pass that sees a request records whether it was admitted (``AdmissionOutcomes``).
"""

from __future__ import annotations

import heapq
from typing import Iterable, Iterator

from .admission import EDFQueue
from .outcomes import AdmissionOutcomes
from .requests import SchedRequest


def bounded_slo_order(edf: EDFQueue, arrival: Iterable[SchedRequest], b0: int, now: float, tau: float,
                      max_wait: float, outcomes: AdmissionOutcomes | None) -> Iterator[SchedRequest]:
    """The waiting requests in the order above (lazy past the first two groups). ``arrival``: the waiting
    requests in arrival order (the scheduler's ``waiting``); ``max_wait``: seconds since arrival after
    which a deferred request goes before the admitted ones (inf: never, the paper's order)."""
    rejected = edf.admission(b0, now, tau)
    reqs = list(edf.reqs)  # snapshot: the caller does not mutate the queue while iterating
    work = list(edf.remaining)  # m_i as admission counted it (step tokens with a fitted profile)
    dropped = set(rejected)
    if outcomes is not None:
        for i, r in enumerate(reqs):
            if not outcomes.predicted(r.request_id):
                outcomes.predict(r, i not in dropped)
        if outcomes.fallback:
            yield from arrival
            return
    if not rejected:
        yield from reqs
        return
    overdue = sorted((i for i in rejected if now - reqs[i].arrival >= max_wait), key=lambda i: reqs[i].seq)
    for i in overdue:
        yield reqs[i]
    for i, r in enumerate(reqs):
        if i not in dropped:
            yield r
    served = set(overdue)
    heap = [(work[i], reqs[i].seq, i) for i in rejected if i not in served]  # SJF backfill, lazy
    heapq.heapify(heap)
    while heap:
        yield reqs[heapq.heappop(heap)[2]]
