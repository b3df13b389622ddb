"""Multi-node: a Ray cluster of several nodes on one machine (``ray.cluster_utils.Cluster``, each node
with its own resources). Joining it like ``conflux serve --address`` must give exactly one XP
instance per node that can host one, with the replica and all its rank actors on that node.

Uses the tiny random-weight preset (byte tokenizer) so that the test measures placement, not
model loading.
"""

from __future__ import annotations

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from conflux_cluster.config import ServeConfig
from conflux_cluster.serve.app import run


pytestmark = pytest.mark.slow  # Ray + Serve deployments: minutes on 2 shared cores

@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():  # another module's Ray must not leak into this one
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})  # too small for an instance
    workers = [c.add_node(num_cpus=3) for _ in range(2)]
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c, [w.node_id for w in workers]
    serve.shutdown()
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def deployed(cluster):
    c, worker_ids = cluster
    cfg = run(ServeConfig(model="tiny-llama", address=c.address, ranks=2, port=0, num_kv_blocks=64))
    return cfg, worker_ids


def test_one_instance_per_node_with_its_ranks_on_that_node(deployed):
    cfg, worker_ids = deployed
    placements = [serve.get_deployment_handle(f"xp-{i}", app_name="conflux").placement.remote().result()
                  for i in range(2)]
    with pytest.raises(Exception):  # no third instance: the head node cannot host one
        serve.get_deployment_handle("xp-2", app_name="conflux").placement.remote().result(timeout_s=5)
    assert sorted(p.replica_node for p in placements) == sorted(worker_ids)
    for p in placements:
        assert p.rank_nodes == [p.replica_node] * 2
    r = httpx.post(f"http://127.0.0.1:{cfg.port}/v1/completions", timeout=120,
                   json={"model": "tiny-llama", "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_dead_rank_actor_gets_its_instance_rebuilt(deployed):
    """Kill one rank actor's process: the instance sees it and rebuilds its ranks in place (new rank
    actors in its placement group, so on the same node) and requests succeed again."""
    import os
    import signal
    import time

    cfg, _ = deployed
    h = serve.get_deployment_handle("xp-0", app_name="conflux")
    before = h.placement.remote().result()
    os.kill(before.rank_pids[1], signal.SIGKILL)  # a process this test's deployment started
    deadline, after = time.time() + 240, None
    while time.time() < deadline:
        try:
            after = h.placement.remote().result(timeout_s=10)
            if len(after.rank_pids) == 2 and set(after.rank_pids).isdisjoint(before.rank_pids):
                break
        except Exception:  # noqa: BLE001 - the replica is being replaced
            pass
        time.sleep(2)
    assert after is not None and len(after.rank_pids) == 2 and set(after.rank_pids).isdisjoint(before.rank_pids)
    assert after.rank_nodes == [after.replica_node] * 2
    r = httpx.post(f"http://127.0.0.1:{cfg.port}/v1/completions", timeout=120,
                   json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
