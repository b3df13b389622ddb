"""The ``slo`` policy's prefill order, with bounded waits for what admission defers.

Moore–Hodgson admission (``admission.py``, Alg. 4) splits the waiting requests into the admitted set
(served in EDF order) and the given-up ones (deferred: they will miss their TTFT deadline under the
surrogate). The paper backfills the deferred ones after every admitted request; under sustained
overload new admitted arrivals keep coming and a deferred request waits without bound (one H200,
2K/128 Poisson near the knee: TTFT p99 12.3 s against FCFS's 0.87 s). Here::

    1. first:    deferred requests past ``first_factor`` times their FCFS wait (or ``max_wait``), arrival order
    2. overdue:  the oldest deferred request past ``wait_factor`` times its FCFS wait, its chunk capped to
                 ``overdue_share`` of the step's budget (``SchedRequest.step_share``)
    3. admitted: EDF order (the paper)
    4. overdue:  the other deferred requests past ``wait_factor`` times their FCFS wait, arrival order
    5. deferred: the rest of the given-up ones, shortest step-token work first (the paper's SJF backfill)

A deferred request is overdue once it has waited ``wait_factor`` times what FCFS would have made it wait
(``FcfsClock``: a virtual FCFS clock over the prefill work that arrived before it, at the step budget of
the time), and at least its TTFT SLO: it then takes a share of every step while the admitted ones keep
the rest, and once it has waited ``first_factor`` times FCFS's wait (or ``max_wait`` seconds) it goes
first. Its wait is so bounded by a multiple of FCFS's plus the overdue ones ahead of it (served in
arrival order, as FCFS would), while at loads FCFS itself would keep short the admitted ones still go
first. Sending the overdue first outright from ``wait_factor`` on (share 1) makes the admitted ones that
could still make their deadlines miss them behind requests that already missed theirs (the simulated
figures: docs/scheduler.md). When admission's predictions have been going wrong (``outcomes.py``:
rolling accuracy below its threshold) the order is plain arrival order (FCFS) until they are right again;
admission still runs every step (the router's load stays the admitted work), and the predictions judged
meanwhile are those of the order served: whether each request's deadline holds behind every earlier
arrival, under the same surrogate. So the accuracy measures the latency model, not the order, and EDF order
comes back once the model predicts again.

Predictions: each pass records whether each waiting request was admitted (``AdmissionOutcomes`` judges
the latest verdict before its first token).
"""

from __future__ import annotations

import heapq
import math
from typing import Iterable, Iterator

from .admission import EDFQueue
from .outcomes import AdmissionOutcomes
from .requests import SchedRequest


def _overdue_at(req: SchedRequest, max_wait: float, wait_factor: float) -> float:
    """When deferred ``req`` goes before the admitted ones."""
    ttft = req.ttft_deadline - req.arrival
    return req.arrival + min(max_wait, max(ttft, wait_factor * (req.fcfs_due - req.arrival)))


class FcfsClock:
    """A virtual FCFS clock: when a first-come-first-served order would start each arrival's first token.

    ``V ← max(V, now) + m̃_i / (B_0 / τ)`` at each arrival (m̃_i its prefill work in step tokens, B_0 the
    latest step's reference budget: it shrinks as decodes take the step). ``fcfs_due`` = V after it."""

    def __init__(self) -> None:
        self.virtual = 0.0  # seconds (the scheduler's clock)

    def stamp(self, req: SchedRequest, work: int, b0: int, tau: float, now: float) -> None:
        self.virtual = max(self.virtual, now) + work * tau / max(b0, 1)
        req.fcfs_due = self.virtual


