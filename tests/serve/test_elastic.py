"""Instances that follow the nodes (cluster mode, ``conflux_cluster/serve/elastic.py``): the capacity the
autoscaling policy reads from ``ray.nodes()``, the slots ``plan_instances`` builds before any GPU node is
up, and the router routing only to instances with fresh load reports. No Ray cluster here (the
``ray.cluster_utils.Cluster`` run is ``test_elastic_cluster.py``)."""

from __future__ import annotations

import pytest

from conflux_cluster.config import ServeConfig
from conflux_cluster.router.policies import InstanceLoad
from conflux_cluster.router.state import LoadReport, Overloaded, Routed, RouterState
from conflux_cluster.serve import app as app_module
from conflux_cluster.serve import elastic
from conflux_cluster.serve.app import InstancePlan, instance_bundles, plan_instances


def _node(gpus: float = 0, cpus: float = 8, alive: bool = True) -> dict:
    return {"NodeID": f"n{gpus}-{cpus}", "Alive": alive, "Resources": {"CPU": cpus, "GPU": gpus}}


def test_capacity_counts_instances_that_fit_each_alive_node():
    need = elastic.instance_need(instance_bundles(InstancePlan(0, 8, "cuda"), 1.0))
    assert need == {"CPU": pytest.approx(8.1), "GPU": 8.0}
    head = _node(gpus=0, cpus=4)
    assert elastic.node_capacity([head], need) == 0  # no GPU worker up yet
    assert elastic.node_capacity([head, _node(8, 16), _node(8, 16)], need) == 2
    assert elastic.node_capacity([head, _node(16, 32)], need) == 2  # a 16-GPU node hosts two
    assert elastic.node_capacity([head, _node(8, 16), _node(8, 16, alive=False)], need) == 1  # left
    assert elastic.node_capacity([_node(4, 16)], need) == 0  # too few GPUs for N=8


def test_policy_asks_for_its_slot_while_the_cluster_has_room(monkeypatch):
    import ray

    nodes = [_node(0, 4)]
    monkeypatch.setattr(ray, "nodes", lambda: list(nodes))
    monkeypatch.setattr(elastic, "REFRESH_S", 0.0)
    need = {"CPU": 8.1, "GPU": 8.0}
    slots = [elastic.NodeFollowing(i, 2, need) for i in range(2)]
    assert [p(None)[0] for p in slots] == [0, 0]
    nodes.append(_node(8, 16))
    assert [p(None)[0] for p in slots] == [1, 0]
    nodes.append(_node(8, 17))
    nodes.append(_node(8, 18))  # more nodes than slots: the cap holds
    assert [p(None)[0] for p in slots] == [1, 1]
    del nodes[1:3]
    assert [p(None)[0] for p in slots] == [1, 0]  # one node left: the highest slot gives its replica up


def test_autoscaling_config_is_accepted_by_serve():
    from ray.serve.config import AutoscalingConfig

    cfg = AutoscalingConfig(**elastic.autoscaling_config(1, 3, [{"CPU": 0.1}, {"CPU": 1.0, "GPU": 1.0}]))
    assert (cfg.min_replicas, cfg.max_replicas, cfg.initial_replicas) == (0, 1, 0)
    policy = cfg.policy.get_policy()
    assert policy is elastic.NodeFollowing or getattr(policy, "__name__", "") == "NodeFollowing"
    assert cfg.policy.policy_kwargs == {"slot": 1, "slots": 3, "need": {"CPU": 1.1, "GPU": 1.0}}


def test_cluster_plan_before_any_gpu_node(monkeypatch):
    nodes = [_node(0, 4)]
    monkeypatch.setattr(app_module.ray, "nodes", lambda: list(nodes))
    with pytest.raises(ValueError, match="ranks"):  # nothing to take the ranks from: say so
        plan_instances(ServeConfig(address="auto", device="cuda"))
    plans = plan_instances(ServeConfig(address="auto", device="cuda", ranks=8, instances=3))
    assert [(p.index, p.num_ranks, p.device, p.elastic) for p in plans] == [(i, 8, "cuda", True) for i in range(3)]
    nodes += [_node(8, 16), _node(8, 16)]
    plans = plan_instances(ServeConfig(address="auto", device="cuda"))  # defaults from the nodes up now
    assert [(p.num_ranks, p.elastic) for p in plans] == [(8, True)] * 2
    local = plan_instances(ServeConfig(instances=2, ranks=1))
    assert [p.elastic for p in local] == [False, False]


def test_router_routes_only_to_instances_with_fresh_reports():
    now = [100.0]
    state = RouterState(3, "lowest_load", seed=0, stale_after_s=5.0, clock=lambda: now[0])

    def report(i: int) -> None:
        state.report(LoadReport(i, InstanceLoad(prefill_capacity=1000.0), 0, 0.0, incarnation="a"))

    decision = state.admit(10)
    assert isinstance(decision, Overloaded) and decision.retry_after_s == 1  # no instance up yet: 503
    report(2)
    assert [state.admit(10) for _ in range(3)] == [Routed(2)] * 3  # only the one that reports
    report(0)
    now[0] += 4.0
    report(0)  # xp-0 keeps reporting, xp-2's node died (no more reports)
    now[0] += 2.0
    assert {state.admit(10).instance for _ in range(5)} == {0}
    now[0] += 10.0
    assert isinstance(state.admit(10), Overloaded)  # every node gone


def test_fixed_instances_keep_routing_before_reports():
    state = RouterState(2, "round_robin", seed=0)  # local mode: no staleness rule
    assert isinstance(state.admit(10), Routed)
