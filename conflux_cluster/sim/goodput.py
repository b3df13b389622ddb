"""Goodput: the highest request rate with ≥ 95% SLO attainment (paper §8.1), found by search.

``attainment_at(rate)`` scales the workload's inter-arrival gaps to ``rate`` and simulates it
(stopping early once the target is out of reach: a lower attainment than the target is all the
search needs to know). ``goodput`` brackets the threshold geometrically, then bisects; the
answer is the highest rate seen to pass, and every evaluated point is kept for the plots.
Deterministic: the simulator has no randomness, workload generators take a seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from conflux_cluster.slo import SLO

from .core import Recorder, SimInstance, Simulation
from .metrics import Summary, summarize
from .workloads import Workload, scale_to_rate

TARGET = 0.95
RUN_HORIZON_S = 120.0  # s a run may simulate past its last arrival before the rest count as unfinished


@dataclass(frozen=True)
class RatePoint:
    rate: float  # req/s
    attainment: float  # exact when not stopped early; an upper bound < target otherwise
    stopped_early: bool
    summary: Summary | None = None  # latency percentiles of this run


@dataclass
class GoodputResult:
    label: str
    goodput: float  # highest passing rate (0.0 when even the lowest rate failed)
    points: list[RatePoint] = field(default_factory=list)

    def curve(self) -> list[RatePoint]:
        return sorted(self.points, key=lambda p: p.rate)

    def at_goodput(self) -> Summary | None:
        """Percentiles of the run at the goodput rate (a passing run is never stopped early)."""
        best = [p for p in self.points if p.rate == self.goodput]
        return best[0].summary if best else None


def run_at_rate(factory: Callable[[Recorder], SimInstance], workload: Workload, slo: SLO, rate: float,
                stop_below: float | None = None, num_instances: int = 1, router=None,
                horizon: float = RUN_HORIZON_S) -> tuple[Summary, bool]:
    """Simulate ``workload`` scaled to ``rate``; returns its summary and whether it stopped early."""
    sim = Simulation(factory, scale_to_rate(workload, rate), slo, num_instances, router)
    res = sim.run(stop_below=stop_below, horizon=horizon)
    return summarize(res.records, slo), res.stopped_early


def search_threshold(passes: Callable[[float], bool], start: float, rel_tol: float = 0.04,
                     lo_limit: float = 0.05, hi_limit: float = 1e4) -> float:
    """Highest rate seen to pass: bracket by ×1.5 steps from ``start``, then bisect (geometrically)
    until the bracket is within ``rel_tol``. 0.0 when nothing down to ``lo_limit`` passes."""
    lo = hi = None
    rate = start
    while lo is None or hi is None:
        if passes(rate):
            lo = rate
            if hi is None:
                rate *= 1.5
                if rate > hi_limit:
                    return lo
        else:
            hi = rate
            if lo is None:
                rate /= 1.5
                if rate < lo_limit:
                    return 0.0
    while hi / lo - 1 > rel_tol:
        mid = (lo * hi) ** 0.5
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo


def goodput(factory: Callable[[Recorder], SimInstance], workload: Workload, slo: SLO, start: float,
            label: str = "", target: float = TARGET, rel_tol: float = 0.04, num_instances: int = 1,
            router_factory=None) -> GoodputResult:
    """Search the highest rate with attainment ≥ ``target`` (to within ``rel_tol``, relative)."""
    result = GoodputResult(label, 0.0)

    def passes(rate: float) -> bool:
        router = router_factory() if router_factory else None
        summ, early = run_at_rate(factory, workload, slo, rate, target, num_instances, router)
        result.points.append(RatePoint(rate, summ.attainment, early, summ))
        return summ.attainment >= target

    result.goodput = search_threshold(passes, start, rel_tol)
    return result
