"""Moore–Hodgson admission (Alg. 4) against brute force under the fixed-capacity surrogate."""

from __future__ import annotations

from itertools import combinations

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from conflux_cluster.engine.scheduler.admission import EDFQueue, moore_hodgson, on_time_feasible
from conflux_cluster.engine.scheduler.policies import slo_order
from conflux_cluster.engine.scheduler.requests import SchedRequest


def _reqs(jobs):
    out = [SchedRequest(f"r{i}", prompt_len=m + c, max_new_tokens=1, arrival=0.0, ttft_deadline=d, computed=c, seq=i)
           for i, (m, c, d) in enumerate(jobs)]
    return sorted(out, key=lambda r: (r.ttft_deadline, r.seq))


jobs_st = st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 50), st.floats(0.0, 1.0)), min_size=0, max_size=9)


@settings(max_examples=300, deadline=None)
@given(jobs_st, st.integers(1, 2048), st.floats(0.0, 0.3), st.sampled_from([0.02, 0.05, 0.1]))
def test_moore_hodgson_is_optimal(jobs, b0, now, tau):
    edf = _reqs(jobs)
    adm, rej = moore_hodgson(edf, b0, now, tau)
    assert len(adm) + len(rej) == len(edf) and {id(r) for r in adm}.isdisjoint(id(r) for r in rej)
    assert [r.seq for r in adm] == [r.seq for r in edf if r in adm]  # admitted keep EDF order
    rem = lambda rs: [r.remaining_prefill for r in rs]  # noqa: E731
    assert on_time_feasible(rem(adm), [r.ttft_deadline for r in adm], b0, now, tau)
    best = 0
    for k in range(len(edf), 0, -1):
        if any(on_time_feasible(rem(s), [r.ttft_deadline for r in s], b0, now, tau) for s in combinations(edf, k)):
            best = k
            break
    assert len(adm) == best


def test_slo_order_edf_then_sjf():
    # b0 = 100 tokens per τ: by d=0.25 (5 slots) 500 tokens fit.
    edf = _reqs([(400, 0, 0.25), (300, 0, 0.26), (50, 0, 0.27), (20, 0, 5.0), (10, 0, 0.0)])
    q = EDFQueue()
    for r in reversed(edf):
        q.add(r)
    assert q.reqs == edf and q.remaining == [r.remaining_prefill for r in edf]
    order = [r.request_id for r in slo_order(q, 100, 0.0, 0.05)]
    # r4 is already late (K=0) -> rejected; among r0,r1,r2 r0 (largest) is dropped; r3 admitted
    assert order == ["r1", "r2", "r3", "r4", "r0"]


# ---- early rejection at arrival (SchedulerConfig.reject_unattainable) ------------------------------


def _sched(reject: bool):
    from conflux_cluster.engine.kv.layout import KVLayout
    from conflux_cluster.engine.scheduler.config import SchedulerConfig
    from conflux_cluster.engine.scheduler.scheduler import Scheduler

    # budget profile: B_0 = 256 tokens per rank per 50 ms step, 2 ranks -> ~10k prefill tokens per second
    cfg = SchedulerConfig(policy="slo", ttft_slo=1.0, tbt_slo=0.05, estimator_profile="budget",
                          reject_unattainable=reject)
    return Scheduler(cfg, KVLayout.build(16, 32, 8, 2), 100_000)


def test_reject_unattainable_refuses_only_a_newcomer_that_cannot_meet_its_deadline():
    import pickle

    from conflux_cluster.engine.scheduler.admission import DeadlineUnattainable

    s = _sched(reject=True)
    b0 = s.last_budget  # tokens one step can prefill on the idle instance
    per_s = b0 / 0.05
    n_fit = int(0.9 * per_s / 2000)  # 2000-token prompts that fit within one TTFT SLO of prefill
    for i in range(n_fit):
        s.add(SchedRequest(f"ok{i}", 2000, 16, 0.0, 1.0), now=0.0)
    with pytest.raises(DeadlineUnattainable) as err:  # a long one behind them cannot start in time
        s.add(SchedRequest("late", int(0.5 * per_s), 16, 0.0, 1.0), now=0.0)
    assert "late" not in s.waiting and len(s._edf) == n_fit  # left no trace
    e = pickle.loads(pickle.dumps(err.value))  # it crosses Ray as it is
    assert e.ttft_slo_s == 1.0 and e.backlog_s == pytest.approx(n_fit * 2000 / per_s)
    s.add(SchedRequest("short", 100, 16, 0.0, 1.0), now=0.0)  # a short one still fits
    assert "short" in s.waiting
    with pytest.raises(DeadlineUnattainable):  # past its deadline on arrival: K = 0
        s.add(SchedRequest("stale", 10, 16, 0.0, 0.01), now=0.0)


def test_reject_unattainable_off_serves_it_late_and_needs_policy_slo():
    from conflux_cluster.engine.scheduler.config import SchedulerConfig

    s = _sched(reject=False)
    s.add(SchedRequest("stale", 10, 16, 0.0, 0.01), now=0.0)
    assert "stale" in s.waiting  # kept: backfilled after the on-time ones
    with pytest.raises(ValueError, match="reject_unattainable needs a policy with admission"):
        SchedulerConfig(policy="fcfs", reject_unattainable=True)


def test_a_policy_is_one_registered_object():
    """Adding a policy is one ``register`` call: the config accepts it, the scheduler orders by it and
    takes what it declares (here: a fixed token budget, KV waits out of order)."""
    from conflux_cluster.engine.scheduler import policies
    from conflux_cluster.engine.scheduler.config import SchedulerConfig

    lifo = policies.Policy("lifo-test", lambda x: iter(reversed(list(x.waiting))), description="newest first")
    policies.register(lifo)
    try:
        cfg = SchedulerConfig(policy="lifo-test", estimator_profile="budget")
        assert not cfg.uses_estimator()
        with pytest.raises(ValueError, match="already registered"):
            policies.register(lifo)
        with pytest.raises(ValueError, match="unknown scheduling policy 'nope'; known: .*lifo-test"):
            SchedulerConfig(policy="nope")
        from conflux_cluster.engine.kv.layout import KVLayout
        from conflux_cluster.engine.scheduler.scheduler import Scheduler

        s = Scheduler(cfg.model_copy(update={"max_num_batched_tokens": 64}), KVLayout.build(16, 32, 8, 1), 10_000)
        for rid in ("a", "b", "c"):
            s.add(SchedRequest(rid, 64, 4, 0.0, 1.0), now=0.0)
        assert [sl.request_id for sl in s.schedule(0.0).prefill] == ["c"]  # newest first, budget for one
    finally:
        del policies.POLICIES["lifo-test"]


def test_admission_counts_iterations_from_when_the_step_starts():
    """Pipelined, a plan runs after the step in flight: a prefill that fits before its deadline only if
    it could start now is given up (served last), and the on-time request goes first."""
    def first_prefill(starts_at):
        s = _sched(reject=False)
        b0 = s.last_budget
        s.add(SchedRequest("tight", b0, 16, 0.0, 0.06), now=0.0)  # one iteration of prefill, due at 60 ms
        s.add(SchedRequest("loose", 16, 16, 0.0, 1.0), now=0.0)
        return s.schedule(0.0, starts_at=starts_at).prefill[0].request_id

    assert first_prefill(None) == "tight"  # from now: one 50 ms iteration fits before 60 ms
    assert first_prefill(0.03) == "loose"  # from 30 ms on, no iteration ends by 60 ms
