"""The estimator refitted on served steps (engine/scheduler/fitting/online.py): a refit that estimates held-out
steps better replaces the profile, one that does not is refused; in the engine the scheduler plans with
the refit, and tokens do not change."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.scheduler.estimator import Affine, BatchLoad, EstimatorProfile, LatencyEstimator
from conflux_cluster.engine.scheduler.fitting.fit import BatchSample, profile_mape
from conflux_cluster.engine.scheduler.fitting.online import OnlineRefit
from conflux_cluster.engine.tokenizer import ByteTokenizer

from .helpers import SlowExecutor, tiny_long_source

pytest.importorskip("scipy")

START = EstimatorProfile(model="m", hardware="test", num_ranks=1, num_layers=32,
                         f_gemm=Affine(2e-8, 2e-4), f_prefill_attn=Affine(3e-13, 1e-5),
                         f_decode_attn=Affine(4e-9, 2e-5), f_comm=Affine(0.0, 0.0), f_prefill_kv=Affine(1e-10, 0.0))
# what the served steps really take: decodes 10 % slower per context token, a larger per-step constant
TRUE = replace(START, f_gemm=Affine(2e-8, 3e-4), f_decode_attn=Affine(4.4e-9, 2e-5))


def _loads(n: int) -> list[BatchLoad]:
    """Decode-only, prefill-only and mixed steps of varied sizes (deterministic)."""
    out = []
    for i in range(n):
        d, ctx = 1 + (i * 7) % 40, 2000 + (i * 3571) % 60000
        chunk, hist = 64 + (i * 131) % 2000, (i * 7919) % 40000
        kind = i % 3
        out.append(BatchLoad((0,), (d,), (d * ctx,)) if kind == 0 else
                   BatchLoad((chunk,), (0,), (0,), ((chunk, hist),)) if kind == 1 else
                   BatchLoad((chunk,), (d,), (d * ctx,), ((chunk, hist),)))
    return out


def _samples(profile: EstimatorProfile, loads: list[BatchLoad]) -> list[BatchSample]:
    est = LatencyEstimator(profile)
    return [BatchSample(x, est.estimate(x).total) for x in loads]


def test_a_refit_that_estimates_better_replaces_the_profile() -> None:
    refit = OnlineRefit(START, every=32, window=128, background=False)
    taken = []
    for s in _samples(TRUE, _loads(96)):
        refit.observe(s.load, s.seconds)
        taken.append(refit.poll())
    assert taken[:63] == [None] * 63  # nothing before 2 x every steps
    better = [p for p in taken if p is not None]
    assert better and refit.current is better[-1] and refit.refits == len(better)
    judge = _samples(TRUE, _loads(300)[150:])
    assert profile_mape(START, judge) > 5.0
    assert profile_mape(refit.current, judge) < 0.2 * profile_mape(START, judge)
    assert refit.current.meta["online_refit"]["mape_percent"] < refit.current.meta["online_refit"]["previous_mape_percent"]


def test_a_refit_that_is_no_better_is_refused() -> None:
    refit = OnlineRefit(START, every=16, window=64, background=False)
    for s in _samples(START, _loads(64)):  # the profile in use is exact
        refit.observe(s.load, s.seconds)
        assert refit.poll() is None
    assert refit.refits == 0 and refit.rejected >= 1 and refit.current is START


def test_in_the_background_the_refit_arrives_at_a_later_poll() -> None:
    refit = OnlineRefit(START, every=32, window=128)
    for s in _samples(TRUE, _loads(64)):
        refit.observe(s.load, s.seconds)
        assert refit.poll() is None or refit.refits == 1
    deadline = time.monotonic() + 60
    while refit.refits == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        refit.poll()
    assert refit._pool is not None  # the refit process lives until closed
    refit.close()
    refit.close()  # idempotent
    assert refit._pool is None and refit.refits == 1 and refit.current is not START


def test_bad_windows_are_config_errors() -> None:
    with pytest.raises(ValueError, match="window"):
        OnlineRefit(START, every=64, window=100)
    with pytest.raises(ValueError, match="refit_window"):
        SchedulerConfig(refit_every=64, refit_window=100)
    SchedulerConfig(refit_every=0, refit_window=2)  # off: the window does not matter


def _run(tmp_path, refit_every: int) -> tuple[EngineCore, dict[str, list[int]]]:
    """The tiny-long engine on CPU planning with 20 µs per token while every step takes 60 ms more."""
    profile = EstimatorProfile(model="tiny-long", hardware="test", num_ranks=1, num_layers=1,
                               f_gemm=Affine(2e-5, 0.0), f_prefill_attn=Affine(0.0, 0.0),
                               f_decode_attn=Affine(0.0, 0.0), f_comm=Affine(0.0, 0.0))
    path = tmp_path / f"p{refit_every}.json"
    profile.to_json(path)
    cfg = EngineConfig(model="tiny-long", dtype="float32", block_size=16, num_kv_blocks=1024, load_progress=False,
                       async_scheduling=False,
                       scheduler=SchedulerConfig(estimator_profile=str(path), tbt_slo=0.1, ttft_slo=60.0,
                                                 calibrate_steps=False, refit_every=refit_every,
                                                 refit_window=max(2 * refit_every, 2)))
    src = tiny_long_source()
    core = EngineCore(cfg, SlowExecutor(LocalExecutor(cfg, src), 0.06), source=src, tokenizer=ByteTokenizer())
    if core.scheduler.refit is not None:  # inline, so the test knows when it lands
        core.scheduler.refit.background = False
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        core.add_request(GenerateRequest(f"r{i}", [65 + i] * 3000 + [70 + i] * (i + 1), params))
    out: dict[str, list[int]] = {}
    while core.has_unfinished():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return core, out


def test_the_engine_plans_with_the_refit_and_tokens_do_not_change(tmp_path) -> None:
    core, tokens = _run(tmp_path, 16)
    sched = core.scheduler
    assert sched.refit is not None and sched.refit.refits >= 1
    assert sched.estimator.profile is sched.refit.current  # the scheduler plans with the accepted refit
    assert sched.dispatcher.estimator is sched.estimator
    # it learnt the 60 ms every step pays, on the steps it served (the three requests decode together, so a
    # shape it never saw, e.g. one decode, is not pinned down by the window)
    seen = [s for s in sched.refit.steps if any(s.load.prefill_tokens) or any(s.load.decode_tokens)]
    ratios = [sched.estimator.estimate(s.load).total / s.seconds for s in seen]
    close = [r for r in ratios if abs(r - 1) < 0.3]  # (a step that a loaded CI box delayed may stand out)
    assert seen and len(close) >= 0.8 * len(ratios), ratios
    plain, plain_tokens = _run(tmp_path, 0)
    assert plain.scheduler.refit is None
    assert tokens == plain_tokens and all(len(t) == 40 for t in tokens.values())


def test_no_refit_process_leaves_the_profile_in_use(monkeypatch, caplog) -> None:
    """Where no process can be started, the instance serves on with its profile (and says so once)."""
    from conflux_cluster.engine.scheduler.fitting import online as online_fit

    class NoProcesses:
        def __init__(self, *a, **k) -> None:
            raise OSError("process creation refused")

    monkeypatch.setattr(online_fit, "ProcessPoolExecutor", NoProcesses)
    refit = OnlineRefit(START, every=16, window=32)
    with caplog.at_level("WARNING"):
        for s in _samples(TRUE, _loads(64)):
            refit.observe(s.load, s.seconds)
            assert refit.poll() is None
    assert refit.broken and refit.refits == 0 and refit.current is START
    assert sum("online estimator refit off" in r.message for r in caplog.records) == 1
