"""The global router's state: latest load per instance plus the work it has sent since. Pure Python.

Loads arrive late (an instance reports every few milliseconds), so between two reports a burst
would all go to the instance that looked idle. The router therefore counts what it has sent::

    inflight_i = sent_prompt_tokens_i − received_prompt_tokens_i   (the instance reports the latter)

and routes on ``InstanceLoad.with_inflight(inflight_i)``. Both counters are monotone totals, so
the difference is exact whatever order requests and reports arrive in. One ``RouterState`` must be
shared by every ingress replica (it lives in one router actor, see ``conflux_cluster.serve.app``):
that is what keeps routing correct with several ingress replicas.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

from .policies import InstanceLoad, Router, RoutingPolicy, make_policy


@dataclass(frozen=True)
class LoadReport:
    """One instance's report: its load and how many prompt tokens it has received in total."""

    instance: int  # index of the reporting instance
    load: InstanceLoad  # inflight_prefill_tokens is ignored here: the router knows its own
    received_prompt_tokens: int  # monotone total of prompt tokens admitted by the instance
    time: float = 0.0  # reporter's wall clock (seconds), for staleness only


@dataclass
class RouterStats:
    """Decisions so far, for tests and metrics."""

    counts: list[int]  # requests routed to each instance so far
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # last decisions, in order
    decision_seconds: float = 0.0  # summed time spent inside choose()
    max_decision_seconds: float = 0.0  # slowest single choose()


class RouterState:
    """Routes requests over ``num_instances`` instances with one policy."""

    def __init__(self, num_instances: int, policy: RoutingPolicy | str = RoutingPolicy.LOWEST_LOAD,
                 seed: int | None = None, capacity: float = 1.0) -> None:
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        self._policy: Router = make_policy(policy, seed)
        self._loads = [InstanceLoad(prefill_capacity=capacity) for _ in range(num_instances)]
        self._sent = [0] * num_instances  # prompt tokens sent to each instance (total)
        self._received = [0] * num_instances  # prompt tokens each instance says it received (total)
        self._effective = list(self._loads)  # cache of effective_loads(); entry i rebuilt when i changes
        self.stats = RouterStats(counts=[0] * num_instances)

    @property
    def num_instances(self) -> int:
        return len(self._loads)

    def effective_loads(self) -> list[InstanceLoad]:
        """Latest reported loads with the router's own in-flight work added."""
        return list(self._effective)

    def _refresh(self, i: int) -> None:
        inflight = max(0, self._sent[i] - self._received[i])
        self._effective[i] = replace(self._loads[i], inflight_prefill_tokens=inflight)

    def route(self, prompt_tokens: int) -> int:
        """Pick an instance for a request of ``prompt_tokens`` and count it as in flight there."""
        t0 = time.perf_counter()
        index = self._policy.choose(self._effective)
        dt = time.perf_counter() - t0
        self.stats.decision_seconds += dt
        self.stats.max_decision_seconds = max(self.stats.max_decision_seconds, dt)
        self._sent[index] += max(0, prompt_tokens)
        self._refresh(index)
        self.stats.counts[index] += 1
        self.stats.recent.append(index)
        return index

    def report(self, report: LoadReport) -> None:
        """Take an instance's load report (reports may arrive in any order; totals only grow)."""
        i = report.instance
        if not 0 <= i < self.num_instances:
            raise ValueError(f"load report from unknown instance {i} (have {self.num_instances})")
        self._loads[i] = report.load
        self._received[i] = max(self._received[i], report.received_prompt_tokens)
        self._refresh(i)
