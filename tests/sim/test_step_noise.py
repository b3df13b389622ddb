"""Served step times replayed in the simulator (``conflux_cluster.sim.step_noise``): ratios come from a
step log against a profile, per step family; a simulated step takes its modelled time times a draw;
ConfluxServe's calibration sees the drawn times; the draws are reproducible."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conflux_cluster.engine.scheduler.estimator import BatchLoad, LatencyEstimator
from conflux_cluster.sim.costs import xp_profile
from conflux_cluster.sim.goodput import run_at_rate
from conflux_cluster.sim.hardware import get_hardware, get_model
from conflux_cluster.slo import SLO
from conflux_cluster.sim.registry import Setting, sweep
from conflux_cluster.sim.step_noise import StepNoise
from conflux_cluster.sim.workloads import cap_lengths, toolagent_like

LLAMA = get_model("llama-8b")
WL = cap_lengths(toolagent_like(80, seed=3), LLAMA.max_context)
BASE = Setting(LLAMA, get_hardware("h200"), 1, 1, SLO(2.0, 0.1))
PROFILE = xp_profile(BASE.costs(), 1)

DECODE = BatchLoad((0,), (8,), (8 * 2048,), ())
PREFILL = BatchLoad((2048,), (0,), (0,), ((2048, 0),))
MIXED = BatchLoad((1024,), (8,), (8 * 2048,), ((1024, 4096),))


def _log(path, steps: list[tuple[BatchLoad, float]]) -> str:
    with open(path, "w") as f:
        for load, seconds in steps:
            f.write(json.dumps({"seconds": seconds, "prefill_tokens": list(load.prefill_tokens),
                                "decode_tokens": list(load.decode_tokens), "decode_context": list(load.decode_context),
                                "prefill_chunks": [list(c) for c in load.prefill_chunks]}) + "\n")
    return str(path)


def test_ratios_are_measured_over_modelled_by_family(tmp_path):
    est = LatencyEstimator(PROFILE)
    t = {name: est.estimate(load).total for name, load in (("d", DECODE), ("p", PREFILL), ("m", MIXED))}
    log = _log(tmp_path / "steps.jsonl", [(DECODE, 1.1 * t["d"]), (DECODE, 0.9 * t["d"]), (PREFILL, 1.3 * t["p"]),
                                          (MIXED, 1.05 * t["m"])])
    noise = StepNoise.from_step_logs([log], PROFILE)
    assert sorted(noise.ratios["decode"]) == pytest.approx([0.9, 1.1])
    assert noise.ratios["prefill"] == pytest.approx((1.3,))
    assert noise.ratios["hetero"] == pytest.approx((1.05,))
    draw = noise.sampler()
    assert draw(PREFILL) == pytest.approx(1.3) and draw(MIXED) == pytest.approx(1.05)
    assert {round(draw(DECODE), 6) for _ in range(50)} == {0.9, 1.1}
    only_decode = StepNoise({"decode": (1.2,)})
    assert only_decode.sampler()(PREFILL) == 1.2  # a family the logs lack draws from all of them
    with pytest.raises(ValueError, match="at least one"):
        StepNoise({})
    with pytest.raises(ValueError, match="> 0"):
        StepNoise({"decode": (1.0, 0.0)})


def _run(s: Setting, system: str = "conflux"):
    made = []
    factory = sweep(system, s, quick=True)[0].build(s)
    summary, _ = run_at_rate(lambda rec: made.append(factory(rec)) or made[-1], WL, s.slo, 1.0)
    return made[0], summary


def test_a_slower_engine_is_simulated_slower_and_calibrated_for():
    """Every step at 1.25x its model: decode gaps grow by that factor, and ConfluxServe's calibration
    (which sees the drawn times, as the engine sees measured ones) learns the factor."""
    exact_inst, exact = _run(replace(BASE, profile=PROFILE))
    slow_inst, slow = _run(replace(BASE, profile=PROFILE, step_noise=StepNoise({"decode": (1.25,)})))
    assert exact_inst.sched.step_scale == 1.0
    assert slow_inst.sched.step_scale == pytest.approx(1.25, rel=0.05)
    assert slow.tbt["p50"] == pytest.approx(1.25 * exact.tbt["p50"], rel=0.1)
    _, base = _run(replace(BASE, profile=PROFILE), "chunked")
    _, slow_base = _run(replace(BASE, profile=PROFILE, step_noise=StepNoise({"decode": (1.25,)})), "chunked")
    assert slow_base.tbt["p50"] == pytest.approx(1.25 * base.tbt["p50"], rel=0.1)  # the baselines run slower too


def test_draws_are_seeded():
    noise = StepNoise({"decode": tuple(0.8 + 0.01 * i for i in range(40))}, seed=5)
    a, b = noise.sampler(), noise.sampler()
    assert [a(DECODE) for _ in range(20)] == [b(DECODE) for _ in range(20)]
    s = replace(BASE, profile=PROFILE, step_noise=noise)
    assert _run(s)[1] == _run(s)[1]
