"""Instances that follow the nodes (cluster mode, ``conflux_cluster/serve/elastic.py``): the capacity read
from ``ray.nodes()``, the planner that decides which slots run, the plan published to the slots'
autoscaling policies, the slots ``plan_instances`` builds before any GPU node is up, and the router
routing only to instances with fresh load reports. No Ray cluster here (the
``ray.cluster_utils.Cluster`` run is ``test_elastic_cluster.py``)."""

from __future__ import annotations

import pytest

from conflux_cluster.config import ServeConfig
from conflux_cluster.engine.config import Device
from conflux_cluster.engine.contracts.cluster import InstanceLoad
from conflux_cluster.router.state import RouterState
from conflux_cluster.engine.contracts.cluster import LoadReport, Routed, Unavailable
from conflux_cluster.serve import app as app_module
from conflux_cluster.serve import elastic
from conflux_cluster.serve.app import InstancePlan, instance_bundles, plan_instances


def _node(gpus: float = 0, cpus: float = 8, alive: bool = True) -> dict:
    return {"NodeID": f"n{gpus}-{cpus}", "Alive": alive, "Resources": {"CPU": cpus, "GPU": gpus}}


def test_capacity_counts_instances_that_fit_each_alive_node():
    need = elastic.instance_need(instance_bundles(InstancePlan(0, 8, Device.CUDA), 1.0))
    assert need == {"CPU": pytest.approx(8.1), "GPU": 8.0}
    head = _node(gpus=0, cpus=4)
    assert elastic.node_capacity([head], need) == 0  # no GPU worker up yet
    assert elastic.node_capacity([head, _node(8, 16), _node(8, 16)], need) == 2
    assert elastic.node_capacity([head, _node(16, 32)], need) == 2  # a 16-GPU node hosts two
    assert elastic.node_capacity([head, _node(8, 16), _node(8, 16, alive=False)], need) == 1  # left
    assert elastic.node_capacity([_node(4, 16)], need) == 0  # too few GPUs for N=8


def test_planner_keeps_running_instances_and_fills_the_room():
    p = elastic.SlotPlanner(slots=3)
    assert p.plan(0, set(), 0.0) == []  # no node can host an instance yet
    assert p.plan(1, set(), 1.0) == [0]  # a node joined: slot 0 asked for (starting)
    assert p.plan(1, set(), 2.0) == [0]  # still starting: asked for again, nothing else
    assert p.plan(2, {0}, 3.0) == [0, 1]  # it runs; a second node: slot 1
    assert p.plan(4, {0, 1}, 4.0) == [0, 1, 2]  # more room than slots: the cap holds
    # node of slot 0 leaves: capacity 1; slot 0 stops reporting, slot 1 runs on: it stays, 0 and 2 go
    assert p.plan(1, {1}, 5.0) == [1]
    assert p.plan(1, {0, 1}, 6.0) == [0, 1]  # a stale report still in the window: never evict a live one
    assert p.plan(2, {1}, 7.0) == [0, 1]  # room again: the lowest free slot


def test_policy_reads_the_published_plan(monkeypatch):
    import json

    from ray.experimental import internal_kv

    store: dict = {}
    monkeypatch.setattr(internal_kv, "_internal_kv_put",
                        lambda k, v, overwrite=True, namespace=None: store.__setitem__((namespace, k), v))
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda k, namespace=None: store.get((namespace, k)))
    monkeypatch.setattr(elastic, "REFRESH_S", 0.0)

    class Ctx:
        app_name = "conflux"

    slots = [elastic.NodeFollowing(i) for i in range(3)]
    assert [p(Ctx)[0] for p in slots] == [0, 0, 0]  # nothing published yet (router not up)
    r = elastic.Reconciler("conflux", {"CPU": 8.1, "GPU": 8.0}, slots=3)
    assert r.step([_node(0, 4), _node(8, 16), _node(8, 16)], set(), 0.0) == [0, 1]
    assert json.loads(store[("conflux", "conflux/wanted_slots")]) == [0, 1]
    assert [p(Ctx)[0] for p in slots] == [1, 1, 0]
    r.step([_node(0, 4), _node(8, 16)], {1}, 1.0)  # slot 0's node left
    assert [p(Ctx)[0] for p in slots] == [0, 1, 0]


def test_autoscaling_config_is_accepted_by_serve():
    from ray.serve.config import AutoscalingConfig

    cfg = AutoscalingConfig(**elastic.autoscaling_config(1))
    assert (cfg.min_replicas, cfg.max_replicas, cfg.initial_replicas) == (0, 1, 0)
    assert cfg.policy.policy_function.endswith("elastic.NodeFollowing") or "NodeFollowing" in cfg.policy.policy_function
    assert cfg.policy.policy_kwargs == {"slot": 1}


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
    assert isinstance(decision, Unavailable) and decision.retry_after_s == 1  # no instance up yet: 503
    report(2)
    assert [state.admit(10) for _ in range(3)] == [Routed(2)] * 3  # only the one that reports
    assert state.live_instances() == [2]
    report(0)
    now[0] += 4.0
    report(0)  # xp-0 keeps reporting, xp-2's node died (no more reports)
    now[0] += 2.0
    assert {state.admit(10).instance for _ in range(5)} == {0} and state.live_instances() == [0]
    now[0] += 10.0
    assert isinstance(state.admit(10), Unavailable)  # every node gone


def test_fixed_instances_keep_routing_before_reports():
    state = RouterState(2, "round_robin", seed=0)  # local mode: no staleness rule
    assert isinstance(state.admit(10), Routed)