def _predict_in_order(order: list[SchedRequest], work: dict[str, int], edf: EDFQueue, b0: int, now: float,
                      tau: float, outcomes: AdmissionOutcomes) -> list[SchedRequest]:
    """Record, for ``order`` served as it stands, whether each request meets its TTFT deadline under the
    surrogate admission uses (b0 step tokens per τ from ``now``: met when the work up to and including it
    fits its K_i = ⌊(d_i − now)/τ⌋ iterations); returns ``order``."""
    total = 0
    for r in order:
        total += work[r.request_id] if r.request_id in work else edf.work(r)
        k = max(0.0, (r.ttft_deadline - now) // tau)
        outcomes.predict(r, total <= k * b0)
    return order


def bounded_slo_order(edf: EDFQueue, arrival: Iterable[SchedRequest], b0: int, now: float, tau: float,
                      max_wait: float, outcomes: AdmissionOutcomes | None,
                      wait_factor: float = math.inf, overdue_share: float = 1.0,
                      first_factor: float = math.inf) -> Iterator[SchedRequest]:
    """The waiting requests in the order above (lazy past the first groups). ``arrival``: the waiting
    requests in arrival order (the scheduler's ``waiting``); a deferred request takes up to ``overdue_share`` of
    the step's budget ahead of the admitted ones after ``wait_factor`` times its FCFS wait, and goes
    first outright after ``first_factor`` times it (at least ``wait_factor``) or ``max_wait`` seconds
    (inf, inf, inf: never, the paper's; share 1: outright from ``wait_factor`` on)."""
    reqs = list(edf.reqs)  # snapshot: the caller does not mutate the queue while iterating
    for r in reqs:  # no cap unless set below for this step (the FCFS fallback sets none)
        r.step_share = 1.0
    work = list(edf.remaining)  # m_i as admission counted it (step tokens with a fitted profile)
    # overdue (past their TTFT deadline, so admission gives them up anyway) ahead of the admitted ones:
    # admission counts its iterations on what they leave, so its verdicts hold for the order served
    overdue = sorted((i for i, r in enumerate(reqs) if now >= _overdue_at(r, max_wait, wait_factor)),
                     key=lambda i: reqs[i].seq)
    # the overdue that go first outright; the oldest of the others takes its share of the step ahead of the
    # admitted ones (its chunk capped: Scheduler._plan_chunk), the rest of them wait after the admitted
    first = overdue if overdue_share >= 1.0 else \
        [i for i in overdue if now >= _overdue_at(reqs[i], max_wait, max(first_factor, wait_factor))]
    going_first = set(first)
    shared = [i for i in overdue if i not in going_first]
    # admission counts from when the ones going first are done, on what the shared one leaves of each step
    ahead = sum(work[i] for i in first) * tau / max(b0, 1)
    rejected = edf.admission(round(b0 * (1.0 - overdue_share)) if shared else b0, now + ahead, tau)
    # the router's load counts admitted work only (Scheduler.queued_prefill_tokens): overdue work goes first too
    edf.given_up.difference_update(reqs[i].request_id for i in overdue)
    dropped = set(rejected) | set(overdue)
    if outcomes is not None and outcomes.fallback:
        # FCFS order is served now, so the predictions judged are that order's: Moore–Hodgson's verdicts
        # assume the admitted ones go first, an order not served while the fallback lasts
        yield from _predict_in_order(list(arrival), {r.request_id: w for r, w in zip(reqs, work)}, edf, b0, now,
                                     tau, outcomes)
        return
    if outcomes is not None:
        for i, r in enumerate(reqs):
            outcomes.predict(r, i not in dropped)
    for i in first:
        yield reqs[i]
    admitted = [i for i in range(len(reqs)) if i not in dropped]
    if shared:  # at least its share; more where the admitted ones leave the step part-empty
        spare = 1.0 - sum(work[i] for i in admitted) / max(b0, 1)
        reqs[shared[0]].step_share = max(overdue_share, spare)
        yield reqs[shared[0]]
    for i in admitted:
        yield reqs[i]
    for i in shared[1:]:
        yield reqs[i]
    heap = [(work[i], reqs[i].seq, i) for i in dropped.difference(overdue)]  # SJF backfill, lazy
    heapq.heapify(heap)
    while heap:
        yield reqs[heapq.heappop(heap)[2]]
