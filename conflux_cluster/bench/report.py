"""Summarise a benchmark run the way ``vllm bench serve`` does, plus goodput under SLOs.

Goodput is given two ways:
  * vLLM's: requests per second whose TTFT <= ttft_slo and TPOT <= tbt_slo;
  * the paper's (DESIGN §1): a request meets its SLO only if its i-th token arrived before
    ``arrival + TTFT_SLO + (i−1)·TBT_SLO`` for every i; ``slo_attainment`` is the fraction that did
    (goodput, the largest rate with attainment >= 95%, needs a rate sweep: see docs/serving.md).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from conflux_cluster.slo import token_deadlines_met

from .client import RequestResult


def nearest_rank(sorted_xs: list[float], q: float) -> float:
    """q-quantile (q in [0, 1]) of an ascending list by nearest rank (as vLLM's reports round)."""
    return sorted_xs[min(len(sorted_xs) - 1, int(round(q * (len(sorted_xs) - 1))))]


@dataclass(frozen=True)
class Stat:
    mean_ms: float
    median_ms: float
    p99_ms: float
    std_ms: float = 0.0  # population standard deviation (as vLLM's numpy std)

    @classmethod
    def of(cls, seconds: list[float]) -> "Stat":
        if not seconds:
            return cls(0.0, 0.0, 0.0)
        xs = sorted(seconds)
        return cls(1e3 * statistics.fmean(xs), 1e3 * statistics.median(xs), 1e3 * nearest_rank(xs, 0.99),
                   1e3 * statistics.pstdev(xs))


@dataclass(frozen=True)
class BenchReport:
    """Field names follow ``vllm bench serve --save-result``."""

    completed: int
    failed: int
    duration: float  # seconds
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    total_token_throughput: float  # tok/s
    ttft: Stat
    tpot: Stat
    itl: Stat
    e2el: Stat
    ttft_slo_s: float
    tbt_slo_s: float
    request_goodput: float  # req/s meeting TTFT and TPOT SLOs (vLLM's definition)
    slo_attainment: float  # fraction meeting every per-token deadline (paper's definition)
    errors: list[str]
    total_cached_tokens: int = 0  # prompt tokens the server's prefix cache served (usage.cached_tokens)

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        rows = [("Successful requests", self.completed), ("Failed requests", self.failed),
                ("Benchmark duration (s)", f"{self.duration:.2f}"),
                ("Total input tokens", self.total_input_tokens),
                ("Total generated tokens", self.total_output_tokens),
                ("Request throughput (req/s)", f"{self.request_throughput:.2f}"),
                ("Output token throughput (tok/s)", f"{self.output_throughput:.2f}"),
                ("Total token throughput (tok/s)", f"{self.total_token_throughput:.2f}")]
        for name, s in (("TTFT", self.ttft), ("TPOT", self.tpot), ("ITL", self.itl), ("E2EL", self.e2el)):
            rows += [(f"Mean {name} (ms)", f"{s.mean_ms:.2f}"), (f"Median {name} (ms)", f"{s.median_ms:.2f}"),
                     (f"P99 {name} (ms)", f"{s.p99_ms:.2f}")]
        rows += [(f"Request goodput (req/s) [TTFT<={self.ttft_slo_s * 1e3:.0f}ms, TPOT<={self.tbt_slo_s * 1e3:.0f}ms]",
                  f"{self.request_goodput:.2f}"),
                 ("SLO attainment, per-token deadlines (%)", f"{100 * self.slo_attainment:.1f}"),
                 ("Prefix cache hit rate, prompt tokens (%)",
                  f"{100 * self.total_cached_tokens / max(1, self.total_input_tokens):.1f}")]
        width = max(len(k) for k, _ in rows) + 2
        line = "=" * (width + 12)
        body = "\n".join(f"{k + ':':<{width}}{v:>10}" for k, v in rows)
        return f"{line}\n{'Serving Benchmark Result':^{width + 12}}\n{line}\n{body}\n{line}"


def meets_token_deadlines(r: RequestResult, ttft_slo: float, tbt_slo: float) -> bool:
    """Every output token i (1-based) arrived by arrival + TTFT_SLO + (i−1)·TBT_SLO.

    A chunk may carry several tokens (its ``token_ids``, or text held back by the detokenizer);
    the chunk's time then counts for each of its tokens, and tokens the usage total reports beyond
    those came with the last chunk (``RequestResult.token_times``). The check itself is
    ``conflux_cluster.slo.token_deadlines_met`` (exact, ``eps=0``); a request without any token
    does not meet it.
    """
    return token_deadlines_met(r.arrival_s, r.token_times, ttft_slo, tbt_slo).met


def summarize(results: list[RequestResult], duration: float, ttft_slo: float, tbt_slo: float) -> BenchReport:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    good = [r for r in ok if r.ttft <= ttft_slo and (r.tpot is None or r.tpot <= tbt_slo)]
    attained = [r for r in ok if meets_token_deadlines(r, ttft_slo, tbt_slo)]
    d = max(duration, 1e-9)
    return BenchReport(
        completed=len(ok), failed=len(results) - len(ok), duration=duration,
        total_input_tokens=in_tokens, total_output_tokens=out_tokens,
        request_throughput=len(ok) / d, output_throughput=out_tokens / d,
        total_token_throughput=(in_tokens + out_tokens) / d,
        ttft=Stat.of([r.ttft for r in ok]), tpot=Stat.of([r.tpot for r in ok if r.tpot is not None]),
        itl=Stat.of([x for r in ok for x in r.itls]), e2el=Stat.of([r.e2e for r in ok]),
        ttft_slo_s=ttft_slo, tbt_slo_s=tbt_slo, request_goodput=len(good) / d,
        slo_attainment=len(attained) / len(results) if results else 0.0,
        errors=sorted({r.error for r in results if r.error})[:5],
        total_cached_tokens=sum(r.cached_tokens for r in ok))


def vllm_result(report: BenchReport, results: list[RequestResult]) -> dict:
    """The flat keys of ``vllm bench serve --save-result`` (``mean_ttft_ms``, ``p99_itl_ms``, ...)
    and its per-request arrays (seconds; a failed request has TTFT 0 and no tokens). The
    per-request error strings are ``request_errors`` (this report's ``errors`` keeps its meaning:
    the distinct error messages)."""
    flat: dict = {}
    for name, s in (("ttft", report.ttft), ("tpot", report.tpot), ("itl", report.itl), ("e2el", report.e2el)):
        flat.update({f"mean_{name}_ms": s.mean_ms, f"median_{name}_ms": s.median_ms,
                     f"std_{name}_ms": s.std_ms, f"p99_{name}_ms": s.p99_ms})
    flat.update(
        input_lens=[r.input_len for r in results],
        output_lens=[r.output_tokens if r.ok else 0 for r in results],
        ttfts=[r.ttft if r.ok else 0.0 for r in results],
        itls=[r.itls if r.ok else [] for r in results],
        request_errors=[r.error or ("" if r.ok else "no finish_reason") for r in results])
    return flat
