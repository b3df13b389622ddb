"""``priority`` (lower first, vLLM's rule) in every scheduling policy: a tier per priority value, the
policy's own order inside it."""

from __future__ import annotations

import pytest

from conflux_cluster.engine.kv.layout import KVLayout
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.scheduler.policies import by_priority, fcfs_order, sjf_order
from conflux_cluster.engine.scheduler.requests import SchedRequest
from conflux_cluster.engine.scheduler.scheduler import Scheduler


def _req(rid: str, prompt: int, arrival: float, priority: int = 0, seq: int = 0) -> SchedRequest:
    return SchedRequest(rid, prompt, 4, arrival, arrival + 10.0, seq=seq, priority=priority)


def test_fcfs_becomes_priority_then_arrival_and_equal_priorities_keep_the_policy_order():
    reqs = [_req("a", 10, 0.0, 1, 0), _req("b", 50, 1.0, 0, 1), _req("c", 5, 2.0, 1, 2), _req("d", 20, 3.0, 0, 3)]
    assert [r.request_id for r in by_priority(fcfs_order(reqs), reqs)] == ["b", "d", "a", "c"]
    assert [r.request_id for r in by_priority(sjf_order(reqs), reqs)] == ["d", "b", "c", "a"]  # SRPT per tier
    same = [_req(r.request_id, r.prompt_len, r.arrival, 2, r.seq) for r in reqs]
    order = fcfs_order(same)
    assert by_priority(order, same) is order  # one priority: the policy's own (lazy) order, untouched


@pytest.mark.parametrize("policy", ["fcfs", "srpt", "slo"])
def test_every_policy_prefills_the_lowest_priority_value_first(policy):
    sched = Scheduler(SchedulerConfig(policy=policy, max_num_batched_tokens=32, token_budget="fixed"),
                      KVLayout.build(16, 32, 8, 1), 256)
    for i, (prompt, priority) in enumerate([(64, 5), (64, 0), (64, 3), (16, 5)]):
        sched.add(_req(f"r{i}", prompt, 0.0, priority), now=0.0)
    plan = sched.schedule(0.0)
    assert plan.prefill and plan.prefill[0].request_id == "r1"
