"""Policy slo under overload: bounded waits for deferred requests, admission judged against outcomes (CPU)."""

from __future__ import annotations

import math

import pytest

from conflux_cluster.engine.kv.layout import KVLayout
from conflux_cluster.engine.contracts.step import StepResult
from conflux_cluster.engine.scheduler.admission import EDFQueue
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.scheduler.deferred import bounded_slo_order
from conflux_cluster.engine.scheduler.outcomes import HYSTERESIS, AdmissionOutcomes
from conflux_cluster.engine.scheduler.requests import SchedRequest
from conflux_cluster.engine.scheduler.scheduler import Scheduler

TAU = 0.05


def _queue(jobs):
    """(remaining prompt tokens, arrival, TTFT deadline) per request, ids r0, r1, ... in arrival order."""
    reqs = [SchedRequest(f"r{i}", m, 1, a, d, seq=i) for i, (m, a, d) in enumerate(jobs)]
    q = EDFQueue()
    for r in reqs:
        q.add(r)
    return reqs, q


def _ids(it):
    return [r.request_id for r in it]


# ---- the order ------------------------------------------------------------------------------------------

# b0 = 100 tokens per τ. r0 (arrived at 0, deadline 1.0) is long and given up at now = 0.9 (2 slots left);
# r1..r3 arrived later and fit. r0 is not overdue at max_wait 3 s, overdue at max_wait 0.5 s.
JOBS = [(5000, 0.0, 1.0), (100, 0.5, 1.5), (100, 0.6, 1.6), (50, 0.7, 1.7)]


def test_a_deferred_request_waits_behind_the_admitted_until_its_bound():
    reqs, q = _queue(JOBS)
    assert _ids(bounded_slo_order(q, reqs, 100, 0.9, TAU, 3.0, None)) == ["r1", "r2", "r3", "r0"]
    assert q.given_up == {"r0"}


def test_an_overdue_deferred_request_goes_first_in_arrival_order():
    jobs = JOBS + [(4000, 0.05, 1.05)]  # r4: a second long one, arrived after r0
    reqs, q = _queue(jobs)
    order = _ids(bounded_slo_order(q, reqs, 100, 0.9, TAU, 0.5, None))
    assert order[:2] == ["r0", "r4"]  # both waited >= 0.5 s: arrival order, not SJF (r4 is shorter)
    # admission counts from when the overdue ones are done (9000 tokens: 4.5 s): r1..r3 cannot make it now
    assert q.given_up == {"r1", "r2", "r3"} and order[2:] == ["r3", "r1", "r2"]  # overdue: counted as load
    # the paper's order (no bound): SJF backfill puts the shorter r4 before r0, both after the admitted
    reqs, q = _queue(jobs)
    assert _ids(bounded_slo_order(q, reqs, 100, 0.9, TAU, math.inf, None))[-2:] == ["r4", "r0"]


def test_fallback_orders_by_arrival_and_predicts_for_that_order():
    reqs, q = _queue(JOBS)
    out = AdmissionOutcomes(window=8, threshold=0.8, min_samples=4)
    out.fallback = True
    assert _ids(bounded_slo_order(q, reqs, 100, 0.9, TAU, 3.0, out)) == ["r0", "r1", "r2", "r3"]
    assert q.given_up == {"r0"}  # admission still runs: the router's load is the admitted work
    # served in arrival order, r0's 5,000 tokens (50 τ) go first: r1..r3 (12-16 τ left) miss behind it, so
    # that is what is predicted (Moore–Hodgson's verdicts, r1..r3 meet, hold only for the order it serves)
    assert [out.predicted(r.request_id) for r in reqs] == [False, False, False, False]
    out.resolve("r0", 3.5)
    out.resolve("r1", 3.6)  # first token after r0's prefill: a miss, as predicted
    assert (out.predictions, out.correct) == (2, 2)
    # a short queue that all fits in arrival order is predicted to meet
    reqs, q = _queue([(100, 0.5, 1.5), (100, 0.6, 1.6)])
    list(bounded_slo_order(q, reqs, 100, 0.9, TAU, 3.0, out))
    assert [out.predicted(r.request_id) for r in reqs] == [True, True]


# ---- the outcome tracker -------------------------------------------------------------------------------


