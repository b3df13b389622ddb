"""max_step_stretch: a step's prefill may take several τ while every decode it carries keeps half its
slack to the next per-token deadline (TTFT deadline + tokens so far · τ); 1 keeps the paper's rule."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from conflux_cluster.engine.kv.layout import KVLayout
from conflux_cluster.engine.contracts.step import StepResult
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.scheduler.estimator import LatencyEstimator
from conflux_cluster.engine.scheduler.requests import SchedRequest
from conflux_cluster.engine.scheduler.roofline import H200, roofline_profile
from conflux_cluster.engine.scheduler.scheduler import SLACK_SHARE, Scheduler

TAU = 0.05


def _sched(stretch: float) -> Scheduler:
    layout = KVLayout.build(16, 32, 8, 1)
    est = LatencyEstimator(roofline_profile("llama-3.1-8b", H200, 1))
    cfg = SchedulerConfig(policy="slo", ttft_slo=5.0, tbt_slo=TAU, max_step_stretch=stretch)
    return Scheduler(cfg, layout, 20_000, estimator=est)


def _with_one_decode(sched: Scheduler, ttft_deadline: float) -> float:
    """A short request prefilled and decoding (its deadline as given), then a long prompt waiting;
    returns the clock of the next plan."""
    sched.add(SchedRequest("d", 64, 1000, 0.0, ttft_deadline))
    plan = sched.schedule(0.0)
    assert [t.request_id for t in plan.transitions] == ["d"]
    sched.update(plan, StepResult(plan.step, {"d": 1}))
    sched.add(SchedRequest("long", 60_000, 16, 0.01, 5.01))
    return 0.05


def _chunk(plan) -> int:
    return sum(s.num_tokens for s in plan.prefill if s.request_id == "long")


def test_slack_lets_a_step_take_more_prefill():
    base, stretched = _sched(1.0), _sched(4.0)
    now = _with_one_decode(base, 5.0)
    _with_one_decode(stretched, 5.0)  # the decode's next token is due at 5.0 + 1·τ: seconds of slack
    b, s = base.schedule(now), stretched.schedule(now)
    assert b.decode == s.decode == [["d"]]
    assert _chunk(s) > 2 * _chunk(b) > 0
    assert stretched.plan_estimate(s, stretched.decode_context_per_rank()) <= 4 * TAU * (1 + 1e-9)
    assert base.last_budget == stretched.last_budget  # B_0 (admission) is per τ either way


def test_a_decode_near_its_deadline_keeps_the_step_within_tau():
    base, stretched = _sched(1.0), _sched(4.0)
    now = _with_one_decode(base, 0.06)
    _with_one_decode(stretched, 0.06)  # next token due at 0.06 + τ = 0.11: slack 0.06 < 2τ
    b, s = base.schedule(now), stretched.schedule(now)
    assert _chunk(s) == _chunk(b)


def test_the_stretch_is_half_the_slack_beyond_the_step_in_flight():
    sched = _sched(8.0)
    now = _with_one_decode(sched, 1.0)  # the step before had no decode to bound it: stretched to the cap
    assert sched.dispatcher.step_stretch == 8.0
    plan = sched.schedule(now)
    slack = 1.0 + 1 * TAU - now  # TTFT deadline + tokens so far · τ − now
    want = max(1.0, min(8.0, SLACK_SHARE * (slack - 8.0 * TAU) / TAU))  # the previous step may still run
    assert sched.dispatcher.step_stretch == pytest.approx(want)
    assert plan.decode == [["d"]]
    sched.update(plan, StepResult(plan.step, {"d": 1}))
    sched.schedule(now + TAU)
    slack2 = 1.0 + 2 * TAU - (now + TAU)
    assert sched.dispatcher.step_stretch == pytest.approx(min(8.0, SLACK_SHARE * (slack2 - want * TAU) / TAU))


def test_stretch_below_one_is_a_config_error_naming_the_field():
    with pytest.raises(ValidationError, match="max_step_stretch"):
        SchedulerConfig(max_step_stretch=0.5)


def _alone(idle: float) -> Scheduler:
    layout = KVLayout.build(16, 32, 8, 1)
    est = LatencyEstimator(roofline_profile("llama-3.1-8b", H200, 1))
    cfg = SchedulerConfig(policy="slo", ttft_slo=5.0, tbt_slo=TAU, idle_step_stretch=idle)
    return Scheduler(cfg, layout, 20_000, estimator=est)


def test_a_step_without_decodes_may_take_idle_step_stretch_tau():
    """A lone long prompt: no token is due from its steps, so each may take idle_step_stretch·τ."""
    chunks = {}
    for idle in (1.0, 4.0):
        sched = _alone(idle)
        sched.add(SchedRequest("long", 60_000, 16, 0.0, 5.0))
        plan = sched.schedule(0.0)
        assert plan.decode == [[]]
        chunks[idle] = _chunk(plan)
        assert sched.plan_estimate(plan, sched.decode_context_per_rank()) <= idle * TAU * (1 + 1e-9)
    assert chunks[4.0] > 2 * chunks[1.0] > 0
