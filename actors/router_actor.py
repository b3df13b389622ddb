"""The global router as one Ray Serve deployment replica holding the one ``RouterState``.

Every ingress replica asks this replica (``admit``) and every XP instance reports to it
(``report``), so decisions made by different ingress replicas see each other's in-flight work:
that is how routing, and the per-instance queue bound, stay correct with several ingress replicas.
A refusal (every instance full) is a value, ``Overloaded``, not an exception across Ray. The
decision itself is pure Python over K small dataclasses (microseconds); the handle round trip
(~1 ms here) dominates, so a refusal reaches the client in one router call.
"""

from __future__ import annotations

from dataclasses import dataclass

from conflux_cluster.router.policies import RoutingPolicy, normalized_queued_workload
from conflux_cluster.router.prefix_aware import PrefixRouting
from conflux_cluster.router.state import LoadReport, Overloaded, RouteDecision, RouterState


@dataclass(frozen=True)
class RouterSnapshot:
    """What the router has decided so far (for tests, ``/v1/conflux/stats`` and reports)."""

    policy: str
    counts: list[int]  # requests routed to each instance
    recent: list[int]  # last decisions, oldest first
    mean_decision_us: float  # mean time inside the policy's choose()
    max_decision_us: float
    normalized_loads: list[float]  # w_i the router sees now (reported + in flight)
    queued_requests: list[int]  # queued_i the router sees now (reported waiting + in flight)
    max_queued_requests: int | None  # the admission bound per instance (None: none)
    refused: int  # arrivals refused because every instance was full


class GlobalRouter:
    """Serve deployment body: ``admit(prompt_tokens, num_requests) -> Routed | Overloaded`` and
    ``report(LoadReport)``."""

    def __init__(self, num_instances: int, policy: str = RoutingPolicy.LOWEST_LOAD.value,
                 seed: int | None = 0, metrics: bool = True, max_queued_requests: int | None = None,
                 prefix: PrefixRouting | None = None) -> None:
        self.policy = RoutingPolicy(policy).value
        self.state = RouterState(num_instances, policy, seed, max_queued_requests=max_queued_requests, prefix=prefix)
        self._metrics = None
        if metrics:
            from conflux_cluster.metrics import RouterMetrics

            self._metrics = RouterMetrics(self.policy)

    def admit(self, prompt_tokens: int, num_requests: int = 1, prefix_hashes: tuple[int, ...] = ()) -> RouteDecision:
        before = self.state.stats.decision_seconds
        decision = self.state.admit(prompt_tokens, num_requests, prefix_hashes)
        if self._metrics is not None and not isinstance(decision, Overloaded):
            self._metrics.record_decision(f"xp-{decision.instance}", self.state.stats.decision_seconds - before)
        return decision

    def report(self, report: LoadReport) -> None:
        self.state.report(report)
        if self._metrics is not None:
            loads = self.state.effective_loads()
            self._metrics.record_loads({f"xp-{i}": normalized_queued_workload(x) for i, x in enumerate(loads)})

    def snapshot(self) -> RouterSnapshot:
        s = self.state.stats
        n = max(1, sum(s.counts))
        loads = self.state.effective_loads()
        return RouterSnapshot(self.policy, list(s.counts), list(s.recent), 1e6 * s.decision_seconds / n,
                              1e6 * s.max_decision_seconds, [normalized_queued_workload(x) for x in loads],
                              [x.queued_requests for x in loads], self.state.max_queued_requests, s.refused)
