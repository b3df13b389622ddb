"""The engine feeds each step's measured time to the scheduler's step calibration (calibrate_steps):
steps that run longer than estimated shrink the step budget; with it off, nothing changes. And the
step stretch (max_step_stretch) changes how much prefill a step takes, never a token."""

from __future__ import annotations


from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.scheduler.estimator import Affine, EstimatorProfile
from conflux_cluster.engine.tokenizer import ByteTokenizer

from .helpers import SlowExecutor, tiny_long_source


def _config(tmp_path, name: str, **scheduler) -> EngineConfig:
    """The tiny-long engine on CPU, planning with a profile of 20 µs per token (τ = 100 ms: 5,000 tokens a
    step), TTFT SLO 60 s; ``scheduler``: further SchedulerConfig fields."""
    profile = EstimatorProfile(model="tiny-long", hardware="test", num_ranks=1, num_layers=1,
                               f_gemm=Affine(2e-5, 0.0), f_prefill_attn=Affine(0.0, 0.0),
                               f_decode_attn=Affine(0.0, 0.0), f_comm=Affine(0.0, 0.0))
    path = tmp_path / f"{name}.json"
    profile.to_json(path)
    return EngineConfig(model="tiny-long", dtype="float32", block_size=16, num_kv_blocks=1024, load_progress=False,
                        async_scheduling=False,
                        scheduler=SchedulerConfig(estimator_profile=str(path), tbt_slo=0.1, ttft_slo=60.0, **scheduler))


def _run(tmp_path, calibrate: bool) -> EngineCore:
    src = tiny_long_source()
    cfg = _config(tmp_path, f"p{int(calibrate)}", calibrate_steps=calibrate, idle_step_stretch=1.0)  # steps of τ
    core = EngineCore(cfg, SlowExecutor(LocalExecutor(cfg, src), 0.08), source=src,  # 80 ms over the estimate
                      tokenizer=ByteTokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(4):
        core.add_request(GenerateRequest(f"r{i}", [65 + i] * 6000,
                                         params))  # 4 x 6000 tokens: many 5000-token (100 ms) steps
    while core.has_unfinished():
        core.step()
    return core


def test_steps_slower_than_estimated_shrink_the_budget(tmp_path):
    calibrated = _run(tmp_path, True)
    assert calibrated.scheduler.step_scale > 1.1  # every full step ran >= 80 ms over its 100 ms estimate
    assert calibrated.scheduler.dispatcher.tbt_budget < 0.1 / 1.1
    plain = _run(tmp_path, False)
    assert plain.scheduler.step_scale == 1.0 and plain.scheduler.dispatcher.tbt_budget >= 0.1


def _stretch_run(tmp_path, stretch: float) -> tuple[list[list[int]], int]:
    """One decode in flight beside a 7,000-token prompt: the decode's slack (TTFT SLO 60 s) lets a
    stretched step take the whole prompt."""
    src = tiny_long_source()
    cfg = _config(tmp_path, f"s{stretch:g}", calibrate_steps=False, max_step_stretch=stretch)
    core = EngineCore(cfg, LocalExecutor(cfg, src), source=src, tokenizer=ByteTokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    core.add_request(GenerateRequest("short", [70, 71, 72] * 10, params))
    outputs: dict[str, list[int]] = {}
    for out in core.step():  # its prefill: it decodes from here on
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    core.add_request(GenerateRequest("long", [65 + i % 50 for i in range(7000)], params))
    steps = 0
    while core.has_unfinished():
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
    return [outputs["short"], outputs["long"]], steps


def test_a_stretched_step_takes_more_prefill_and_changes_no_token(tmp_path):
    plain, plain_steps = _stretch_run(tmp_path, 1.0)
    stretched, stretched_steps = _stretch_run(tmp_path, 4.0)
    assert stretched == plain and all(len(t) == 12 for t in plain)
    assert stretched_steps < plain_steps  # the 7,000-token prompt in one step instead of two
