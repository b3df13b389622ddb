"""The global router as one Ray Serve deployment replica holding the one ``RouterState``.

Every ingress replica asks this replica (``admit``) and every XP instance reports to it
(``report``), so decisions made by different ingress replicas see each other's in-flight work:
that is how routing, and the per-instance queue bound, stay correct with several ingress replicas.
A refusal (every instance full) is a value, ``Overloaded``, not an exception across Ray. The
decision itself is pure Python over K small dataclasses (microseconds); the handle round trip
(~1 ms here) dominates, so a refusal reaches the client in one router call.

In cluster mode the router also runs the reconcile loop that decides which instance slots run
(``conflux_cluster/serve/elastic.py``): it is the one place that sees the live instances.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Mapping

from conflux_cluster.router.policies import RoutingPolicy, normalized_queued_workload
from conflux_cluster.router.prefix_aware import PrefixRouting
from conflux_cluster.router.queue_view import QueueView
from conflux_cluster.router.rate_limit import RateLimit
from conflux_cluster.router.state import RouterState
from conflux_cluster.engine.contracts.cluster import LoadReport, RouteDecision, Routed

log = logging.getLogger(__name__)


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
    unavailable: int = 0  # arrivals refused because no instance was healthy
    rate_limited: int = 0  # arrivals refused by a client's rate limit
    healthy: list[bool] | None = None  # per instance, as last reported


class GlobalRouter:
    """Serve deployment body: ``admit(prompt_tokens, num_requests, client) -> RouteDecision`` and
    ``report(LoadReport)``."""

    def __init__(self, num_instances: int, policy: str = RoutingPolicy.LOWEST_LOAD.value,
                 seed: int | None = 0, metrics: bool = True, max_queued_requests: int | None = None,
                 stale_after_s: float | None = None, instance_need: Mapping[str, float] | None = None,
                 rate_limit: RateLimit | None = None, prefix: PrefixRouting | None = None,
                 freeze_gc: bool = False) -> None:
        self.policy = RoutingPolicy(policy).value
        self.state = RouterState(num_instances, policy, seed, max_queued_requests=max_queued_requests,
                                 stale_after_s=stale_after_s, rate_limit=rate_limit, prefix=prefix)
        self._instance_need = instance_need  # set: cluster mode, run the slots' reconcile loop
        self._reconcile_task: asyncio.Task | None = None
        self._metrics = None
        if metrics:
            from conflux_cluster.metrics import RouterMetrics

            self._metrics = RouterMetrics(self.policy)
        if freeze_gc:  # the router decides every request: its start-up heap leaves full collections' walk
            from conflux_cluster.engine.util.gc_heap import freeze_heap

            freeze_heap()

    def admit(self, prompt_tokens: int, num_requests: int = 1, client: str | None = "",
              refused_by: int | None = None, prefix_hashes: tuple[int, ...] = ()) -> RouteDecision:
        before = self.state.stats.decision_seconds
        decision = self.state.admit(prompt_tokens, num_requests, client, refused_by, prefix_hashes)
        if self._metrics is not None and isinstance(decision, Routed):
            self._metrics.record_decision(f"xp-{decision.instance}", self.state.stats.decision_seconds - before)
        return decision

    async def check_health(self) -> None:
        """Serve's periodic health check; the first one (right after start) starts the reconcile loop."""
        if self._instance_need is not None and self._reconcile_task is None:
            self._reconcile_task = asyncio.create_task(self._reconcile(), name="router-reconcile")
        if self._reconcile_task is not None and self._reconcile_task.done():
            raise RuntimeError(f"the slots' reconcile loop ended: {self._reconcile_task.exception()!r}")

    async def _reconcile(self) -> None:
        """Every ``REFRESH_S``: plan the instance slots from the alive nodes and the live instances."""
        import ray
        from ray import serve

        from conflux_cluster.serve.elastic import REFRESH_S, Reconciler

        reconciler = Reconciler(serve.get_replica_context().app_name, self._instance_need, self.state.num_instances)
        while True:
            try:
                live = set(self.state.live_instances())
                nodes = await asyncio.to_thread(ray.nodes)
                wanted = await asyncio.to_thread(reconciler.step, nodes, live, time.monotonic())
                log.debug("slots wanted %s (live %s)", wanted, sorted(live))
            except Exception:  # noqa: BLE001 - GCS hiccup: keep the last plan, try again
                log.warning("reconciling the instance slots failed", exc_info=True)
            await asyncio.sleep(REFRESH_S)

    def queue_view(self) -> QueueView:
        """Room for new arrivals: what each ingress's gate refuses from (``serve/gate.py``)."""
        return self.state.queue_view()

    def drain(self) -> None:
        """Admit nothing from now on (the server shuts down, ``serve/drain.py``); requests already routed go on."""
        self.state.draining = True

    def live_instances(self) -> list[int]:
        """Instances up now (cluster mode: with fresh load reports); the ingress calls only these, since a
        call to a slot with no replica would make Serve start one (scale from zero) against its policy."""
        return self.state.live_instances()

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
                              [x.queued_requests for x in loads], self.state.max_queued_requests, s.refused,
                              s.unavailable, s.rate_limited, [x.healthy for x in loads])