def _req(rid, deadline=1.0, preempted=0):
    return SchedRequest(rid, 10, 1, 0.0, deadline, num_preemptions=preempted)


def test_a_share_cap_lasts_one_pass():
    """The overdue request's chunk cap is set by the pass that shares the step with it; the next pass (here
    the FCFS fallback) starts with no cap."""
    reqs, q = _queue([(5000, 0.0, 1.0), (300, 0.5, 10.0), (300, 0.6, 10.1)])  # r1, r2: far deadlines
    reqs[0].fcfs_due = 0.1  # FCFS would have served r0 at 0.1 s: overdue from its TTFT SLO (1 s) on
    order = list(bounded_slo_order(q, reqs, 100, 1.2, TAU, math.inf, None, wait_factor=2.0, overdue_share=0.25))
    assert _ids(order) == ["r0", "r1", "r2"] and order[0].step_share == 0.25  # the admitted fill the rest
    assert all(r.step_share == 1.0 for r in order[1:])
    outcomes = AdmissionOutcomes(window=8, min_samples=4)
    outcomes.fallback = True
    list(bounded_slo_order(q, reqs, 100, 1.2, TAU, math.inf, outcomes, wait_factor=2.0, overdue_share=0.25))
    assert all(r.step_share == 1.0 for r in reqs)


def test_accuracy_below_threshold_falls_back_and_recovers_with_hysteresis():
    out = AdmissionOutcomes(window=10, threshold=0.8, min_samples=5)
    for i in range(4):  # predicted to meet, all late: no verdict before min_samples
        out.predict(_req(f"a{i}"), True)
        out.resolve(f"a{i}", 1.5)
    assert out.accuracy is None and not out.fallback
    out.predict(_req("a4"), True)
    out.resolve("a4", 1.5)
    assert out.accuracy == 0.0 and out.fallback and out.fallbacks == 1
    # right predictions push the wrong ones out of the window; EDF comes back only above 0.8 + hysteresis
    k = 0
    while out.fallback:
        out.predict(_req(f"b{k}"), True)
        out.resolve(f"b{k}", 0.5)
        k += 1
    assert out.accuracy >= 0.8 + HYSTERESIS and k == 9  # 9 of the window of 10 right: 0.9
    assert out.stats().fallbacks == 1 and out.stats().predictions == 5 + k


def test_the_latest_verdict_counts_and_aborts_are_forgotten():
    out = AdmissionOutcomes(window=8, threshold=0.5, min_samples=1)
    r = _req("x")
    out.predict(r, True)
    out.predict(r, False)  # the pass that planned its final chunk gave it up
    out.resolve("x", 0.9)  # ... and it came in time: wrong
    assert (out.predictions, out.correct) == (1, 0)
    out.predict(_req("y", preempted=1), False)  # a recompute is not judged
    assert out.predicted("y") is None
    out.predict(_req("z"), True)
    out.forget("z")  # aborted before its first token
    out.resolve("z", 0.1)
    assert out.predictions == 1
    with pytest.raises(ValueError, match="min_samples"):
        AdmissionOutcomes(window=4, min_samples=5)


# ---- the scheduler end to end (built-in budget profile, fake model outputs) -------------------------------


def _sched(**kw) -> Scheduler:
    # budget profile: 256 tokens per rank per step of τ = 50 ms on 1 rank
    cfg = SchedulerConfig(policy="slo", ttft_slo=1.0, tbt_slo=TAU, estimator_profile="budget", **kw)
    return Scheduler(cfg, KVLayout.build(16, 32, 8, 1), 100_000)


def _run(s: Scheduler, now: float, until: float, arrivals: list[SchedRequest]) -> dict[str, float]:
    """Step every τ from ``now`` to ``until``, adding ``arrivals`` as their time comes; first-token times."""
    first, pending = {}, sorted(arrivals, key=lambda r: r.arrival)
    while now < until:
        while pending and pending[0].arrival <= now:
            s.add(pending.pop(0), now=now)
        plan = s.schedule(now)
        now += TAU
        sampled = {rid: 0 for ids in plan.decode for rid in ids} | {t.request_id: 0 for t in plan.transitions}
        s.update(plan, StepResult(plan.step, sampled))
        s.first_tokens((t.request_id for t in plan.transitions), now)
        for t in plan.transitions:
            first[t.request_id] = now
            s.finish(t.request_id)  # one output token each
    return first


