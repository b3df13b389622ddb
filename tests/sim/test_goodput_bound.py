"""The schedule-free attainment bound: its pieces, and that the simulated engine never beats it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from conflux_cluster.bench.goodput_compare import sim_point
from conflux_cluster.engine.scheduler.estimator import EstimatorProfile
from conflux_cluster.sim.goodput_bound import (attainment_bound, cache_work_ratio, forced_misses, geometric_rates,
                                               goodput_bound, least_prefill_s)
from conflux_cluster.sim.prefix import cached_prefix_tokens
from conflux_cluster.sim.hardware import get_hardware, get_model
from conflux_cluster.slo import SLO
from conflux_cluster.sim.registry import Setting, sweep
from conflux_cluster.sim.workloads import SimRequest, Workload, cap_lengths, toolagent_like

PROFILE = EstimatorProfile.from_json(Path(__file__).parents[2] / "engine/scheduler/profiles/h200-llama-3.1-8b-n1.json")


def test_forced_misses_counts_the_most_expensive_first():
    # three arrivals at 0, 1, 2 with TTFT 1: the window [0, 2] holds 3 s of room
    assert forced_misses([0, 1, 2], [1, 1, 1], 1.0) == 0
    assert forced_misses([0, 1, 2], [1, 3, 1], 1.0) == 1  # dropping the 3 s request fits the rest
    assert forced_misses([0, 0, 0], [0.6, 0.6, 0.6], 1.0) == 2  # a burst: one fits in the TTFT
    assert forced_misses([0, 100], [5, 5], 1.0) == 1  # each alone overruns its own window
    with pytest.raises(ValueError):
        forced_misses([0, 1], [1], 1.0)


def test_least_prefill_grows_with_length_and_shrinks_with_cache():
    a, b = least_prefill_s(4096, 0, PROFILE), least_prefill_s(8192, 0, PROFILE)
    assert 2 * a < b  # attention is quadratic
    assert least_prefill_s(8192, 4096, PROFILE) < b
    assert least_prefill_s(8192, 4096, PROFILE) > a  # the suffix still attends over the cached prefix
    with pytest.raises(ValueError):
        least_prefill_s(10, 11, PROFILE)


def test_cached_prefix_counts_only_leading_blocks_seen_before():
    reqs = (SimRequest("a", 0.0, 1024, 1, (1, 2)), SimRequest("b", 1.0, 1536, 1, (1, 2, 3)),
            SimRequest("c", 2.0, 1024, 1, (9, 2)), SimRequest("d", 3.0, 1024, 1, (1, 2)))
    # d's two blocks were all seen: one token is still computed (the first output needs a forward pass),
    # and the cache holds whole 16-token engine blocks, so 1,008 of its 1,024 tokens are served
    assert cached_prefix_tokens(Workload("w", reqs)) == [0, 1024, 0, 1008]


def test_geometric_rates():
    r = geometric_rates(1.0, 4.0, 2)
    assert r == pytest.approx([1, 2 ** 0.5, 2, 2 ** 1.5, 4])


def test_the_simulated_engine_never_beats_the_bound():
    """Same profile, same requests: the engine scheduler's simulated attainment is at most the bound at
    every rate, and somewhere the bound is below 100 % (it can fail)."""
    model = get_model("llama-8b")
    wl = cap_lengths(toolagent_like(40, seed=3), 32768)
    slo = SLO(2.0, 0.1)
    setting = Setting(model, get_hardware("h200"), 1, 1, slo, PROFILE)
    factory = sweep("conflux", setting)[0].build(setting)
    rates = [2.0, 4.0, 8.0, 16.0]
    points = [attainment_bound(wl, r, PROFILE, slo.ttft_s) for r in rates]
    best = goodput_bound(wl, geometric_rates(0.5, 64, 4), PROFILE, slo.ttft_s)
    assert points[0].attainment_bound >= 0.95 and 2.0 <= best < 16.0
    assert all(a.attainment_bound >= b.attainment_bound for a, b in zip(points, points[1:]))  # falls with rate
    assert any(p.attainment_bound < 1 for p in points)
    for p in points:
        sim = sim_point(factory, wl, slo, p.rate)
        assert sim["attainment"] <= p.attainment_bound + 1e-9, (p, sim["attainment"])
    # a faster GPU (every slope halved) can only raise the bound
    fast = replace(PROFILE, f_gemm=replace(PROFILE.f_gemm, slope=PROFILE.f_gemm.slope / 2),
                   f_prefill_attn=replace(PROFILE.f_prefill_attn, slope=PROFILE.f_prefill_attn.slope / 2))
    assert all(attainment_bound(wl, p.rate, fast, slo.ttft_s).attainment_bound >= p.attainment_bound for p in points)


def test_cache_work_ratio():
    model = get_model("llama-8b")
    fresh = Workload("w", tuple(SimRequest(str(i), float(i), 4096, 64, (10 * i, 10 * i + 1)) for i in range(4)))
    assert cache_work_ratio(fresh, model, 790e12, 4.3e12) == pytest.approx(1.0)  # nothing repeats
    shared = Workload("w", tuple(SimRequest(str(i), float(i), 4096, 64, (1, 2, 3, 4, 5, 6, 7, 10 + i))
                                 for i in range(4)))
    r = cache_work_ratio(shared, model, 790e12, 4.3e12)
    assert 1.5 < r < 4  # three of four requests reuse 7 of 8 blocks; the attention over them still costs
    longer = Workload("w", tuple(replace(q, output_len=2048) for q in shared.requests))
    assert 1.0 < cache_work_ratio(longer, model, 790e12, 4.3e12) < r  # decode work dilutes the saving


def test_served_work_scale_and_the_engine_efficiency_bound():
    from conflux_cluster.engine.scheduler.estimator import BatchLoad
    from conflux_cluster.engine.scheduler.fitting.fit import BatchSample
    from conflux_cluster.sim.goodput_bound import scaled_profile, served_work_scale, slope_work_s

    loads = [BatchLoad((2048,), (8,), (40_000,), ((2048, 4096),)), BatchLoad((512,), (30,), (90_000,), ((512, 0),))]
    samples = [BatchSample(ld, 1.5 * slope_work_s(ld, PROFILE)) for ld in loads]
    assert served_work_scale(samples, PROFILE) == pytest.approx(1.5)
    dear = scaled_profile(PROFILE, 1.5)
    assert least_prefill_s(8192, 0, dear) == pytest.approx(1.5 * least_prefill_s(8192, 0, PROFILE))
    wl = cap_lengths(toolagent_like(40, seed=3), 32768)
    for r in (2.0, 4.0, 8.0):
        cheap, costly = attainment_bound(wl, r, PROFILE, 2.0), attainment_bound(wl, r, dear, 2.0)
        assert costly.attainment_bound <= cheap.attainment_bound
    with pytest.raises(ValueError):
        served_work_scale([], PROFILE)
