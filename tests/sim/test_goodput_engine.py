"""Goodput search properties, and that ConfluxServe in the simulator IS the engine scheduler."""

from __future__ import annotations

import pytest

from conflux_cluster.engine.scheduler import scheduler as engine_scheduler
from conflux_cluster.engine.scheduler.estimator import LatencyEstimator
from conflux_cluster.sim.core import Simulation
from conflux_cluster.sim.goodput import goodput, search_threshold
from conflux_cluster.sim.hardware import get_hardware, get_model
from conflux_cluster.slo import SLO
from conflux_cluster.sim.registry import Setting, sweep
from conflux_cluster.sim.systems.engine_sched import XPInstance
from conflux_cluster.sim.workloads import cap_lengths, scale_to_rate, toolagent_like

LLAMA = get_model("llama-8b")
WL = cap_lengths(toolagent_like(120, seed=7), LLAMA.max_context)


def setting(tbt: float = 0.05, hw: str = "h200") -> Setting:
    return Setting(LLAMA, get_hardware(hw), 4, 1, SLO(1.0, tbt))


@pytest.mark.parametrize("threshold", [0.37, 3.0, 7.3, 150.0])
def test_search_finds_a_step_threshold(threshold):
    seen = []

    def passes(rate):
        seen.append(rate)
        return rate <= threshold

    g = search_threshold(passes, start=4.0, rel_tol=0.02)
    assert threshold / 1.02 <= g <= threshold
    assert all((r <= threshold) == (r <= g) for r in seen)  # nothing above g passed


def test_goodput_reproducible_and_monotone_in_slo_and_hardware():
    cfg = sweep("conflux", setting())[0]
    runs = [goodput(cfg.build(s), WL, s.slo, 8.0, rel_tol=0.05) for s in (setting(), setting())]
    assert runs[0].goodput == runs[1].goodput > 0
    assert [(p.rate, p.attainment) for p in runs[0].points] == [(p.rate, p.attainment) for p in runs[1].points]
    loose = goodput(cfg.build(setting(tbt=0.1)), WL, SLO(1.0, 0.1), 8.0, rel_tol=0.05)
    slow = goodput(cfg.build(setting(hw="h100")), WL, SLO(1.0, 0.05), 8.0, rel_tol=0.05)
    assert loose.goodput >= runs[0].goodput * 0.999
    assert slow.goodput <= runs[0].goodput * 1.001
    at = runs[0].at_goodput()
    assert at is not None and at.attainment >= 0.95


def test_simulator_drives_the_engine_scheduler(monkeypatch):
    """Class identity, and every step goes through Scheduler.schedule/update of the engine."""
    s = setting()
    calls = {"schedule": 0, "update": 0}
    real_schedule, real_update = engine_scheduler.Scheduler.schedule, engine_scheduler.Scheduler.update

    def schedule(self, now):
        calls["schedule"] += 1
        return real_schedule(self, now)

    def update(self, plan, result):
        calls["update"] += 1
        return real_update(self, plan, result)

    monkeypatch.setattr(engine_scheduler.Scheduler, "schedule", schedule)
    monkeypatch.setattr(engine_scheduler.Scheduler, "update", update)
    made = []

    def factory(rec):
        inst = sweep("conflux", s)[0].build(s)(rec)
        made.append(inst)
        return inst

    res = Simulation(factory, scale_to_rate(WL, 4.0), s.slo).run()
    inst = made[0]
    assert isinstance(inst, XPInstance) and type(inst.sched) is engine_scheduler.Scheduler
    assert inst.sched.config.policy == "slo" and inst.sched.estimator is inst.estimator
    assert isinstance(inst.estimator, LatencyEstimator)
    assert calls["update"] == calls["schedule"] > 100
    assert all(r.finished for r in res.records)
    assert not inst.sched.waiting and not inst.sched.decoding and inst.sched.kv.is_empty()
    inst.sched.check_invariants()


def test_xp_step_time_is_the_estimator(monkeypatch):
    s = setting()
    seen = []
    real = LatencyEstimator.estimate

    def spy(self, load):
        out = real(self, load)
        seen.append(out.total)
        return out

    monkeypatch.setattr(LatencyEstimator, "estimate", spy)
    steps = []

    class Probe(XPInstance):
        def start_step(self, stream, now):
            out = super().start_step(stream, now)
            if out:
                steps.append(out[0])
            return out

    cfg = sweep("conflux", s)[0]
    Simulation(lambda rec: Probe(rec, s.costs(), s.num_ranks, cfg.build(s)(rec).sched.config, s.slo),
               scale_to_rate(WL, 2.0), s.slo).run()
    assert len(steps) == len(seen) > 0
    overhead = [t - e for t, e in zip(steps, seen)]  # LM head + fixed per-step overhead only
    assert all(0 < o < 2e-3 for o in overhead)


def test_fitted_profile_path_reproduces_roofline(tmp_path):
    """A profile JSON equal to the roofline's XP profile gives the same components and goodput."""
    from conflux_cluster.engine.scheduler.estimator import EstimatorProfile
    from conflux_cluster.sim.costs import xp_profile

    base = setting()
    path = tmp_path / "p.json"
    xp_profile(base.costs(), base.num_ranks).to_json(path)
    fitted = Setting(base.model, base.hw, 4, 1, base.slo, EstimatorProfile.from_json(path))
    for tp in (1, 2, 4):
        a, b = base.costs(tp), fitted.costs(tp)
        for f in ("gemm", "prefill_attn", "decode_attn", "a2a_full"):
            assert getattr(a, f).slope == pytest.approx(getattr(b, f).slope)
            assert getattr(a, f).intercept == pytest.approx(getattr(b, f).intercept)
    assert fitted.costs().source.startswith("profile:")
    for system in ("conflux", "chunked++"):
        cfg = sweep(system, base, quick=True)[-1]
        g = [goodput(cfg.build(x), WL, x.slo, 8.0, rel_tol=0.05).goodput for x in (base, fitted)]
        assert g[0] == pytest.approx(g[1])


def test_a_scheduler_planning_with_an_optimistic_profile_calibrates_on_the_timed_steps():
    """Setting.plan_profile: ConfluxServe plans with an estimator that underrates steps by a quarter while
    ``profile`` times them; its calibration (as the engine's) then shrinks the per-step budget. Without a
    separate planning profile nothing is calibrated (estimates are exact there)."""
    from dataclasses import replace

    from conflux_cluster.engine.scheduler.estimator import Affine
    from conflux_cluster.sim.costs import xp_profile
    from conflux_cluster.sim.goodput import run_at_rate

    base = setting()
    truth = xp_profile(base.costs(), base.num_ranks)
    optimistic = replace(truth, f_gemm=Affine(0.75 * truth.f_gemm.slope, 0.75 * truth.f_gemm.intercept))

    def instance(s: Setting) -> XPInstance:
        made = []
        factory = sweep("conflux", s)[0].build(s)
        run_at_rate(lambda rec: made.append(factory(rec)) or made[-1], WL, s.slo, 4.0)
        return made[0]

    exact = instance(replace(base, profile=truth))
    off = instance(replace(base, profile=truth, plan_profile=optimistic))
    assert exact.sched.step_scale == 1.0
    assert off.sched.step_scale > 1.15  # GEMMs dominate these steps: ~4/3 slower than planned
    assert off.sched.dispatcher.tbt_budget < base.slo.tbt_s / 1.15
