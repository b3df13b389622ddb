"""A real Prometheus scrapes a real local Ray; every dashboard query is evaluated against it.

Ray runs with its metrics-export port on a free port. ConfluxServe metrics are recorded through
the recording API inside a Ray actor (an XP-instance stand-in driving ``InstanceMetrics`` with a
deterministic timeline) and inside a Ray Serve replica (``RouterMetrics`` + ``IngressMetrics``).
A ``prometheus`` process (Debian package) with a generated config scrapes that port; the test
then runs every dashboard expr through ``/api/v1/query`` and checks the exact values of the core
series against what was recorded.
"""

from __future__ import annotations

import sys

import pytest

from conflux_cluster.metrics import SLOTargets, judge_slo
from tests.ops.prom_server import (PROMETHEUS, SKIP_REASON, dashboard_queries, empty_queries,
                                   free_port, running_prometheus)

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason=SKIP_REASON)
MODEL, INSTANCES, RANKS = "smollm2-test", ("xp-0", "xp-1"), 2
SLO = SLOTargets(ttft_s=0.5, tbt_s=0.1)
# Deterministic request timelines (seconds after each request's arrival): token delta times.
# (No value sits on a histogram bucket bound, so float rounding cannot move it across one.)
TIMELINES = {
    "fast": [0.2, 0.32, 0.44, 0.56],  # meets TTFT and every TBT deadline (0.6, 0.7, 0.8)
    "late-first": [0.9, 1.03],  # misses TTFT (0.9 > 0.5); token 2 deadline 0.6 also missed
    "slow-decode": [0.12, 0.83, 0.95],  # TTFT met; token 2 at 0.83 > 0.5 + 0.1: TBT missed
}
PROMPT_TOKENS = 17
KV_USE = {"xp-0": 0.25, "xp-1": 0.5}


def _record_instance(instance_id: str) -> dict:
    """Runs inside a Ray actor: drive InstanceMetrics through one deterministic episode."""
    from conflux_cluster.engine.plan import PrefillSlice, PrefixHit, StepPlan
    from conflux_cluster.metrics import InstanceMetrics, IterationSample
    from conflux_cluster.router.policies import InstanceLoad

    m = InstanceMetrics(MODEL, instance_id, RANKS, slo=SLO)
    t0 = 1000.0
    verdicts = {}
    for rid, times in TIMELINES.items():
        m.on_request_arrival(rid, PROMPT_TOKENS, arrival=t0)
        for t in times:
            m.on_tokens(rid, 1, now=t0 + t)
        verdicts[rid] = m.on_request_finished(rid, "stop", now=t0 + times[-1])
    m.on_request_arrival("aborted", PROMPT_TOKENS, arrival=t0)
    m.on_request_finished("aborted", "abort", now=t0 + 0.05)
    for step in range(4):
        # The same iteration, built by hand on xp-0 and from the engine's StepPlan on xp-1.
        extra = dict(decode_context_tokens=[300, 100], kv_cache_usage=[0.2, 0.3])
        if instance_id == "xp-0":
            sample = IterationSample(measured_s=0.040, estimated_s=0.050, control_plane_s=0.0004,
                                     prefill_tokens=[64 + step, 64], decode_tokens=[3, 1],
                                     prefix_queries=160 if step == 0 else 0, prefix_hits=32 if step == 0 else 0,
                                     **extra)
        else:
            plan = StepPlan(step=step, prefill=[PrefillSlice("p", 0, 0, 64 + step),
                                                PrefillSlice("p", 1, 64 + step, 128 + step)],
                            decode=[["a", "b", "c"], ["d"]],
                            finished=["e"] if step == 3 else [], preempted=["e"] if step == 3 else [],
                            prefix_hits=[PrefixHit("p", 0, (1, 2), 16)] if step == 0 else [],
                            prefix_queries=160 if step == 0 else 0)
            sample = IterationSample.from_plan(plan, RANKS, 0.040, 0.050, 0.0004, **extra)
        m.record_iteration(sample)
    if instance_id == "xp-0":
        m.record_queue(num_running=2, num_waiting=1, kv_cache_usage=KV_USE[instance_id])
    else:
        m.record_load(InstanceLoad(num_waiting=1, num_decoding=2,
                                   kv_utilization=KV_USE[instance_id], num_ranks=RANKS))
    assert m.num_tracked_requests == 0
    return {rid: (v.ttft_met, v.tbt_met, v.met) for rid, v in verdicts.items()}