def _overload():
    # a long prompt that cannot make its deadline, then a steady stream of short ones that use every step
    long = SchedRequest("long", 2000, 1, 0.0, 0.02)
    shorts = [SchedRequest(f"s{i}", 256, 1, 0.05 * (i + 1), 0.05 * (i + 1) + 1.0) for i in range(200)]
    return [long] + shorts


def test_the_scheduler_bounds_a_deferred_requests_wait():
    never = dict(deferred_wait_factor=1000.0, admission_fallback_accuracy=0.0)
    paper = _run(_sched(**never), 0.0, 6.0, _overload())
    capped = _run(_sched(**never, max_deferred_wait=2.0), 0.0, 6.0, _overload())
    assert "long" not in paper  # starved behind the on-time stream for as long as it lasts
    assert 2.0 < capped["long"] < 2.0 + 10 * TAU  # goes first once it waited 2 s: 8 steps of 256


def test_a_deferred_request_goes_first_after_a_multiple_of_its_fcfs_wait():
    s = _sched(deferred_wait_factor=3.0, overdue_share=1.0, admission_fallback_accuracy=0.0)
    first = _run(s, 0.0, 6.0, _overload())
    # FCFS would have started it at once and taken 2000 / 256 steps: due at 8 τ; 3x that wait is 24 τ = 1.2 s
    assert 1.2 < first["long"] < 1.2 + 10 * TAU
    assert first["s0"] < 1.0 + 0.05  # the on-time stream went first meanwhile


def test_an_overdue_request_takes_a_share_of_each_step_then_goes_first():
    """FCFS would have started it at once and taken 2000 / 256 steps (0.39 s). Overdue from 2x that wait (and
    its TTFT SLO: 1 s) it takes a quarter of each step, the on-time stream the rest; from 4x (1.56 s) it goes
    first outright, with less left to do by then than a request that waited for that moment with no share."""
    shared = _run(_sched(admission_fallback_accuracy=0.0), 0.0, 6.0, _overload())
    outright = _run(_sched(deferred_wait_factor=4.0, overdue_share=1.0, admission_fallback_accuracy=0.0),
                    0.0, 6.0, _overload())
    assert 1.56 + 6 * TAU < outright["long"] < 1.56 + 9 * TAU  # 2000 tokens at 256 per step from 1.56 s
    assert 1.56 < shared["long"] < outright["long"] - 3 * TAU  # ~11 steps of 64 tokens done by 1.56 s
    late = [rid for rid, t in shared.items() if rid != "long" and t > 0.05 * (int(rid[1:]) + 1) + 1.0]
    assert not late  # the on-time stream kept its first-token deadlines while the long one took its share


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_shared_chunk_is_a_share_of_the_whole_steps_budget(ranks):
    """B_0 counts every rank's tokens: the overdue request's chunk is a quarter of it on any number of ranks,
    and the on-time stream keeps the rest."""
    cfg = SchedulerConfig(policy="slo", ttft_slo=1.0, tbt_slo=TAU, estimator_profile="budget",
                          admission_fallback_accuracy=0.0)
    s = Scheduler(cfg, KVLayout.build(16, 32, 8, ranks), 100_000)
    long = SchedRequest("long", 2000 * ranks, 1, 0.0, 0.02)  # overdue from 1 s, first outright from 1.56 s
    stream = [SchedRequest(f"s{i}", 256 * ranks, 1, 0.05 * (i + 1), 0.05 * (i + 1) + 1.0) for i in range(60)]
    shares, now, pending = [], 0.0, [long] + stream
    while now < 1.5:
        while pending and pending[0].arrival <= now:
            s.add(pending.pop(0), now=now)
        plan = s.schedule(now)
        mine = sum(p.end - p.start for p in plan.prefill if p.request_id == "long")
        total = sum(p.end - p.start for p in plan.prefill)
        if 1.05 < now and total:
            shares.append(mine / total)
        now += TAU
        sampled = {rid: 0 for ids in plan.decode for rid in ids} | {t.request_id: 0 for t in plan.transitions}
        s.update(plan, StepResult(plan.step, sampled))
        s.first_tokens((t.request_id for t in plan.transitions), now)
        for t in plan.transitions:
            s.finish(t.request_id)
    assert len(shares) >= 8 and all(0.2 <= x <= 0.3 for x in shares), shares


