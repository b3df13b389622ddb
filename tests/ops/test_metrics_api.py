"""The recording API's pure parts: SLO judgement, plan → per-rank sample, plan → BatchLoad, and
the sample of a real EngineCore step (the values the XP instance records every iteration)."""

from __future__ import annotations

import pytest

from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.contracts.step import PrefillSlice, StepPlan
from conflux_cluster.engine.scheduler.estimator import (Affine, BatchLoad, EstimatorProfile,
                                                        LatencyEstimator)
from conflux_cluster.engine.scheduler.estimator import plan_batch_load
from conflux_cluster.metrics import IterationSample, judge_slo, sample_from_engine
from conflux_cluster.slo import SLO

TARGETS = SLO(ttft_s=1.0, tbt_s=0.1)


@pytest.mark.parametrize("times,expect", [
    ([], (False, False, False)),  # no token at all
    ([1.0], (True, True, True)),  # exactly on the TTFT deadline
    ([1.0001], (False, True, False)),
    ([0.5, 1.1, 1.2], (True, True, True)),  # deadlines 1.0, 1.1, 1.2: all on time
    ([0.5, 1.1001], (True, False, False)),
    # the cumulative deadline lets a later token catch up after an early first token:
    ([0.1, 1.05, 1.15], (True, True, True)),  # gap 0.95 > TBT, still before 1.1 and 1.2
    ([1.5, 1.55], (False, False, False)),  # late first token makes token 2 (due 1.1) late too
])
def test_judge_slo(times, expect):
    v = judge_slo(10.0, [10.0 + t for t in times], TARGETS)
    assert (v.ttft_met, v.tbt_met, v.met) == expect


def test_slo_targets_reject_nonpositive():
    with pytest.raises(ValueError):
        SLO(ttft_s=0.0, tbt_s=0.1)


def _plan() -> StepPlan:
    #  rank 0: a[0:10) b[20:25)     rank 1: a[10:16)     rank 2: nothing
    #  decode: r0 {x}, r1 {}, r2 {y, z}
    return StepPlan(step=7, prefill=[PrefillSlice("a", 0, 0, 10), PrefillSlice("a", 1, 10, 16),
                                     PrefillSlice("b", 0, 20, 25)],
                    decode=[["x"], [], ["y", "z"]])


def test_sample_from_plan_counts_tokens_per_rank():
    s = IterationSample.from_plan(_plan(), 3, measured_s=0.02, estimated_s=0.025)
    assert list(s.prefill_tokens) == [15, 6, 0]
    assert list(s.decode_tokens) == [1, 0, 2]
    assert (s.measured_s, s.estimated_s) == (0.02, 0.025)


def test_plan_batch_load_matches_the_estimators_inputs():
    load = plan_batch_load(_plan(), [100, 0, 300], 3)
    assert load == BatchLoad(prefill_tokens=(15, 6, 0), decode_tokens=(1, 0, 2),
                             decode_context=(100, 0, 300), prefill_chunks=((16, 0), (5, 20)))
    prof = EstimatorProfile(model="m", hardware="h", num_ranks=3, num_layers=2,
                            f_gemm=Affine(1e-5, 1e-4), f_prefill_attn=Affine(1e-8, 0.0),
                            f_decode_attn=Affine(1e-7, 1e-5), f_comm=Affine(1e-6, 1e-5))
    est = LatencyEstimator(prof).estimate(load)
    # T = L·(f_gemm(max_r n_p+n_d) + max(T_P, T_D)); n_max = 16 (rank 0), T_D from rank 2's 300
    t_d = 1e-7 * 300 + 1e-5
    t_p = (1e-6 * 15 + 1e-5) + 1e-8 * ((16 * (0 + 17 / 2) + 5 * (20 + 6 / 2)) / 3)
    assert est.total == pytest.approx(2 * ((1e-5 * 16 + 1e-4) + max(t_p, t_d)))


