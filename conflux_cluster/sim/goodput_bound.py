"""An upper bound on the per-token SLO attainment any scheduler can reach on one instance.

Each request's prefill has a least cost under an ``EstimatorProfile``: its tokens through the GEMMs
and its causal attention pairs, with every per-step intercept left out (so batching could not make
it cheaper) and with the prefix an earlier request of the workload already computed taken as free
(an unbounded prefix cache, ``sim/prefix.py``'s rule). Its first token cannot come before that work
is done, and the instance runs one step at a time, so for every window ``[a_j, a_k + TTFT]`` of
arrivals the prefills kept inside it must fit in its length. The fewest requests each window forces
out (its most expensive first) is a lower bound on the misses of any schedule, hence an upper bound
on attainment; decode work and the TBT deadlines only add to it, so the bound leaves them out.

``conflux_cluster/sim`` times schedules; this module bounds them (``python -m benchmarks.simulator bound``).
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from conflux_cluster.engine.scheduler.estimator import BatchLoad, EstimatorProfile, prefill_attn_work, prefill_kv_tokens
from conflux_cluster.engine.scheduler.fitting.fit import BatchSample

from .hardware import ModelSpec
from .prefix import cached_prefix_tokens
from .workloads import Workload, scale_to_rate


@dataclass(frozen=True)
class BoundPoint:
    """The bound at one arrival rate."""

    rate: float
    attainment_bound: float  # at most this fraction of requests can meet every per-token deadline
    forced_misses: int  # requests some window of arrivals cannot fit
    work_s: float  # Σ least prefill work of all requests (s)
    span_s: float  # first arrival to last arrival (s)


def least_prefill_s(prompt_len: int, cached: int, profile: EstimatorProfile) -> float:
    """Seconds the profile gives, at the least, to prefill ``prompt_len − cached`` tokens over ``cached``
    tokens of history: ``slope_work_s`` of that one chunk alone in its step, its tokens spread evenly
    over the profile's ranks (each runs its share through the GEMMs; rounded down, so never more)."""
    new = prompt_len - cached
    if new < 0 or cached < 0:
        raise ValueError(f"least_prefill_s: need 0 <= cached <= prompt_len, got {cached}, {prompt_len}")
    n = profile.num_ranks
    return slope_work_s(BatchLoad((new // n,) * n, (0,) * n, (0,) * n, ((new, cached),)), profile)


def forced_misses(arrivals: Sequence[float], work: Sequence[float], ttft_s: float) -> int:
    """max over windows [a_j, a_k] of the fewest requests arriving in it whose removal (most expensive
    first) lets the rest's work fit in a_k − a_j + ttft_s. Arrivals sorted. O(n² · misses)."""
    n = len(arrivals)
    if len(work) != n:
        raise ValueError("forced_misses: arrivals and work differ in length")
    worst = 0
    for j in range(n):
        inside: list[float] = []  # the window's work, ascending
        total = 0.0
        for k in range(j, n):
            bisect.insort(inside, work[k])
            total += work[k]
            room = arrivals[k] - arrivals[j] + ttft_s
            drop, left = 0, total
            while left > room + 1e-12 and drop < len(inside):
                drop += 1
                left -= inside[-drop]
            worst = max(worst, drop)
    return worst


def attainment_bound(workload: Workload, rate: float, profile: EstimatorProfile, ttft_s: float) -> BoundPoint:
    """The bound at ``rate`` req/s (the workload's arrivals scaled to it, as the benchmark sends them)."""
    if ttft_s <= 0 or not len(workload):
        raise ValueError("attainment_bound: need ttft_s > 0 and a non-empty workload")
    wl = scale_to_rate(workload, rate)
    cached = cached_prefix_tokens(wl)
    work = [least_prefill_s(r.prompt_len, c, profile) for r, c in zip(wl.requests, cached)]
    arrivals = [r.arrival for r in wl.requests]
    m = forced_misses(arrivals, work, ttft_s)
    return BoundPoint(rate, 1 - m / len(wl), m, sum(work), arrivals[-1] - arrivals[0])


def goodput_bound(workload: Workload, rates: Sequence[float], profile: EstimatorProfile, ttft_s: float,
                  target: float = 0.95) -> float:
    """The highest of ``rates`` whose attainment bound reaches ``target`` (0 if none). The bound falls as
    the rate rises (every window of arrivals shrinks), so the rates are bisected."""
    grid = sorted(rates)
    lo, hi = -1, len(grid)  # grid[lo] passes (or lo = -1), grid[hi] fails (or hi = len)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attainment_bound(workload, grid[mid], profile, ttft_s).attainment_bound >= target - 1e-12:
            lo = mid
        else:
            hi = mid
    return grid[lo] if lo >= 0 else 0.0


def geometric_rates(lo: float, hi: float, per_doubling: int = 8) -> list[float]:
    """Rates from ``lo`` to ``hi`` spaced 2^(1/per_doubling) apart (finer than the benchmark's grid)."""
    if not 0 < lo <= hi or per_doubling < 1:
        raise ValueError("geometric_rates: need 0 < lo <= hi and per_doubling >= 1")
    steps = math.floor(per_doubling * math.log2(hi / lo) + 1e-9)
    return [lo * 2 ** (i / per_doubling) for i in range(steps + 1)]


def cache_work_ratio(workload: Workload, model: ModelSpec, flops: float, hbm_bytes_s: float) -> float:
    """Σ work without a prefix cache ÷ Σ work with an unbounded one: the most a cache can raise the
    goodput of an instance bound by throughput. Per request: prefill GEMM and causal-attention FLOPs
    at ``flops``, and each output token's KV read at ``hbm_bytes_s`` (weight reads, shared by a batch,
    left out, which favours the cache); cached prefix tokens skip their GEMMs but are still attended."""
    gemm = 2 * model.num_layers * model.linear_params  # FLOPs per prefill token
    attn = 4 * model.num_layers * model.num_q_heads * model.head_dim  # FLOPs per causal (query, key) pair

    def prefill_s(new: int, history: int) -> float:
        return (gemm * new + attn * new * (history + (new + 1) / 2)) / flops

    without = with_cache = 0.0
    for r, cached in zip(workload.requests, cached_prefix_tokens(workload)):
        out = r.output_len - 1  # the first token comes from the prefill
        decode = out * (r.prompt_len + out / 2) * model.kv_bytes_per_token / hbm_bytes_s
        without += prefill_s(r.prompt_len, 0) + decode
        with_cache += prefill_s(r.prompt_len - cached, cached) + decode
    return without / with_cache


def slope_work_s(load: BatchLoad, profile: EstimatorProfile) -> float:
    """A step's work at the profile's slopes only (no intercepts, so batching could not make it cheaper):
    its largest rank's tokens through the GEMMs (decode tokens too) and its prefill attention pairs and
    KV reads shared by the ranks, scaled by β."""
    p = profile
    tokens = max((a + b for a, b in zip(load.prefill_tokens, load.decode_tokens)), default=0)
    attn = (max(0.0, p.f_prefill_attn.slope) * prefill_attn_work(load.prefill_chunks)
            + max(0.0, p.f_prefill_kv.slope) * prefill_kv_tokens(load.prefill_chunks)) / p.num_ranks
    return p.num_layers * (max(0.0, p.f_gemm.slope) * tokens + p.beta * attn)


def served_work_scale(samples: Sequence[BatchSample], profile: EstimatorProfile) -> float:
    """Σ measured step time ÷ Σ slope work over served steps (``engine/scheduler/fitting/step_log.py``): how much dearer
    the engine's steps are than the bound's least work (intercepts, κ, decode attention, host gaps).
    Scaling the bound's slopes by it gives an engine-efficiency bound: no longer strict (decode work
    is then charged on average), but what a scheduler on this engine could reach."""
    work = sum(slope_work_s(s.load, profile) for s in samples)
    if work <= 0:
        raise ValueError("served_work_scale: the steps hold no work")
    return sum(s.seconds for s in samples) / work


def scaled_profile(profile: EstimatorProfile, k: float) -> EstimatorProfile:
    """The profile with the slopes ``slope_work_s`` reads multiplied by ``k``."""
    return replace(profile, f_gemm=replace(profile.f_gemm, slope=profile.f_gemm.slope * k),
                   f_prefill_attn=replace(profile.f_prefill_attn, slope=profile.f_prefill_attn.slope * k),
                   f_prefill_kv=replace(profile.f_prefill_kv, slope=profile.f_prefill_kv.slope * k))
