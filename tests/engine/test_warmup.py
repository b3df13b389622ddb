"""Warm-up before ready (engine/runtime/warmup.py).

CPU: after a warm-up that reaches every path (multi-chunk prefill over all ranks, transitions to
every rank, several decode batch sizes, mixed steps) the engine serves the same tokens as a fresh
one, greedy and unseeded-random alike, and no KV block or scheduler entry is left; on 1 rank
in-process and on 2 gloo ranks. A zero time budget stops early and still drains. GPU (``gpu``):
every CUDA graph bucket exists before the first step; the CUDA warm-up shape leaves nothing behind.
"""

from __future__ import annotations

import time

import pytest
import torch

from conflux_cluster.engine.config import Device, EngineConfig
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.cuda_graphs import default_buckets
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.scheduler.estimator import BatchLoad
from conflux_cluster.engine.scheduler.fitting.online import OnlineRefit
from conflux_cluster.engine.tokenizer import ByteTokenizer
from conflux_cluster.engine.runtime.warmup import ID_PREFIX, WarmupShape, decode_context_ladder, warm_up

from .helpers import byte_engine, drain

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# every path on CPU: chunks of 8 tokens per rank make the 24-token prompt a multi-chunk prefill
SHAPE = WarmupShape(decodes_per_rank=3, short_prompt=4, max_prompt=40, long_max_tokens=2, ladder=(),
                    time_budget_s=60.0)
PROMPTS = {"a": [5, 17, 99, 3, 250, 42, 7], "b": list(range(30, 63))}


