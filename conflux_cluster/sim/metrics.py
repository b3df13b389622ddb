"""Request-level SLO attainment (paper §8.1) and latency percentiles.

A request is SLO-compliant only if EVERY output token i (1-based) arrives by
``arrival + ttft_slo + (i − 1)·tbt_slo``. Unfinished requests are not compliant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from conflux_cluster.slo import SLO, next_token_overdue, token_deadlines_met


@dataclass
class RequestRecord:
    """What the simulator observed for one request."""

    request_id: str
    arrival: float
    prompt_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)  # emission time of each output token

    @property
    def finished(self) -> bool:
        return len(self.token_times) >= self.output_len

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    def tbts(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def meets(self, slo: SLO, eps: float = 1e-9) -> bool:
        """Per-token definition: every token by its deadline (+ ``eps``, float noise), and all
        tokens produced (an unfinished request is never compliant; one asked for no output
        token is vacuously compliant). The check is ``conflux_cluster.slo.token_deadlines_met``."""
        if not self.finished:
            return False
        if not self.token_times:  # output_len == 0: nothing to be late
            return True
        return token_deadlines_met(self.arrival, self.token_times, slo.ttft_s, slo.tbt_s, eps).met

    def late(self, slo: SLO, now: float, eps: float = 1e-9) -> bool:
        """Already certain to miss: a token missed its deadline, or the next one is overdue at ``now``.

        O(1) per call because the simulator asks often: only the latest token and the next one
        are checked (an earlier miss not seen by a call in time is still caught by ``meets``).
        Same deadline (``conflux_cluster.slo.token_deadline``) and ``eps`` as ``meets``.
        """
        k = len(self.token_times)
        if k and self.token_times[-1] > slo.deadline(self.arrival, k) + eps:
            return True
        return next_token_overdue(self.arrival, k, self.output_len, now, slo.ttft_s, slo.tbt_s, eps)


def attainment(records: list[RequestRecord], slo: SLO) -> float:
    """Fraction of requests that meet the SLO (per-token definition)."""
    if not records:
        return 1.0
    return sum(r.meets(slo) for r in records) / len(records)


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


@dataclass(frozen=True)
class Summary:
    """Attainment and latency percentiles of one run (seconds)."""

    requests: int
    finished: int
    attainment: float
    ttft: dict[str, float]
    tbt: dict[str, float]  # over all token gaps of all requests
    e2e: dict[str, float]


def summarize(records: list[RequestRecord], slo: SLO) -> Summary:
    done = [r for r in records if r.finished]
    return Summary(requests=len(records), finished=len(done), attainment=attainment(records, slo),
                   ttft=_pct([r.ttft for r in records if r.token_times]),
                   tbt=_pct([g for r in done for g in r.tbts()]),
                   e2e=_pct([r.token_times[-1] - r.arrival for r in done]))
