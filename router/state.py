"""The global router's state: latest load per instance, the work it has sent since, and admission.

Loads arrive late (an instance reports every few milliseconds), so between two reports a burst
would all go to the instance that looked idle. The router therefore counts what it has sent,
requests and prompt tokens (``router.ledger.InflightLedger``)::

    inflight_i = sent_i − received_i   (the instance reports the latter as monotone totals)

and routes on the reported load with its in-flight work added. One ``RouterState`` must be shared
by every ingress replica (it lives in one router actor, see ``conflux_cluster.serve.app``): that is
what keeps routing, and the admission bound, correct with several ingress replicas.

Admission: a bounded queue per instance. With ``max_queued_requests = L`` instance i is *full* when

    queued_i = num_waiting_i        (reported: requests whose prefill is not finished)
             + inflight_requests_i  (routed here, not yet in a report)          >= L

The policy chooses among the instances that are not full; when every healthy instance is full,
``admit`` returns ``Overloaded`` (the ingress answers 503 with ``Retry-After``) instead of an
instance. In-flight requests count from the moment they are routed, so a burst between two reports
cannot overshoot L (one arrival of n choices may exceed it by n − 1). Finished and aborted requests
leave ``num_waiting`` in the instance's next report; decoding requests are not queued (the
scheduler bounds them: ``max_num_seqs``, KV).

``Retry-After`` is the prefill backlog of the least-backlogged healthy instance, ``w_i`` of
``normalized_queued_workload`` in seconds, rounded up and held within [1, 30] s (1 s while no
instance has reported: its prefill capacity is not known yet).

Two more refusals, checked first: ``RateLimited`` (HTTP 429) when the arrival's client (an API key)
has used up its rate (``router.rate_limit``, when a limit is set), and ``Unavailable`` (HTTP 503) when
no instance is healthy (every one lost a rank and is being rebuilt, ``actors/failover.py``), with the
shortest rebuild the instances announced as ``Retry-After``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from conflux_cluster.engine.contracts.cluster import (Draining, InstanceLoad, LoadReport, Overloaded, RateLimited,
                                                     RouteDecision, Routed, Unavailable)

from .ledger import InflightLedger
from .policies import Router, RouteRequest, RoutingPolicy, normalized_queued_workload
from .prefix_aware import PrefixRouting
from .queue_view import DrainRate, QueueView
from .rate_limit import KeyRateLimiter, RateLimit
from .registry import make_policy

MAX_RETRY_AFTER_S = 30  # longest Retry-After the server suggests (router refusals, failover, SLO refusals)


def clamp_retry_after(seconds: float) -> int:
    """Whole seconds for a ``Retry-After`` header: ``seconds`` rounded up, within [1, MAX_RETRY_AFTER_S]."""
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(seconds)))


class RouterOverloaded(RuntimeError):
    """Raised by ``RouterState.route`` (the caller has no way to answer a refusal)."""

    def __init__(self, decision: Overloaded) -> None:
        super().__init__(f"every instance is full ({decision.max_queued_requests} queued requests each)")
        self.decision = decision


@dataclass
class RouterStats:
    """Decisions so far, for tests and metrics."""

    counts: list[int]  # requests routed to each instance so far
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # last decisions, in order
    decision_seconds: float = 0.0  # summed time spent inside choose()
    max_decision_seconds: float = 0.0  # slowest single choose()
    refused: int = 0  # arrivals answered with Overloaded
    unavailable: int = 0  # arrivals answered with Unavailable
    rate_limited: int = 0  # arrivals answered with RateLimited


class RouterState:
    """Routes requests over ``num_instances`` instances with one policy and an optional queue bound."""

    def __init__(self, num_instances: int, policy: RoutingPolicy | str = RoutingPolicy.LOWEST_LOAD,
                 seed: int | None = None, capacity: float = 1.0, max_queued_requests: int | None = None,
                 lost_after_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 stale_after_s: float | None = None, rate_limit: RateLimit | None = None,
                 prefix: PrefixRouting | None = None) -> None:
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1 or None, got {max_queued_requests}")
        self._policy: Router = make_policy(policy, seed, prefix)
        self.max_queued_requests = max_queued_requests  # L per instance; None: no bound
        self._clock = clock
        self._loads = [InstanceLoad(prefill_capacity=capacity) for _ in range(num_instances)]
        self._ledgers = [InflightLedger(lost_after_s) for _ in range(num_instances)]
        self._effective = list(self._loads)  # cache of effective_loads(); entry i rebuilt when i changes
        self._available_in = [0] * num_instances  # announced by unhealthy instances (seconds)
        self._limiter = KeyRateLimiter(rate_limit, clock) if rate_limit is not None else None
        self.stats = RouterStats(counts=[0] * num_instances)
        # Instances that come and go (cluster mode): only those that reported within stale_after_s are
        # routed to; None: every instance is assumed up (local mode, fixed instances)
        self.stale_after_s = stale_after_s
        self._reported_at: list[float | None] = [None] * num_instances  # router clock of the last report
        self._drain_rate = DrainRate()  # requests leaving the queues per second (Retry-After)
        self.draining = False  # set once the server shuts down: every arrival is refused (serve/drain.py)

    @property
    def num_instances(self) -> int:
        return len(self._loads)

    def effective_loads(self) -> list[InstanceLoad]:
        """Latest reported loads with the router's own in-flight work added."""
        return list(self._effective)

    def _refresh(self, i: int) -> None:
        ledger = self._ledgers[i]
        self._effective[i] = replace(self._loads[i], inflight_prefill_tokens=ledger.tokens,
                                     inflight_requests=ledger.requests)

    def admit(self, prompt_tokens: int, num_requests: int = 1, client: str | None = "",
              refused_by: int | None = None, prefix_hashes: tuple[int, ...] = ()) -> RouteDecision:
        """Pick an instance for an arrival of ``num_requests`` requests (its choices) with
        ``prompt_tokens`` in all from ``client`` and count them as in flight there; or refuse (rate
        limit, no healthy instance, all full). ``client`` None: a request re-routed after instance
        ``refused_by`` refused it untouched (it lost a rank: unhealthy until its next report says
        otherwise), not charged to a rate limit again. ``prefix_hashes``: the prompt's prefix blocks
        (``prefix_aware`` reads them)."""
        if self.draining:
            self.stats.refused += 1
            return Draining()
        if refused_by is not None:
            self._loads[refused_by] = replace(self._loads[refused_by], healthy=False)
            self._refresh(refused_by)
        if client is None:
            client, limiter = "", None
        else:
            limiter = self._limiter
        if limiter is not None:
            wait = limiter.take(client)
            if wait:
                self.stats.rate_limited += 1
                return RateLimited(wait, limiter.limit.requests_per_minute)
        refusal = self._refusal()
        if not isinstance(refusal, list):
            if limiter is not None:
                limiter.give_back(client)
            return refusal
        candidates = refusal
        t0 = time.perf_counter()
        index = self._policy.choose(candidates, RouteRequest(prompt_tokens, tuple(prefix_hashes)))
        dt = time.perf_counter() - t0
        self.stats.decision_seconds += dt
        self.stats.max_decision_seconds = max(self.stats.max_decision_seconds, dt)
        self._ledgers[index].send(num_requests, prompt_tokens, self._clock())
        self._refresh(index)
        self.stats.counts[index] += 1
        self.stats.recent.append(index)
        return Routed(index)

    def _refusal(self) -> list[InstanceLoad] | Unavailable | Overloaded:
        """The loads to choose from, or why nothing can be chosen."""
        live = self._live()
        if not any(x.healthy for x in live):  # none healthy, or (cluster mode) none up yet
            self.stats.unavailable += 1
            soonest = min((a for a in self._available_in if a > 0), default=1)
            return Unavailable(clamp_retry_after(soonest))
        candidates = self._open_loads(live)
        if candidates is None:
            self.stats.refused += 1
            return self._overloaded(live)
        return candidates

    def route(self, prompt_tokens: int, num_requests: int = 1, prefix_hashes: tuple[int, ...] = ()) -> int:
        """``admit`` returning the instance index; raises ``RouterOverloaded`` on a refusal."""
        decision = self.admit(prompt_tokens, num_requests, prefix_hashes=prefix_hashes)
        if isinstance(decision, Overloaded):
            raise RouterOverloaded(decision)
        if not isinstance(decision, Routed):
            raise RuntimeError(f"no instance can take the request: {decision}")
        return decision.instance

    def _live(self) -> list[InstanceLoad]:
        """Effective loads, those without a fresh report offered as down (``healthy=False``) when
        instances come and go (``stale_after_s``)."""
        if self.stale_after_s is None:
            return self._effective
        now = self._clock()
        return [x if t is not None and now - t <= self.stale_after_s else replace(x, healthy=False)
                for x, t in zip(self._effective, self._reported_at)]

    def live_instances(self) -> list[int]:
        """Indices of the instances that are up: healthy and, with ``stale_after_s``, reporting."""
        return [i for i, x in enumerate(self._live()) if x.healthy]

    def _open_loads(self, live: list[InstanceLoad]) -> list[InstanceLoad] | None:
        """``live`` loads with full instances offered as not admitting (``healthy=False``); None when
        every live healthy instance is full (``_refusal`` checked that some instance is up)."""
        limit = self.max_queued_requests
        if limit is None:
            return live
        loads = [x if not x.healthy or x.queued_requests < limit else replace(x, healthy=False) for x in live]
        return loads if any(x.healthy for x in loads) else None

    def _retry_after(self, live: list[InstanceLoad]) -> int:
        """How long a refused client should wait: the healthy instances' queued requests over the measured
        drain rate (``router/queue_view.py``); before any request has left a queue, the prefill backlog of
        the least-backlogged instance that has reported."""
        rate = self._drain_rate.rate(self._clock())
        if rate:
            return clamp_retry_after(sum(x.queued_requests for x in live if x.healthy) / rate)
        # an instance that has not reported yet has no prefill capacity to divide by (a placeholder)
        waits = [normalized_queued_workload(x) for x, ledger in zip(live, self._ledgers)
                 if x.healthy and ledger.incarnation is not None]
        return clamp_retry_after(min(waits, default=0.0))

    def queue_view(self) -> QueueView:
        """Room left for new arrivals, for the ingress's gate (``router/queue_view.py``)."""
        live = self._live()
        healthy = [x for x in live if x.healthy]
        limit = self.max_queued_requests
        free = None if limit is None else sum(max(0, limit - x.queued_requests) for x in healthy)
        if not healthy:
            retry = clamp_retry_after(min((a for a in self._available_in if a > 0), default=1))
        else:
            retry = self._retry_after(live)
        return QueueView(free, sum(x.queued_requests for x in healthy), retry, any_healthy=bool(healthy),
                         draining=self.draining, drain_rate_rps=self._drain_rate.rate(self._clock()))

    def _overloaded(self, live: list[InstanceLoad]) -> Overloaded:
        return Overloaded(retry_after_s=self._retry_after(live),
                          max_queued_requests=self.max_queued_requests or 0,
                          queued_requests=tuple(x.queued_requests for x in self._effective))

    def report(self, report: LoadReport) -> None:
        """Take an instance's load report (reports may arrive in any order; totals only grow)."""
        i = report.instance
        if not 0 <= i < self.num_instances:
            raise ValueError(f"load report from unknown instance {i} (have {self.num_instances})")
        self._loads[i] = report.load
        self._reported_at[i] = self._clock()
        self._available_in[i] = report.available_in_s if not report.load.healthy else 0
        self._ledgers[i].receive(report.received_requests, report.received_prompt_tokens, report.incarnation,
                                 self._clock())
        self._drain_rate.observe(i, report.incarnation, report.received_requests, report.load.num_waiting,
                                 self._clock())
        self._refresh(i)
