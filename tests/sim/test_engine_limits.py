"""Every limit the simulator models comes from the engine's configuration (issue 11 item 4):
decode slots = SchedulerConfig.max_num_seqs per instance, shared equally per GPU by every system;
the fixed token budget and the HBM share are EngineConfig's on a GPU; all overridable."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conflux_cluster.engine.config import GPU_MAX_NUM_BATCHED_TOKENS, EngineConfig
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.scheduler.estimator import BatchLoad
from conflux_cluster.sim.core import Recorder, Simulation
from conflux_cluster.sim.hardware import get_hardware, get_model, kv_tokens_per_group
from conflux_cluster.sim.limits import EngineLimits
from conflux_cluster.sim.metrics import summarize
from conflux_cluster.slo import SLO
from conflux_cluster.sim.registry import Setting, SystemConfig, sweep
from conflux_cluster.sim.systems.engine_sched import NoCobatchInstance, XPInstance
from conflux_cluster.sim.workloads import SimRequest, Workload

LLAMA = get_model("llama-8b")


def _setting(**limits) -> Setting:
    return Setting(LLAMA, get_hardware("h200"), 4, 1, SLO(1.0, 0.05), limits=EngineLimits.from_engine(**limits))


def test_defaults_are_the_engines_gpu_defaults():
    lim = EngineLimits.from_engine()
    assert lim.max_num_seqs == SchedulerConfig().max_num_seqs
    assert lim.max_num_batched_tokens == GPU_MAX_NUM_BATCHED_TOKENS
    assert lim.gpu_memory_utilization == EngineConfig().gpu_memory_utilization
    assert lim.max_level == SchedulerConfig().max_level
    cfg = EngineConfig(device="cuda", scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512))
    assert (EngineLimits.from_engine(cfg).max_num_seqs, EngineLimits.from_engine(cfg).max_num_batched_tokens) == (64, 512)
    assert EngineLimits.from_engine(max_num_seqs=8, max_num_batched_tokens=None).max_num_seqs == 8


def test_decode_slots_are_equal_per_gpu_across_systems():
    s = _setting(max_num_seqs=256)
    rec = Recorder()
    xp = sweep("conflux", s)[0].build(s)(rec)
    assert xp.sched.config.max_num_seqs == 256  # one instance of 4 GPUs
    for cfg in sweep("distserve++", s):
        inst = cfg.build(s)(rec)
        k = dict(cfg.knobs)
        # each decode replica: its GPUs' share, not its own 256 (the old simulator constant gave each 512)
        assert [p.max_seqs for p in inst.pools] == [256 * k["d_tp"] // 4] * k["d_dp"]
        assert sum(p.max_seqs for p in inst.pools) <= 256
    loong = sweep("loongserve++", s)[0].build(s)(rec)
    assert sum(p.max_seqs for p in loong.pools) == 256
    assert sweep("muxwise++", s)[0].build(s)(rec).pool.max_seqs == 256


@pytest.mark.parametrize("system", ["conflux", "distserve++"])
def test_decode_slot_limit_binds(system):
    """40 requests at once, 64 output tokens each: with 4 decode slots per instance they finish far later."""
    wl = Workload("burst", tuple(SimRequest(f"r{i}", 0.0, 256, 64) for i in range(40)))
    e2e = {}
    for slots in (256, 4):
        s = _setting(max_num_seqs=slots)
        cfg = sweep(system, s, quick=True)[0]
        e2e[slots] = summarize(Simulation(cfg.build(s), wl, s.slo).run().records, s.slo).e2e["p99"]
    assert e2e[4] > 3 * e2e[256]


def test_kv_capacity_follows_the_engines_memory_share():
    full, half = _setting(), _setting(gpu_memory_utilization=0.5)
    assert full.costs().hw.mem_util == EngineConfig().gpu_memory_utilization
    assert kv_tokens_per_group(LLAMA, half.costs().hw, 1) < 0.6 * kv_tokens_per_group(LLAMA, full.costs().hw, 1)


def test_fixed_budget_of_the_chunked_baseline_is_the_engines():
    s = _setting(max_num_batched_tokens=3072)
    budgets = [dict(c.knobs).get("budget") for c in sweep("chunked++", s, quick=True)]
    assert 3072 in budgets
    assert 3072 in [dict(c.knobs).get("budget") for c in sweep("chunked++", s)]


def test_no_cobatch_pays_two_iterations():
    s = _setting()
    cfg = SchedulerConfig(max_num_seqs=256)
    xp = XPInstance(Recorder(), s.costs(), 4, cfg, s.slo)
    nc = NoCobatchInstance(Recorder(), s.costs(), 4, cfg, s.slo)
    mixed = BatchLoad((512, 512, 0, 0), (0, 0, 16, 16), (0, 0, 16000, 16000), ((1024, 0),))
    prefill_only = replace(mixed, decode_tokens=(0,) * 4, decode_context=(0,) * 4)
    assert nc.step_time(None, mixed) > xp.step_time(None, mixed)
    assert nc.step_time(None, prefill_only) == xp.step_time(None, prefill_only)
    assert SystemConfig("no-cobatch", "no-cobatch", "fcfs", (("budget", 2048),)).build(s)(Recorder()).__class__ \
        is NoCobatchInstance


def test_simulate_cli_takes_the_limits(tmp_path):
    import json

    from conflux_cluster.commands.simulate import main

    assert main(["--workload", "synthetic", "--num-requests", "12", "--systems", "conflux,no-cobatch++", "--rates", "0.5",
                 "--max-num-seqs", "96", "--max-num-batched-tokens", "1024", "--gpu-memory-utilization", "0.8",
                 "--out", str(tmp_path), "--name", "lim", "--no-progress"]) == 0
    doc = json.loads((tmp_path / "lim.json").read_text())
    lim = doc["setting"]["limits"]
    assert (lim["max_num_seqs"], lim["max_num_batched_tokens"], lim["gpu_memory_utilization"]) == (96, 1024, 0.8)
    assert "no-cobatch++[budget=1024]" in json.dumps(doc)


def test_the_step_stretch_reaches_the_simulated_scheduler():
    """conflux-stretch is the engine's SLO scheduler with SchedulerConfig.max_step_stretch (x2, x4; quick: x4)."""
    s, rec = _setting(), Recorder()
    cfgs = sweep("conflux-stretch", s)
    assert [dict(c.knobs)["stretch"] for c in cfgs] == [2.0, 4.0]
    assert [dict(c.knobs)["stretch"] for c in sweep("conflux-stretch", s, quick=True)] == [4.0]
    assert cfgs[1].build(s)(rec).sched.config.max_step_stretch == 4.0
    assert sweep("conflux", s)[0].build(s)(rec).sched.config.max_step_stretch == 1.0
