"""The engine feeds each step's measured time to the scheduler's step calibration (calibrate_steps):
steps that run longer than estimated shrink the step budget; with it off, nothing changes."""

from __future__ import annotations


from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.executor import LocalExecutor
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.scheduler.estimator import Affine, EstimatorProfile
from conflux_cluster.engine.tokenizer import ByteTokenizer

from .helpers import SlowExecutor, tiny_long_source


def _run(tmp_path, calibrate: bool) -> EngineCore:
    src = tiny_long_source()
    profile = EstimatorProfile(model="tiny-long", hardware="test", num_ranks=1, num_layers=1,
                               f_gemm=Affine(2e-5, 0.0), f_prefill_attn=Affine(0.0, 0.0),
                               f_decode_attn=Affine(0.0, 0.0), f_comm=Affine(0.0, 0.0))  # 20 µs per token
    path = tmp_path / f"p{int(calibrate)}.json"
    profile.to_json(path)
    cfg = EngineConfig(model="tiny-long", dtype="float32", block_size=16, num_kv_blocks=1024, load_progress=False,
                       async_scheduling=False,
                       scheduler=SchedulerConfig(estimator_profile=str(path), tbt_slo=0.1, ttft_slo=60.0,
                                                 calibrate_steps=calibrate))
    core = EngineCore(cfg, SlowExecutor(LocalExecutor(cfg, src), 0.08), source=src,  # 80 ms over the estimate
                      tokenizer=ByteTokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(4):
        core.add_request(f"r{i}", [65 + i] * 6000, params)  # 4 x 6000 tokens: many 5000-token (100 ms) steps
    while core.has_unfinished():
        core.step()
    return core


def test_steps_slower_than_estimated_shrink_the_budget(tmp_path):
    calibrated = _run(tmp_path, True)
    assert calibrated.scheduler.step_scale > 1.1  # every full step ran >= 80 ms over its 100 ms estimate
    assert calibrated.scheduler.dispatcher.tbt_budget < 0.1 / 1.1
    plain = _run(tmp_path, False)
    assert plain.scheduler.step_scale == 1.0 and plain.scheduler.dispatcher.tbt_budget >= 0.1