@pytest.fixture(scope="module")
def ray_metrics_port():
    import ray

    if ray.is_initialized():
        ray.shutdown()  # a previous module's local Ray: we need one with our export port
    port = free_port()
    # Ship this module's helpers to workers by value (pytest's module name is not importable
    # there).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address="local", num_cpus=2, include_dashboard=False, _metrics_export_port=port,
             logging_level="ERROR")
    try:
        yield port
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def recorded(ray_metrics_port):
    """Record metrics in two instance actors and one Serve replica (router + ingress)."""
    import ray
    from ray import serve

    @ray.remote(num_cpus=0)
    class InstanceStandIn:
        def run(self, instance_id):
            self._keep = instance_id
            return _record_instance(instance_id)

    actors = [InstanceStandIn.remote() for _ in INSTANCES]
    verdicts = ray.get([a.run.remote(i) for a, i in zip(actors, INSTANCES)])

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class RouterStandIn:
        def __init__(self):
            from conflux_cluster.metrics import IngressMetrics, RouterMetrics

            self.router = RouterMetrics("lowest_normalized_load")
            self.ingress = IngressMetrics(MODEL)

        def __call__(self, decisions: list[str]) -> int:
            for inst in decisions:
                self.router.record_decision(inst, 20e-6)
            self.router.record_loads({"xp-0": 0.4, "xp-1": 0.6})
            self.ingress.record_error(400)
            return len(decisions)

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    handle = serve.run(RouterStandIn.bind(), name="conflux-metrics-test", route_prefix=None)
    assert handle.remote(["xp-0", "xp-1", "xp-0"]).result(timeout_s=60) == 3
    yield {"verdicts": verdicts, "actors": actors}  # actors stay alive: their gauges persist


@pytest.fixture(scope="module")
def prometheus(ray_metrics_port, recorded, tmp_path_factory):
    probes = ["ray_vllm_request_success_total", "ray_vllm_kv_cache_usage_perc",
              "ray_conflux_router_decisions_total", "ray_conflux_request_errors_total",
              "ray_conflux_rank_prefill_tokens_total", "ray_vllm_time_to_first_token_seconds_count"]
    with running_prometheus(ray_metrics_port, tmp_path_factory.mktemp("prometheus"),
                            probes) as prom:
        yield prom


def test_target_is_up(prometheus):
    assert prometheus.scalar('up{job="ray"}') == 1.0


def test_every_dashboard_query_evaluates(prometheus):
    queries = dashboard_queries()
    assert len(queries) > 20
    # Everything the dashboard reads is recorded above, so no panel may be empty.
    empty = empty_queries(prometheus, queries)
    assert not empty, f"queries with no series: {empty}"


def test_core_series_have_the_recorded_values(prometheus, recorded):
    p = prometheus
    n_inst = len(INSTANCES)
    # Requests: 3 finished with "stop" + 1 "abort" per instance.
    assert p.scalar('sum(ray_vllm_request_success_total{finished_reason="stop"})') == 3 * n_inst
    assert p.scalar('sum(ray_vllm_request_success_total{finished_reason="abort"})') == n_inst
    assert p.scalar("sum(ray_vllm_prompt_tokens_total)") == 4 * PROMPT_TOKENS * n_inst
    n_tokens = sum(len(t) for t in TIMELINES.values())
    assert p.scalar("sum(ray_vllm_generation_tokens_total)") == n_tokens * n_inst
    # TTFT / ITL: one observation per request with a token / per later token delta, in the
    # right buckets (Ray rebuilds _sum from bucket midpoints, so buckets are the exact part).
    ttfts = [t[0] for t in TIMELINES.values()]
    gaps = [b - a for t in TIMELINES.values() for a, b in zip(t, t[1:])]
    assert p.scalar("sum(ray_vllm_time_to_first_token_seconds_count)") == len(ttfts) * n_inst
    assert p.scalar("sum(ray_vllm_inter_token_latency_seconds_count)") == len(gaps) * n_inst
    for le in ("0.1", "0.25", "0.5", "1.0"):
        got = p.scalar(f'sum(ray_vllm_time_to_first_token_seconds_bucket{{le="{le}"}})')
        assert got == sum(t <= float(le) for t in ttfts) * n_inst, le
    for le in ("0.1", "0.15", "0.5", "1.0"):
        got = p.scalar(f'sum(ray_vllm_inter_token_latency_seconds_bucket{{le="{le}"}})')
        assert got == sum(g <= float(le) for g in gaps) * n_inst, le
    # KV use: the last value each instance set.
    for inst, use in KV_USE.items():
        assert p.scalar(f'ray_vllm_kv_cache_usage_perc{{xp_instance="{inst}"}}') == use
    assert p.scalar("max(ray_vllm_num_requests_running)") == 2


