"""Cluster mode on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``, several raylets on this
machine): the app deploys before any node can host an XP instance, and instances follow the nodes as
they join and leave (``conflux_cluster/serve/elastic.py``): a running instance is never moved, a free
slot starts on a node that joins. Tiny random-weight model, 1 CPU rank per
instance, so the test measures placement, not model loading."""

from __future__ import annotations

import time

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from conflux_cluster.config import ServeConfig
from conflux_cluster.serve.app import run

pytestmark = [
    pytest.mark.slow,  # three raylets, Serve, instance restarts: minutes on 2 shared cores
    pytest.mark.ray_exclusive,  # a multi-node Cluster: fails beside another test worker's Ray
]
BODY = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}


def _running(slot: int) -> int:
    """xp-<slot>'s running replicas, from Serve's status (a handle call to a slot without a replica
    would make Serve start one: scale from zero)."""
    dep = serve.status().applications["conflux"].deployments[f"xp-{slot}"]
    return dep.replica_states.get("RUNNING", 0)


def _placement(slot: int, timeout_s: float = 10.0):
    """Where xp-<slot>'s replica runs, or None (no running replica: scaled to 0, or restarting)."""
    if not _running(slot):
        return None
    try:
        return serve.get_deployment_handle(f"xp-{slot}", app_name="conflux").placement.remote().result(
            timeout_s=timeout_s)
    except Exception:  # noqa: BLE001 - a replica dying right now: not there
        return None


def _wait(what: str, check, timeout_s: float = 240.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = check()
        if got:
            return got
        time.sleep(1.0)
    deps = serve.status().applications["conflux"].deployments
    states = {name: (d.status, dict(d.replica_states), d.message[-300:]) for name, d in deps.items()}
    alive = [(n["NodeID"][:8], n["Resources"].get("CPU")) for n in ray.nodes() if n.get("Alive")]
    pytest.fail(f"timed out waiting for {what}; deployments {states}; alive nodes {alive}")


def test_instances_follow_nodes_joining_and_leaving():
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})  # too small for an instance (1.1 CPU)
    ray.init(address=c.address, log_to_driver=False)
    try:
        cfg = run(ServeConfig(model="tiny-llama", address=c.address, device="cpu", ranks=1, instances=2,
                              port=0, num_kv_blocks=32))  # deploys with no node to host an instance
        url = f"http://127.0.0.1:{cfg.port}/v1/completions"

        def completes() -> bool:
            try:
                return httpx.post(url, json=BODY, timeout=60).status_code == 200
            except httpx.HTTPError:
                return False

        r = httpx.post(url, json=BODY, timeout=60)
        assert r.status_code == 503 and "retry-after" in r.headers  # no instance up: come back later

        n1 = c.add_node(num_cpus=2)
        first = _wait("an instance on the first node", lambda: _placement(0))
        assert first.replica_node == n1.node_id and first.rank_nodes == [n1.node_id]
        _wait("requests served by it", completes)
        assert _running(1) == 0  # one node, one instance

        n2 = c.add_node(num_cpus=2)
        second = _wait("a second instance on the second node", lambda: _placement(1))
        assert second.replica_node == n2.node_id

        c.remove_node(n1)  # the first node leaves with instance 0; the cluster has room for one
        _wait("slot 0 given up", lambda: _running(0) == 0)
        still = _placement(1)
        assert still is not None and still.replica_node == n2.node_id  # the running instance was kept
        assert still.rank_pids == second.rank_pids  # ... not restarted
        _wait("requests served after the node left", completes)
        n3 = c.add_node(num_cpus=2)  # a node joins again: the free slot 0 starts there
        back = _wait("instance 0 on the new node", lambda: _placement(0))
        assert back.replica_node == n3.node_id
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()