def test_wrong_predictions_switch_the_scheduler_to_fcfs():
    s = _sched(admission_window=8)
    for i in range(4):  # the engine reports first tokens far later than admission predicted
        s.add(SchedRequest(f"p{i}", 16, 1, 0.0, 1.0), now=0.0)
    plan = s.schedule(0.0)
    assert not s.outcomes.fallback and len(plan.transitions) == 4
    s.update(plan, StepResult(plan.step, {t.request_id: 0 for t in plan.transitions}))
    s.first_tokens([f"p{i}" for i in range(4)], 5.0)
    for i in range(4):
        s.finish(f"p{i}")
    assert s.outcomes.accuracy == 0.0 and s.outcomes.fallback
    s.add(SchedRequest("late", 300, 1, 0.0, 0.01), now=0.0)  # given up (K = 0) ...
    s.add(SchedRequest("next", 100, 1, 0.01, 1.01), now=0.01)
    plan = s.schedule(0.02)
    assert plan.prefill[0].request_id == "late"  # ... but served first: FCFS order while in fallback


def test_fcfs_fallback_ends_once_the_latency_model_predicts_again():
    """In fallback the requests are served in arrival order, and so judged: with a model that is right (here
    every step takes exactly τ), the accuracy climbs back and EDF order returns while the overload (long
    prompts among a stream of short ones) goes on."""
    s = _sched(admission_window=8)
    for i in range(4):  # the engine reports first tokens far later than admission predicted: fallback
        s.add(SchedRequest(f"p{i}", 16, 1, 0.0, 1.0), now=0.0)
    plan = s.schedule(0.0)
    s.update(plan, StepResult(plan.step, {t.request_id: 0 for t in plan.transitions}))
    s.first_tokens([f"p{i}" for i in range(4)], 5.0)
    for i in range(4):
        s.finish(f"p{i}")
    assert s.outcomes.fallback
    # overload from 0.1 s: every 0.5 s a long prompt (6,000 tokens: 23 steps of 256) and shorts every τ
    longs = [SchedRequest(f"L{k}", 6000, 1, 0.1 + 0.5 * k, 0.1 + 0.5 * k + 1.0) for k in range(8)]
    shorts = [SchedRequest(f"s{i}", 128, 1, 0.1 + TAU * i, 0.1 + TAU * i + 1.0) for i in range(80)]
    seen, pending, now = [], sorted(longs + shorts, key=lambda r: r.arrival), 0.1
    while now < 4.0:
        while pending and pending[0].arrival <= now:
            s.add(pending.pop(0), now=now)
        plan = s.schedule(now)
        now += TAU
        s.update(plan, StepResult(plan.step, {t.request_id: 0 for t in plan.transitions}))
        s.first_tokens((t.request_id for t in plan.transitions), now)
        for t in plan.transitions:
            s.finish(t.request_id)
        seen.append(s.outcomes.fallback)
    assert True in seen and seen[-1] is False, "the fallback must end while requests keep coming"
    assert s.outcomes.accuracy >= 0.8 + HYSTERESIS


def test_a_request_that_asks_is_refused_at_once_instead_of_served_late():
    from conflux_cluster.engine.scheduler.admission import DeadlineUnattainable

    s = _sched()  # scheduler.reject_unattainable off: only the request that asks is refused
    s.add(SchedRequest("stale", 300, 1, 0.0, 0.01), now=0.0)  # served late (deferred)
    with pytest.raises(DeadlineUnattainable):
        s.add(SchedRequest("asks", 300, 1, 0.0, 0.01), now=0.0, reject=True)
    s.add(SchedRequest("fits", 300, 1, 0.0, 1.0), now=0.0, reject=True)  # it can make it: queued
    assert set(s.waiting) == {"stale", "fits"}
    fcfs = Scheduler(SchedulerConfig(policy="fcfs", estimator_profile="budget"), KVLayout.build(16, 32, 8, 1), 10_000)
    fcfs.add(SchedRequest("asks", 300, 1, 0.0, 0.01), now=0.0, reject=True)  # no admission: nothing to judge by
    assert "asks" in fcfs.waiting
