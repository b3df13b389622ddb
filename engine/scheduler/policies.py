"""Scheduling policies: a registry of name -> ``Policy`` (paper Alg. 1 lines 1-4, and the FCFS / SRPT
baselines). A policy is one object that declares what it needs; adding one is one ``register`` call
(in this file or any module imported before the scheduler is configured).

Each ``order`` returns an iterator; the scheduler consumes it only until the step's budget is
exhausted, so the lazy orders (SRPT, SJF backfill, the admitted EDF walk) never do more than they must.

    fcfs: arrival order; a request whose KV does not fit yet holds back the ones after it
    srpt: smallest remaining prefill m_i first, ties by arrival ("++" in the paper)
    (every policy: lower ``priority`` first, its own order within one priority: ``by_priority``)
    slo : Moore–Hodgson admitted set in EDF order, then the rejected ones in SJF order (m_i as admission
          counts it), a rejected one that waited ``max_wait`` going first and FCFS order while admission's
          predictions go wrong (deferred.py); the token budget from the latency estimator (waterfill,
          Alg. 2); may refuse at arrival (Alg. 4)
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from .admission import EDFQueue
from .deferred import bounded_slo_order
from .outcomes import AdmissionOutcomes
from .requests import SchedRequest


@dataclass(frozen=True)
class OrderInput:
    """What a policy may look at to order the waiting requests of one step."""

    waiting: Iterable[SchedRequest]  # in arrival order
    edf: EDFQueue  # the same requests by (TTFT deadline, arrival), with Moore–Hodgson admission
    budget: int  # B_0: this step's reference token budget per rank
    now: float
    tbt_slo: float  # τ
    max_wait: float = math.inf  # slo: seconds after arrival when a deferred request goes first (deferred.py)
    outcomes: AdmissionOutcomes | None = None  # slo: admission's predictions and the FCFS fallback (outcomes.py)
    wait_factor: float = math.inf  # slo: a deferred request goes first after this many times its FCFS wait
    overdue_share: float = 1.0  # slo: the share of a step's budget overdue deferred requests take first
    first_factor: float = math.inf  # slo: ... and after this many times their FCFS wait they go first outright


@dataclass(frozen=True)
class Policy:
    name: str
    order: Callable[[OrderInput], Iterator[SchedRequest]]
    uses_estimator: bool = False  # token_budget 'auto' means the estimator's waterfill (else fixed)
    in_order_kv: bool = False  # a request without room for its KV holds back the ones after it
    admission: bool = False  # can refuse at arrival (scheduler.reject_unattainable, Moore–Hodgson)
    description: str = ""


POLICIES: dict[str, Policy] = {}


def register(policy: Policy) -> Policy:
    if policy.name in POLICIES:
        raise ValueError(f"scheduling policy {policy.name!r} is already registered")
    POLICIES[policy.name] = policy
    return policy


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None


def by_priority(order: Iterator[SchedRequest], waiting: Iterable[SchedRequest]) -> Iterator[SchedRequest]:
    """``order`` with lower ``priority`` first (vLLM's rule), the policy's order kept within a priority: a
    tier per priority value. FCFS becomes vLLM's priority policy (priority, then arrival); the SLO policy
    runs its EDF / SJF order inside each tier. Lazy and free while every waiting request has the same
    priority (the usual case)."""
    if len({r.priority for r in waiting}) <= 1:
        return order
    return iter(sorted(order, key=lambda r: r.priority))  # stable: the policy's order within a tier


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
    work = list(edf.remaining)  # m_i as admission counted it (step tokens with a fitted profile)
    dropped = set(rejected)
    for i, r in enumerate(reqs):
        if i not in dropped:
            yield r
    heap = [(work[i], reqs[i].seq, i) for i in rejected]  # SJF backfill, lazy like sjf_order
    heapq.heapify(heap)
    while heap:
        yield reqs[heapq.heappop(heap)[2]]


register(Policy("slo", lambda x: bounded_slo_order(x.edf, x.waiting, x.budget, x.now, x.tbt_slo, x.max_wait,
                                                   x.outcomes, x.wait_factor, x.overdue_share, x.first_factor),
                  uses_estimator=True, admission=True,
                description="paper Alg. 1-4 (Moore-Hodgson admission, EDF then SJF backfill; deferred requests "
                            "take overdue_share of each step after deferred_wait_factor x their FCFS wait and go "
                            "first after deferred_first_factor x it; FCFS while admission mispredicts)"))
register(Policy("fcfs", lambda x: fcfs_order(x.waiting), in_order_kv=True, description="arrival order"))
register(Policy("srpt", lambda x: sjf_order(x.waiting),
                description="shortest remaining prefill first (the paper's '++')"))
