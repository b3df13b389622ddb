"""End to end, opt-in: the real `conflux serve` app (SmolLM2, 1 XP instance x 2 CPU ranks, policy
slo) serves HTTP requests; a real Prometheus scrapes Ray; every dashboard query must return data
for the real model. Minutes on a busy 2-core machine, so it runs only with CONFLUX_OPS_E2E=1:

    CONFLUX_OPS_E2E=1 .venv/bin/python -m pytest -q tests/ops/test_prometheus_serve.py
"""

from __future__ import annotations

import os

import pytest

from tests.ops.prom_server import (PROMETHEUS, SKIP_REASON, dashboard_queries, empty_queries,
                                   free_port, running_prometheus)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray_exclusive,  # Ray's metrics export to Prometheus, as in test_prometheus.py
    pytest.mark.skipif(PROMETHEUS is None, reason=SKIP_REASON),
    pytest.mark.skipif(os.environ.get("CONFLUX_OPS_E2E") != "1",
                       reason="end-to-end serve + Prometheus check: set CONFLUX_OPS_E2E=1"),
]
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import httpx
    import ray
    from ray import serve

    from conflux_cluster.config import ServeConfig
    from conflux_cluster.serve.app import run

    if ray.is_initialized():
        ray.shutdown()
    metrics_port = free_port()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=metrics_port)
    try:
        cfg = run(ServeConfig(port=0, instances=1, ranks=2, max_model_len=512,
                              num_kv_blocks=64, scheduler={"policy": "slo"}))
        base = f"http://127.0.0.1:{cfg.port}"
        body = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 8,
                "temperature": 0}
        for _ in range(3):
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
        bad = httpx.post(f"{base}/v1/completions", json={**body, "model": "nope"}, timeout=60)
        assert bad.status_code == 404
        probes = ["ray_vllm_request_success_total", "ray_vllm_kv_cache_usage_perc",
                  "ray_conflux_iterations_total", "ray_conflux_router_decisions_total",
                  "ray_conflux_request_errors_total"]
        with running_prometheus(metrics_port, tmp_path_factory.mktemp("prom"), probes) as prom:
            yield prom
    finally:
        serve.shutdown()
        ray.shutdown()


def test_real_app_feeds_every_dashboard_query(served):
    queries = dashboard_queries({"model_name": MODEL})
    empty = empty_queries(served, queries)
    assert not empty, f"dashboard queries with no data from the real app: {empty}"
    assert served.scalar(f'sum(ray_vllm_request_success_total{{model_name="{MODEL}"}})') == 3
    assert served.scalar(f'sum(ray_conflux_slo_requests_total{{model_name="{MODEL}"}})') == 3
    assert served.scalar('sum(ray_conflux_request_errors_total{code="404"})') == 1
    # vLLM's phase histograms from the engine's scheduling stamp, and its engine label (instance 0)
    for phase in ("queue", "prefill", "decode", "inference"):
        assert served.scalar(f'sum(ray_vllm_request_{phase}_time_seconds_count{{engine="0"}})') == 3, phase
    # policy slo: every recorded iteration has an estimate next to its measurement
    assert served.scalar("sum(ray_conflux_iteration_estimated_seconds_total)") > 0
