"""Hand-computed tiny scenarios: exact TTFT / token times per request.

Toy costs (conftest): one layer, gemm(n) = 0.010 + 0.0001·n seconds, everything else free.
"""

from __future__ import annotations

import pytest

from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.sim.core import Simulation
from conflux_cluster.slo import SLO
from conflux_cluster.sim.systems.distserve import DistServeInstance
from conflux_cluster.sim.systems.engine_sched import XPInstance
from conflux_cluster.sim.workloads import SimRequest, Workload

SLO_ = SLO(ttft_s=1.0, tbt_s=0.05)


def fixed(budget: int) -> SchedulerConfig:
    return SchedulerConfig(policy="fcfs", token_budget="fixed", max_num_batched_tokens=budget)


def run(factory, *reqs: SimRequest) -> dict:
    res = Simulation(factory, Workload("t", tuple(reqs)), SLO_).run()
    return {r.request_id: r.token_times for r in res.records}


def test_xp_one_rank_chunked_then_cobatched(costs):
    """A: prompt 150, 3 outputs at t=0; B: prompt 30, 2 outputs at t=0.03; budget 100 tokens/step.

    step 1 [0, .020]:      A prefill 100                       gemm(100) = .020
    step 2 [.020, .035]:   A prefill 50 (last) → A tok1        gemm(50)  = .015
    step 3 [.035, .0481]:  A decode + B prefill 30 (last)      gemm(31)  = .0131 → A tok2, B tok1
    step 4 [.0481, .0583]: A decode + B decode                 gemm(2)   = .0102 → A tok3, B tok2
    """
    times = run(lambda rec: XPInstance(rec, costs, 1, fixed(100), SLO_),
                SimRequest("A", 0.0, 150, 3), SimRequest("B", 0.03, 30, 2))
    assert times["A"] == pytest.approx([0.035, 0.0481, 0.0583])
    assert times["B"] == pytest.approx([0.0481, 0.0583])


def test_xp_pipelined_one_rank_decodes_right_after_the_prompt(costs):
    """The served engine plans a step before the previous one's tokens are back, but one rank keeps the
    first token it sampled: the same token times as the scenario above."""
    times = run(lambda rec: XPInstance(rec, costs, 1, fixed(100), SLO_, pipelined=True),
                SimRequest("A", 0.0, 150, 3), SimRequest("B", 0.03, 30, 2))
    assert times["A"] == pytest.approx([0.035, 0.0481, 0.0583])
    assert times["B"] == pytest.approx([0.0481, 0.0583])


def test_xp_pipelined_defers_a_first_token_sampled_on_another_rank(costs):
    """N=2, pipelined: A's prompt is poured 75 + 75, its first token is sampled on rank 1 and A decodes
    on rank 0, so A's first decode sits out the step after its transition (the token is in flight
    through the host). B: prompt 300 at t=0, its last slice on rank 1 and B decodes there (no wait).

    step 1 [0, .0175]:      A 75 + 75 (last) → A tok1               gemm(75)  = .0175
    step 2 [.0175, .0375]:  B 100 + 100; A sits out                  gemm(100) = .020
    step 3 [.0375, .0526]:  B 50 + 50 (last) + A decode on rank 0    gemm(51)  = .0151 → A tok2, B tok1
    step 4 [.0526, .0627]:  A + B decode                             gemm(1)   = .0101 → A tok3, B tok2

    A lone request gets every token: the step it sat out is re-planned at once (not at the next arrival).
    """
    times = run(lambda rec: XPInstance(rec, costs, 2, fixed(100), SLO_, pipelined=True),
                SimRequest("A", 0.0, 150, 3), SimRequest("B", 0.0, 300, 2))
    assert times["A"] == pytest.approx([0.0175, 0.0526, 0.0627])
    assert times["B"] == pytest.approx([0.0526, 0.0627])
    alone = run(lambda rec: XPInstance(rec, costs, 2, fixed(100), SLO_, pipelined=True), SimRequest("A", 0.0, 150, 3))
    assert alone["A"] == pytest.approx([0.0175, 0.0276, 0.0377])


def test_xp_two_ranks_pour_halves_the_linear_batch(costs):
    """N=2, budget 100/rank: a 150-token prompt is poured 75 + 75, so the step costs gemm(75)."""
    times = run(lambda rec: XPInstance(rec, costs, 2, fixed(100), SLO_), SimRequest("A", 0.0, 150, 2))
    assert times["A"] == pytest.approx([0.0175, 0.0175 + 0.0101])


def test_xp_idle_gap_between_requests(costs):
    """The clock jumps over idle time: a later request starts at its own arrival."""
    times = run(lambda rec: XPInstance(rec, costs, 1, fixed(100), SLO_),
                SimRequest("A", 0.0, 10, 1), SimRequest("B", 5.0, 10, 1))
    assert times["A"] == pytest.approx([0.011])
    assert times["B"] == pytest.approx([5.011])


def test_distserve_prefill_then_decode_pool(costs):
    """Prefill step gemm(100)=.020 emits token 1; KV moves (free here); decode steps gemm(1)=.0101."""
    times = run(lambda rec: DistServeInstance(rec, costs, 1, 1, 1, 1, "fcfs"), SimRequest("A", 0.0, 100, 3))
    assert times["A"] == pytest.approx([0.020, 0.0301, 0.0402])


def test_distserve_srpt_runs_short_prompt_first(costs):
    """Two prompts queued while the prefill replica is busy: "++" takes the shorter one first."""
    reqs = (SimRequest("X", 0.0, 10, 1), SimRequest("long", 0.001, 500, 1), SimRequest("short", 0.002, 20, 1))
    fcfs = run(lambda rec: DistServeInstance(rec, costs, 1, 1, 1, 1, "fcfs", max_prefill_tokens=100), *reqs)
    srpt = run(lambda rec: DistServeInstance(rec, costs, 1, 1, 1, 1, "srpt", max_prefill_tokens=100), *reqs)
    # X: gemm(10) = .011. FCFS: long gemm(500)=.060 → .071, then short gemm(20)=.012 → .083.
    assert fcfs["long"] == pytest.approx([0.071]) and fcfs["short"] == pytest.approx([0.083])
    # SRPT: short first → .023, then long → .083.
    assert srpt["short"] == pytest.approx([0.023]) and srpt["long"] == pytest.approx([0.083])
