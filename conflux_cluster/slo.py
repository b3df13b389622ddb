"""The per-token SLO check of the paper (§8): the one definition every part of ConfluxServe uses.

Output token i (1-based) of a request meets its deadline when it arrived by

    arrival + TTFT_SLO + (i − 1)·TBT_SLO

and a request is SLO-compliant when every token did. Three places judge requests this way, each
with its own edge semantics, which stay in the caller and are expressed by what it passes in:

  * ``conflux_cluster.metrics.judge_slo`` (Prometheus SLO counters): the token times as recorded,
    ``eps=0``; a request with no output token meets neither part.
  * ``conflux_cluster.sim.metrics.RequestRecord.meets`` / ``.late`` (simulator): ``eps=1e-9``
    against float noise, and an unfinished request is never compliant (checked by the caller).
  * ``conflux_cluster.bench.report.meets_token_deadlines`` (HTTP benchmark): tokens that arrived
    in one chunk are padded with that chunk's time by the caller before judging.

Before a request finishes, the simulator and the HTTP benchmark ask whether it is already certain to
miss (``RequestRecord.late``, ``RequestResult.late``); both use ``next_token_overdue`` for the token
still to come.

Pure Python, no imports beyond the standard library: the simulator and the benchmark client must
not need Ray or torch to use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class SLO:
    """The latency targets a request is judged against (paper §8): the one SLO value type of the
    metrics, the simulator and the benchmarks (the scheduler's own are ``SchedulerConfig.ttft_slo`` and
    ``tbt_slo``, flags of ``conflux serve``)."""

    ttft_s: float  # TTFT SLO, seconds
    tbt_s: float  # TBT SLO, seconds

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tbt_s > 0):
            raise ValueError(f"SLO: ttft_s and tbt_s must be > 0, got {self}")

    def deadline(self, arrival: float, i: int) -> float:
        """Deadline of the i-th output token (1-based): ``token_deadline``."""
        return token_deadline(arrival, i, self.ttft_s, self.tbt_s)


@dataclass(frozen=True)
class SLOJudgement:
    """Verdict on one request's token times."""

    ttft_met: bool  # token 1 arrived by arrival + TTFT_SLO (+ eps)
    tbt_met: bool  # every token i >= 2 arrived by arrival + TTFT_SLO + (i-1)·TBT_SLO (+ eps)
    met: bool  # both: the request is SLO-compliant


def token_deadline(arrival: float, i: int, ttft_s: float, tbt_s: float) -> float:
    """Deadline of output token ``i`` (1-based): ``arrival + ttft_s + (i-1)·tbt_s``."""
    if i < 1:
        raise ValueError(f"token_deadline: token index is 1-based, got i={i}")
    return arrival + ttft_s + (i - 1) * tbt_s


def next_token_overdue(arrival: float, produced: int, wanted: int, now: float, ttft_s: float,
                       tbt_s: float, eps: float = 0.0) -> bool:
    """Token ``produced + 1`` of the ``wanted`` ones is still to come and already past its deadline
    (+ ``eps``) at ``now``: the request can no longer meet the SLO."""
    return produced < wanted and now > token_deadline(arrival, produced + 1, ttft_s, tbt_s) + eps


def token_deadlines_met(arrival: float, token_times: Sequence[float], ttft_s: float,
                        tbt_s: float, eps: float = 0.0) -> SLOJudgement:
    """Judge one request. ``token_times[k]`` is when output token k+1 arrived (same clock as
    ``arrival``). Token i meets its deadline when ``t_i <= token_deadline(arrival, i) + eps``
    (a token exactly on its deadline meets it).

    No token at all meets neither part (callers that want another answer decide it first).
    ``tbt_met`` with a single token is vacuously True.
    """
    if eps < 0:
        raise ValueError(f"token_deadlines_met: eps must be >= 0, got {eps}")
    if ttft_s < 0 or tbt_s < 0:
        raise ValueError(f"token_deadlines_met: SLOs must be >= 0, got ttft_s={ttft_s}, "
                         f"tbt_s={tbt_s}")
    if not token_times:
        return SLOJudgement(False, False, False)
    ttft_met = token_times[0] <= token_deadline(arrival, 1, ttft_s, tbt_s) + eps
    tbt_met = all(t <= token_deadline(arrival, i, ttft_s, tbt_s) + eps
                  for i, t in enumerate(token_times[1:], start=2))
    return SLOJudgement(ttft_met, tbt_met, ttft_met and tbt_met)