def test_slo_counters_match_the_definition(prometheus, recorded):
    expected = {rid: judge_slo(0.0, t, SLO) for rid, t in TIMELINES.items()}
    # the actor's verdicts are the pure function's
    for per_instance in recorded["verdicts"]:
        assert per_instance == {r: (v.ttft_met, v.tbt_met, v.met) for r, v in expected.items()}
    assert expected["fast"].met and not expected["late-first"].ttft_met
    assert expected["slow-decode"].ttft_met and not expected["slow-decode"].tbt_met
    n_inst = len(INSTANCES)
    p = prometheus
    # the aborted request is not judged
    assert p.scalar("sum(ray_conflux_slo_requests_total)") == len(TIMELINES) * n_inst
    for metric, field in (("met", "met"), ("ttft_met", "ttft_met"), ("tbt_met", "tbt_met")):
        want = sum(getattr(v, field) for v in expected.values()) * n_inst
        assert p.scalar(f"sum(ray_conflux_slo_{metric}_total)") == want, metric


def test_rank_and_router_series(prometheus):
    p = prometheus
    # 4 iterations per instance; rank 0 got 64..67 prefill tokens, rank 1 got 64 each.
    assert p.scalar("sum(ray_conflux_iterations_total)") == 4 * 2
    assert p.scalar('sum(ray_conflux_rank_prefill_tokens_total{rank="0"})') == (64 * 4 + 6) * 2
    assert p.scalar('sum(ray_conflux_rank_prefill_tokens_total{rank="1"})') == 64 * 4 * 2
    assert p.scalar('sum(ray_conflux_rank_decode_tokens_total{rank="1"})') == 1 * 4 * 2
    assert p.scalar("sum(ray_conflux_iteration_measured_seconds_total)") == pytest.approx(
        0.040 * 4 * 2)
    assert p.scalar("sum(ray_conflux_iteration_estimated_seconds_total)") == pytest.approx(
        0.050 * 4 * 2)
    assert p.scalar('sum(ray_conflux_iteration_estimate_ratio_bucket{le="0.8"})') == 4 * 2
    assert p.scalar('sum(ray_conflux_iteration_estimate_ratio_bucket{le="0.67"})') == 0
    assert p.scalar('max(ray_conflux_rank_decode_context_tokens{rank="0"})') == 300
    assert p.scalar('ray_conflux_router_decisions_total{xp_instance="xp-0"}') == 2
    assert p.scalar('ray_conflux_router_decisions_total{xp_instance="xp-1"}') == 1
    assert p.scalar('ray_conflux_request_errors_total{code="400"}') == 1
    assert p.scalar("sum(ray_vllm_prefix_cache_queries_total)") == 160 * 2
    assert p.scalar("sum(ray_vllm_prefix_cache_hits_total)") == 32 * 2


def test_kuberay_app_builder_is_accepted_by_serve(ray_metrics_port):
    """The RayService import path builds the real application graph through Serve's own builder
    call (cluster mode: one XP instance per alive node; here the local node, on CPU)."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.deployment import Application

    from conflux_cluster.kuberay import app_builder

    app = call_user_app_builder_with_args_if_necessary(
        app_builder, {"device": "cpu", "ranks": 2, "cpus_per_rank": 0.5,
                      "scheduler": {"policy": "slo"}})
    assert isinstance(app, Application)
    with pytest.raises(Exception, match="rankz"):  # a typo in args names the field
        call_user_app_builder_with_args_if_necessary(app_builder, {"rankz": 2})
