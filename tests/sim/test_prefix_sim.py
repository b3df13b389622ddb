"""The simulator's prefix cache and prefix-aware routing on the Mooncake conversation trace: the
engine scheduler's own cache policy runs on hash_ids; hit rates stay under the trace's reuse bound,
routing by prefix raises them, and requests still produce every token."""

from __future__ import annotations

from conflux_cluster.sim.cluster import run_cluster
from conflux_cluster.sim.hardware import get_hardware, get_model
from conflux_cluster.slo import SLO
from conflux_cluster.sim.prefix import engine_block_hashes, reuse_bound
from conflux_cluster.sim.registry import Setting
from conflux_cluster.sim.workloads import SimRequest, Workload, cap_lengths, make_workload

S = Setting(get_model("llama-8b"), get_hardware("h200"), 4, 1, SLO(1.0, 0.05))


def test_trace_blocks_become_chained_engine_blocks():
    a = SimRequest("a", 0.0, 1100, 1, (7, 8, 9))
    b = SimRequest("b", 0.0, 1100, 1, (7, 8, 10))
    ha, hb = engine_block_hashes(a, 16), engine_block_hashes(b, 16)
    assert len(ha) == 1100 // 16 and ha[:64] == hb[:64] and ha[64] != hb[64]
    assert engine_block_hashes(SimRequest("c", 0.0, 100, 1), 16) == []


def test_reuse_bound_counts_leading_repeats_only():
    w = Workload("t", (SimRequest("a", 0.0, 1024, 1, (1, 2)), SimRequest("b", 1.0, 1024, 1, (1, 3)),
                      SimRequest("c", 2.0, 1024, 1, (4, 2))))
    assert reuse_bound(w) == 512 / 3072  # b reuses block 1; c's block 2 follows another prefix
    # an LRU of one trace block: b's block 1 was pushed out by a's block 2
    assert reuse_bound(w, capacity_tokens=512) == 0.0 and reuse_bound(w, capacity_tokens=1024) == 512 / 3072


def test_cluster_hit_rates_under_bound_and_prefix_routing_helps():
    wl = cap_lengths(make_workload("conversation", 240), S.model.max_context)
    bound = reuse_bound(wl)
    off = run_cluster(S, wl, "conflux", 4, "lowest_load", rate=8.0)
    cached = run_cluster(S, wl, "conflux-pc", 4, "lowest_load", rate=8.0)
    routed = run_cluster(S, wl, "conflux-pc", 4, "prefix_aware", rate=8.0)
    assert off["prefix_hit_rate"] == 0.0
    assert 0.0 < cached["prefix_hit_rate"] < routed["prefix_hit_rate"] <= bound


def test_sim_point_reports_the_share_its_prefix_cache_served():
    from conflux_cluster.bench.goodput_compare import sim_point
    from conflux_cluster.sim.registry import sweep

    one = Setting(get_model("llama-8b"), get_hardware("h200"), 1, 1, SLO(5.0, 0.1))
    wl = cap_lengths(make_workload("conversation-sessions", 40, seed=2), one.model.max_context)
    bound = reuse_bound(wl)
    cached, plain = (sim_point(sweep(name, one, quick=True)[0].build(one), wl, one.slo, 1.0)
                     for name in ("conflux-pc", "conflux"))
    assert plain["cached_fraction"] == 0.0 and cached["completed"] == plain["completed"] == 40
    assert 0.5 * bound < cached["cached_fraction"] <= bound, (cached["cached_fraction"], bound)