def _serve(core: EngineCore) -> dict[str, list[int]]:
    core.add_request(GenerateRequest("a", PROMPTS["a"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
    core.add_request(GenerateRequest("b", PROMPTS["b"],
                                     SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)))  # unseeded
    return drain(core)


def _assert_idle(core: EngineCore) -> None:
    assert not core.has_unfinished() and not core.requests
    core.scheduler.check_invariants()
    assert core.scheduler.kv.is_empty()


def test_warm_up_reaches_every_path_and_changes_no_token():
    core = byte_engine("tiny-llama", chunk=8, num_kv_blocks=256)
    plans: list = []
    execute = core.executor.execute
    core.executor.execute = lambda step_input: (plans.append(step_input), execute(step_input))[1]
    report = warm_up(core, SHAPE)
    core.executor.execute = execute
    assert report.missing(1) == [], report.describe(1)
    assert report.multi_chunk and report.mixed_steps >= 1 and report.decode_batches[0] >= {1, 2, 3}
    assert report.requests == 4 and not report.over_budget and report.seconds < 30
    sent = {r.request_id for s in plans for r in s.new_requests}
    assert sent and all(rid.startswith(ID_PREFIX) for rid in sent)
    _assert_idle(core)
    core.executor.check_invariants()
    assert core.executor.worker.kv.num_free_blocks == core.executor.worker.kv.num_blocks
    assert not core.executor.worker.requests
    assert _serve(core) == _serve(byte_engine("tiny-llama", chunk=8, num_kv_blocks=256))


def test_zero_time_budget_stops_early_and_drains():
    core = byte_engine("tiny-llama", chunk=8, num_kv_blocks=256)
    report = warm_up(core, WarmupShape(3, 4, 40, 2, ladder=(24, 64), time_budget_s=0.0))
    assert report.over_budget and report.ladder_done == 0
    _assert_idle(core)
    core.executor.check_invariants()
    assert _serve(core) == _serve(byte_engine("tiny-llama", chunk=8, num_kv_blocks=256))


def test_warm_up_needs_an_idle_engine_and_reports_leaks():
    core = byte_engine("tiny-llama")
    core.add_request(GenerateRequest("user", [1, 2, 3], SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="idle"):
        warm_up(core, SHAPE)
    drain(core)
    with pytest.raises(RuntimeError, match="still hold KV"):
        warm_up(core, SHAPE, rank_kv_blocks_held=lambda: [0, 3])


def test_a_scheduler_that_plans_nothing_is_reported_not_waited_on(tmp_path):
    """A profile under which no chunk of a long prompt fits the TBT SLO once its context is large (the
    scheduler then plans nothing for it): the warm-up names the request, aborts it, goes on, drains."""
    from conflux_cluster.engine.scheduler.estimator import Affine, EstimatorProfile

    from .helpers import tiny_long_source

    src = tiny_long_source(4096)
    slow_history = EstimatorProfile(model="tiny-long", hardware="cpu", num_ranks=1, num_layers=1,
                                    f_gemm=Affine(1e-6, 1e-3), f_prefill_attn=Affine(0.0, 0.0),
                                    f_decode_attn=Affine(0.0, 0.0), f_comm=Affine(0.0, 0.0),
                                    f_prefill_kv=Affine(1e-4, 0.0))  # 0.1 s per 1000 tokens of history
    slow_history.to_json(tmp_path / "p.json")
    cfg = EngineConfig(model="tiny-long", dtype="float32", block_size=16, num_kv_blocks=512, load_progress=False,
                       scheduler=SchedulerConfig(estimator_profile=str(tmp_path / "p.json"), tbt_slo=0.1))
    core = EngineCore(cfg, LocalExecutor(cfg, src), source=src, tokenizer=ByteTokenizer())
    report = warm_up(core, WarmupShape(2, 4, 3000, 2, ladder=(24, 64), time_budget_s=60.0))
    if report.stalled:  # as long as the scheduler lets a prefill starve (its liveness is not this test's)
        assert report.stalled == [f"{ID_PREFIX}2 (3000 prompt tokens)"]  # the phase-2 prompt
    assert report.ladder_done == 2 and not report.over_budget
    _assert_idle(core)
    core.executor.check_invariants()


def test_default_cpu_shape_is_small():
    core = byte_engine("tiny-llama", num_kv_blocks=256)
    report = warm_up(core)  # the shape a CPU server uses: 2 forward passes and a step that frees
    assert report.requests == 2 and report.steps <= 4 and report.ladder_done == 0
    assert report.transition_ranks == {0} and report.mixed_steps == 1
    _assert_idle(core)


def test_decode_context_ladder():
    assert decode_context_ladder(10_000) == (24, 4160)  # one split; two splits and a part
    assert decode_context_ladder(100) == (24,)
    assert WarmupShape.for_device(Device.CPU).ladder == ()
    assert WarmupShape.for_device(Device.CUDA, 4096).ladder == (24,)


def test_two_gloo_ranks_every_path_then_same_tokens():
    from conflux_cluster.engine.runtime.multiproc import MultiprocExecutor

    cfg = EngineConfig(model="tiny-llama", dtype="float32", num_ranks=2, block_size=4, num_kv_blocks=256,
                       num_threads=1, load_progress=False, scheduler=SchedulerConfig(max_num_batched_tokens=8))
    src = resolve_model("tiny-llama")
    with MultiprocExecutor(cfg, src) as ex:
        core = EngineCore(cfg, ex, source=src, tokenizer=ByteTokenizer())
        report = warm_up(core, SHAPE, rank_kv_blocks_held=lambda: [0 if free else 1 for free in ex.kv_free()])
        assert report.missing(2) == [], report.describe(2)
        assert report.transition_ranks == {0, 1} and report.prefill_ranks == {0, 1}
        assert all(len(b) >= 2 for b in report.decode_batches.values())
        _assert_idle(core)
        assert all(ex.kv_free())
        got = _serve(core)
    # the XP instance's tokens equal the single-rank engine's (tests/xp), so compare with a fresh one
    one = cfg.model_copy(update={"num_ranks": 1})
    assert got == _serve(EngineCore(one, LocalExecutor(one, src), source=src, tokenizer=ByteTokenizer()))


@pytest.mark.gpu
@cuda_only
def test_cuda_graphs_all_buckets_before_the_first_step_and_cuda_shape_drains():
    cfg = EngineConfig(model="tiny-llama", device="cuda", dtype="float32", block_size=16, num_kv_blocks=512,
                       load_progress=False, cuda_graph_max_tokens=1024,  # B_0 below the context: >= 2 chunks
                       scheduler=SchedulerConfig(max_num_batched_tokens=256))
    src = resolve_model("tiny-llama")
    ex = LocalExecutor(cfg, src)
    runner = ex.worker.graphed.graphs
    assert runner.captured == default_buckets(1024) and runner.replays == 0
    core = EngineCore(cfg, ex, source=src, tokenizer=ByteTokenizer())
    report = warm_up(core, WarmupShape.for_device(Device.CUDA, core.max_model_len))
    assert report.missing(1) == [], report.describe(1)
    assert runner.replays > 0 and runner.captured == default_buckets(1024)  # nothing captured lazily
    _assert_idle(core)
    ex.check_invariants()


def test_serving_starts_without_the_warm_ups_admission_verdicts():
    """The warm-up's first steps pay first-use costs (compilation on a GPU; a sleep here), so its requests'
    first tokens come after the deadlines admission predicted them to meet. ``begin_serving`` (called by the
    XP deployment once warmed up) leaves no such verdict, calibration or refit sample to judge real traffic's admission by."""
    core = byte_engine("tiny-llama", chunk=8, num_kv_blocks=256)
    execute, calls = core.executor.execute, []

    def slow_first_steps(step_input):
        calls.append(1)
        if len(calls) <= 3:
            time.sleep(1.2)  # past the 1 s TTFT SLO
        return execute(step_input)

    core.executor.execute = slow_first_steps
    warm_up(core, SHAPE)
    core.executor.execute = execute
    sched = core.scheduler
    assert sched.outcomes.predictions == SHAPE.decodes_per_rank + 1 and sched.outcomes.correct < sched.outcomes.predictions
    sched.step_scale = 1.7  # as a calibration on compile-bound steps would leave it
    sched.refit = OnlineRefit(sched.estimator.profile, every=4, window=8, background=False)
    sched.refit.observe(BatchLoad((8,), (0,), (0,)), 1.2)  # a compile-bound warm-up step
    sched.begin_serving()
    assert not sched.refit.steps
    sched.refit = None
    stats = sched.outcomes.stats()
    assert (stats.predictions, stats.correct, stats.accuracy, stats.fallback) == (0, 0, None, False)
    assert sched.step_scale == 1.0 and sched.outcomes.threshold == sched.config.admission_fallback_accuracy
    assert _serve(core)  # and it serves