def test_sample_from_a_real_engine_step(tmp_path):
    """EngineCore.last_plan / last_decode_context feed the per-rank sample of the step."""
    from conflux_cluster.engine.sampling_params import SamplingParams
    from tests.engine.helpers import byte_engine, hf_tiny_model, save_hf

    path = save_hf(hf_tiny_model("qwen3"), tmp_path / "tiny")
    core = byte_engine(str(path), chunk=16)
    assert sample_from_engine(core, 0.01) is None  # nothing ran yet
    core.add_request(GenerateRequest("r", list(range(40)), SamplingParams(max_tokens=3, temperature=0.0)))
    core.step()
    s = sample_from_engine(core, 0.01, control_plane_s=0.001)
    assert list(s.prefill_tokens) == [16] and list(s.decode_tokens) == [0]
    assert 0.0 < s.kv_cache_usage[0] <= 1.0  # the prompt's KV is reserved
    assert s.estimated_s is not None and s.estimated_s > 0  # policy slo (the default): the step was estimated
    while core.has_unfinished():
        core.step()
        if core.last_plan.decode_tokens_per_rank() == [1]:
            s = sample_from_engine(core, 0.01)
            assert list(s.decode_tokens) == [1] and list(s.prefill_tokens) == [0]
            assert list(s.decode_context_tokens)[0] >= 40  # the prompt is in its decode context
            # the engine judged admission's verdict on it when its first token came (engine/scheduler/outcomes.py)
            assert core.scheduler.outcomes.predictions == 1
            assert s.admission_fallback is False and s.admission_accuracy is None  # too few judged for a rate
            break
    else:
        pytest.fail("the request never decoded")


def test_step_outputs_carry_when_the_request_was_first_scheduled(tmp_path):
    """vLLM's queue time ends when a request's first prefill chunk is scheduled: every StepOutput of the
    request carries that instant (monotonic, after its arrival, before its first token), unchanged later."""
    import time

    from conflux_cluster.engine.sampling_params import SamplingParams
    from tests.engine.helpers import byte_engine, hf_tiny_model, save_hf

    core = byte_engine(str(save_hf(hf_tiny_model("qwen3"), tmp_path / "tiny")), chunk=16)
    arrival = time.monotonic() - 5.0
    params = SamplingParams(max_tokens=3, temperature=0.0)
    core.add_request(GenerateRequest("r", list(range(40)), params, arrival=time.time() - 5.0))  # stamped 5 s ago
    first_step = time.monotonic()
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert len(outs) == 3 and len({o.scheduled_at for o in outs}) == 1
    assert arrival + 5.0 <= first_step <= outs[0].scheduled_at <= time.monotonic()


def test_every_instance_series_carries_vllms_engine_label_and_phase_histograms():
    from conflux_cluster.metrics import ENGINE, METRIC_SPECS, MetricKind, SPECS_BY_NAME

    assert all(ENGINE in s.tag_keys for s in METRIC_SPECS if s.scope == "instance")
    for phase in ("queue", "prefill", "decode", "inference"):
        spec = SPECS_BY_NAME[f"vllm_request_{phase}_time_seconds"]
        assert spec.kind is MetricKind.HISTOGRAM and spec.vllm_name == f"vllm:request_{phase}_time_seconds"


HOSTILE_PRIORITIES = [10 ** 9, -10 ** 9, 2 ** 63 - 1, -(2 ** 63), *range(-5000, 5000)]  # 10,004 distinct


def test_the_priority_label_is_bounded_however_many_priorities_clients_send():
    from conflux_cluster.engine.contracts.request import PRIORITY_BUCKETS, priority_bucket
    from conflux_cluster.metrics import PRIORITY, IngressMetrics

    class Counter:  # the Ray counter, recording the label values it was incremented with
        def __init__(self) -> None:
            self.labels: set[str] = set()

        def inc(self, value: float, tags: dict[str, str]) -> None:
            self.labels.add(tags[PRIORITY])

    metrics = IngressMetrics.__new__(IngressMetrics)
    metrics._m = {"conflux_requests_by_priority": (counter := Counter())}
    for p in HOSTILE_PRIORITIES:
        metrics.record_priority(p)
    assert counter.labels == set(PRIORITY_BUCKETS) and len(PRIORITY_BUCKETS) == 23
    assert [priority_bucket(p) for p in (-(10 ** 9), -11, -10, 0, 3, 10, 11, 10 ** 9)] == \
        ["<-10", "<-10", "-10", "0", "3", "10", ">10", ">10"]
