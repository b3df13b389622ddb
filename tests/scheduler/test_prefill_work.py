"""Admission's m_i in step tokens (``admission.PrefillWork``): it predicts how many steps the
waterfill dispatch takes to prefill a prompt, where the raw token count does not once the prompt's
own history makes chunks smaller than B_0; and Moore–Hodgson then drops the long prompt it cannot
finish instead of letting the short requests behind it come late; the router's queued work counts only
the admitted requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from conflux_cluster.engine.kv.layout import KVLayout
from conflux_cluster.engine.scheduler.admission import PrefillWork, raw_tokens
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.scheduler.dispatch import StepState, WaterfillDispatcher
from conflux_cluster.engine.scheduler.estimator import EstimatorProfile, LatencyEstimator
from conflux_cluster.engine.scheduler.requests import SchedRequest
from conflux_cluster.engine.scheduler.roofline import roofline_profile
from conflux_cluster.engine.scheduler.scheduler import Scheduler

PROFILES = Path(__file__).resolve().parents[2] / "engine" / "scheduler" / "profiles"


def _profiles() -> list[EstimatorProfile]:
    return [EstimatorProfile.from_json(PROFILES / "h200-llama-3.1-8b-n1.json"),
            roofline_profile("llama-3.1-8b", "h200", 2), roofline_profile("llama-3.1-8b", "h100", 4)]


def _steps_alone(disp: WaterfillDispatcher, n: int, prompt: int) -> float:
    """Steps the dispatch takes to prefill ``prompt`` tokens on an idle instance of ``n`` ranks, the
    last one counted as the share of a full chunk it holds."""
    done, steps = 0, 0.0
    while done < prompt:
        full, _ = disp.dispatch(StepState.from_decodes([0] * n, 0.0), 1 << 30, done)  # a full step's chunk here
        chunk = min(full, prompt - done)
        assert chunk > 0
        done += chunk
        steps += chunk / full
    return steps


@pytest.mark.parametrize("profile", _profiles(), ids=lambda p: f"{p.hardware}-n{p.num_ranks}")
def test_step_tokens_predict_the_steps_a_prompt_takes(profile):
    n, tau = profile.num_ranks, 0.1
    disp = WaterfillDispatcher(LatencyEstimator(profile), tau, 16, 16384)
    b0 = disp.reference_budget(StepState.from_decodes([0] * n, 0.0))
    work = PrefillWork.from_profile(profile, b0)
    raw_errors, work_errors = [], []
    for prompt in (8192, 24576, 65536):  # prompts of several steps (a short one's share of a step is not linear)
        req = SchedRequest("r", prompt, 1, 0.0, 5.0)
        steps = _steps_alone(disp, n, prompt)
        work_errors.append(work(req) / b0 / steps)
        raw_errors.append(raw_tokens(req) / b0 / steps)
        assert work(req) >= raw_tokens(req)
    # one step's intercepts, the chunk's quantization and the KV term's chunk count: within 15 %
    assert all(0.85 <= e <= 1.15 for e in work_errors), work_errors
    assert raw_errors[-1] < 0.8 * work_errors[-1], (raw_errors, work_errors)  # the long prompt: raw undercounts


def test_partly_computed_and_cached_prompts_count_what_is_left():
    profile = _profiles()[0]
    work = PrefillWork.from_profile(profile, 4096)
    fresh = SchedRequest("a", 4096, 1, 0.0, 5.0)
    after = SchedRequest("b", 20480, 1, 0.0, 5.0, computed=16384)  # the same 4K tokens over a 16K history
    cached = SchedRequest("c", 20480, 1, 0.0, 5.0, cached=16384)
    assert work(after) == work(cached) > work(fresh) > 4096
    assert work(SchedRequest("d", 100, 1, 0.0, 5.0, computed=100)) == 0
    assert PrefillWork.from_profile(profile, 0).chunk_tokens == 1  # a zero budget does not divide by zero


def _scheduler(profile_path: Path, policy: str = "slo") -> Scheduler:
    cfg = SchedulerConfig(policy=policy, ttft_slo=5.0, tbt_slo=0.1, estimator_profile=str(profile_path),
                          calibrate_steps=False)
    return Scheduler(cfg, KVLayout.build(16, 32, 8, 1), 200_000)


def test_admission_drops_the_long_prompt_it_cannot_finish():
    """A 40K-token prompt, then short ones arriving right behind it, 0.9 of a TTFT SLO of steps in raw
    tokens: by raw counts every request fits, by step tokens the long one does not, and it is the one
    Moore–Hodgson gives up (the short ones are served first, in EDF order)."""
    s = _scheduler(PROFILES / "h200-llama-3.1-8b-n1.json")
    per_slo = s.last_budget * 5.0 / 0.1  # raw tokens one TTFT SLO of steps holds at B_0
    s.add(SchedRequest("long", 40_000, 8, 0.0, 5.0), now=0.0)
    shorts = int((0.9 * per_slo - 40_000) // 1000)
    for i in range(shorts):
        t = 1e-5 * (i + 1)
        s.add(SchedRequest(f"s{i}", 1000, 8, t, t + 5.0), now=t)
    assert sum(r.remaining_prefill for r in s._edf.reqs) < per_slo  # the paper's surrogate admits all of them
    assert sum(s._edf.remaining) > per_slo
    order = [r.request_id for r in s._prefill_order(0.001)]
    assert order == [f"s{k}" for k in range(shorts)] + ["long"]
    s.check_invariants()
    # the router's queued work is what a new arrival waits behind: the admitted requests, not the given-up one
    s.schedule(0.001)
    assert s.load().queued_prefill_tokens == 1000 * shorts
    fcfs = _scheduler(PROFILES / "h200-llama-3.1-8b-n1.json", policy="fcfs")
    fcfs.add(SchedRequest("long", 40_000, 8, 0.0, 5.0), now=0.0)
    fcfs.add(SchedRequest("s", 1000, 8, 0.0, 5.0), now=0.0)
    assert fcfs.load().queued_prefill_tokens == 41_000  # no admission: every waiting request counts


def test_fixed_budget_policies_keep_raw_tokens():
    s = _scheduler(PROFILES / "h200-llama-3.1-8b-n1.json", policy="fcfs")
    assert s._edf.work is raw_tokens
    budget = Scheduler(SchedulerConfig(policy="slo", estimator_profile="budget"), KVLayout.build(16, 32, 8, 1), 1000)
    assert budget._edf.work is raw_tokens  # the built-in budget profile has no attention terms
