"""Summarise a benchmark run the way ``vllm bench serve`` does, plus goodput under SLOs.

Goodput is given two ways:
  * vLLM's (``--goodput ttft:MS tpot:MS e2el:MS``): requests per second whose every named metric
    is within its bound;
  * the paper's (DESIGN §1), an extra: a request meets its SLO only if its i-th token arrived before
    ``arrival + TTFT_SLO + (i−1)·TBT_SLO`` for every i; ``slo_attainment`` is the fraction that did
    (goodput, the largest rate with attainment >= 95%, needs a rate sweep: see docs/serving.md).

Percentiles are numpy's default (linear interpolation between order statistics), which is what
``vllm bench serve`` reports; the standard deviation is the population one (numpy's ``std``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from conflux_cluster.slo import token_deadlines_met

from .client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's metric names, in its report order
DEFAULT_PERCENTILES = (99.0,)  # vLLM's --metric-percentiles default


def nearest_rank(sorted_xs: list[float], q: float) -> float:
    """q-quantile (q in [0, 1]) of an ascending list by nearest rank (benchmarks/overload.py)."""
    return sorted_xs[min(len(sorted_xs) - 1, int(round(q * (len(sorted_xs) - 1))))]


def percentile(sorted_xs: list[float], p: float) -> float:
    """The p-th percentile (p in [0, 100]) of an ascending list, as ``numpy.percentile`` (linear)."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    pos = (len(sorted_xs) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def percentile_key(p: float) -> str:
    """vLLM's key word for a percentile: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


@dataclass(frozen=True)
class Stat:
    """One metric over a run, in milliseconds (all 0 when nothing was measured, as vLLM writes it)."""

    mean_ms: float
    median_ms: float
    std_ms: float  # population standard deviation (numpy's std)
    percentiles_ms: dict[str, float] = field(default_factory=dict)  # "p99" -> ms

    @property
    def p99_ms(self) -> float:
        return self.percentiles_ms["p99"]

    @classmethod
    def of(cls, seconds: list[float], percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> "Stat":
        if not seconds:
            return cls(0.0, 0.0, 0.0, {percentile_key(p): 0.0 for p in percentiles})
        xs = sorted(seconds)
        return cls(1e3 * statistics.fmean(xs), 1e3 * statistics.median(xs), 1e3 * statistics.pstdev(xs),
                   {percentile_key(p): 1e3 * percentile(xs, p) for p in percentiles})


@dataclass(frozen=True)
class GoodputSLO:
    """vLLM's ``--goodput`` bounds in seconds (None: that metric is not checked)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2el_s: float | None = None

    @classmethod
    def parse(cls, items: list[str]) -> "GoodputSLO":
        """``["ttft:500", "tpot:50"]`` (milliseconds, vLLM's syntax) -> bounds in seconds."""
        bounds: dict[str, float] = {}
        for item in items:
            name, sep, value = item.partition(":")
            if not sep or name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--goodput {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
            try:
                ms = float(value)
            except ValueError:
                ms = -1.0
            if not ms >= 0:
                raise ValueError(f"--goodput {item!r}: the bound must be a number of milliseconds >= 0")
            bounds[f"{name}_s"] = ms / 1e3
        return cls(**bounds)

    def met(self, r: RequestResult) -> bool:
        return ((self.ttft_s is None or r.ttft <= self.ttft_s)
                and (self.tpot_s is None or r.tpot is None or r.tpot <= self.tpot_s)
                and (self.e2el_s is None or r.e2e <= self.e2el_s))

    def label(self) -> str:
        parts = [f"{n.upper()}<={1e3 * v:g}ms" for n, v in (("ttft", self.ttft_s), ("tpot", self.tpot_s),
                                                            ("e2el", self.e2el_s)) if v is not None]
        return ", ".join(parts) or "no bound"


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
    ttft_slo_s: float  # per-token deadlines: first token
    tbt_slo_s: float  # per-token deadlines: each later token
    goodput_slo: GoodputSLO  # bounds of request_goodput
    request_goodput: float  # req/s meeting every goodput bound (vLLM's definition)
    slo_attainment: float  # fraction meeting every per-token deadline (paper's definition)
    errors: list[str]  # the distinct error messages (at most 5)
    total_cached_tokens: int = 0  # prompt tokens the server's prefix cache served (usage.cached_tokens)

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        rows = [("Successful requests", self.completed), ("Failed requests", self.failed),
                ("Benchmark duration (s)", f"{self.duration:.2f}"),
                ("Total input tokens", self.total_input_tokens),
                ("Total generated tokens", self.total_output_tokens),
                ("Request throughput (req/s)", f"{self.request_throughput:.2f}"),
                (f"Request goodput (req/s) [{self.goodput_slo.label()}]", f"{self.request_goodput:.2f}"),
                ("Output token throughput (tok/s)", f"{self.output_throughput:.2f}"),
                ("Total token throughput (tok/s)", f"{self.total_token_throughput:.2f}")]
        for name, s in zip(("TTFT", "TPOT", "ITL", "E2EL"), (self.ttft, self.tpot, self.itl, self.e2el)):
            rows += [(f"Mean {name} (ms)", f"{s.mean_ms:.2f}"), (f"Median {name} (ms)", f"{s.median_ms:.2f}"),
                     (f"Std {name} (ms)", f"{s.std_ms:.2f}")]
            rows += [(f"{k.upper()} {name} (ms)", f"{v:.2f}") for k, v in s.percentiles_ms.items()]
        rows.append((f"SLO attainment, per-token deadlines (%) [TTFT<={self.ttft_slo_s * 1e3:g}ms, "
                     f"TBT<={self.tbt_slo_s * 1e3:g}ms]", f"{100 * self.slo_attainment:.1f}"))
        rows.append(("Prefix cache hit rate, prompt tokens (%)",
                     f"{100 * self.total_cached_tokens / max(1, self.total_input_tokens):.1f}"))
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


def summarize(results: list[RequestResult], duration: float, ttft_slo: float, tbt_slo: float,
              goodput: GoodputSLO | None = None,
              percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> BenchReport:
    """The report of one run. ``goodput`` defaults to TTFT <= ``ttft_slo`` and TPOT <= ``tbt_slo``."""
    goodput = goodput or GoodputSLO(ttft_s=ttft_slo, tpot_s=tbt_slo)
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    attained = [r for r in ok if meets_token_deadlines(r, ttft_slo, tbt_slo)]
    d = max(duration, 1e-9)

    def stat(xs: list[float]) -> Stat:
        return Stat.of(xs, percentiles)

    return BenchReport(
        completed=len(ok), failed=len(results) - len(ok), duration=duration,
        total_input_tokens=in_tokens, total_output_tokens=out_tokens,
        request_throughput=len(ok) / d, output_throughput=out_tokens / d,
        total_token_throughput=(in_tokens + out_tokens) / d,
        ttft=stat([r.ttft for r in ok]), tpot=stat([r.tpot for r in ok if r.tpot is not None]),
        itl=stat([x for r in ok for x in r.itls]), e2el=stat([r.e2e for r in ok]),
        ttft_slo_s=ttft_slo, tbt_slo_s=tbt_slo, goodput_slo=goodput,
        request_goodput=sum(goodput.met(r) for r in ok) / d,
        slo_attainment=len(attained) / len(results) if results else 0.0,
        errors=sorted({r.error for r in results if r.error})[:5],
        total_cached_tokens=sum(r.cached_tokens for r in ok))


def vllm_result(report: BenchReport, results: list[RequestResult]) -> dict:
    """The flat keys of ``vllm bench serve --save-result`` (``mean_ttft_ms``, ``std_tpot_ms``,
    ``p99_itl_ms``, ``request_goodput``, ...) and its per-request arrays (seconds; a failed request
    has TTFT 0, no tokens and its message in ``errors``, "" for a completed one). The distinct
    messages are ``error_messages``."""
    flat: dict = {}
    for name in METRICS:
        s: Stat = getattr(report, name)
        flat.update({f"mean_{name}_ms": s.mean_ms, f"median_{name}_ms": s.median_ms, f"std_{name}_ms": s.std_ms})
        flat.update({f"{k}_{name}_ms": v for k, v in s.percentiles_ms.items()})
    flat.update(
        request_goodput=report.request_goodput,
        input_lens=[r.input_len for r in results],
        output_lens=[r.output_tokens if r.ok else 0 for r in results],
        ttfts=[r.ttft if r.ok else 0.0 for r in results],
        itls=[r.itls if r.ok else [] for r in results],
        generated_texts=[r.text for r in results],
        errors=[r.error or ("" if r.ok else "no finish_reason") for r in results],
        error_messages=report.errors)
    return flat
