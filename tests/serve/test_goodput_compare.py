"""The pure parts of benchmarks/gpu_goodput.py: which flags each served system gets, its simulator
model, the workload shaping, goodput from a sweep, and the sim-vs-real errors (no server)."""

from __future__ import annotations

import random

import pytest

from conflux_cluster.bench.goodput_compare import (bench_requests, compare, goodput, ratio_table, real_point,
                                                   rel_error, shape_workload)
from conflux_cluster.bench.served_systems import DEFAULT_SYSTEMS, SIM_KIND, SYSTEMS, pick
from conflux_cluster.bench.workload import trace_prompt_ids
from conflux_cluster.cli import build_parser
from conflux_cluster.commands.serve import config_from_args
from conflux_cluster.sim.limits import EngineLimits
from conflux_cluster.sim.workloads import make_workload


@pytest.mark.parametrize("name", list(SYSTEMS))
def test_every_served_system_is_a_valid_conflux_serve_command_line(name):
    s = SYSTEMS[name]
    cfg = config_from_args(build_parser().parse_args(["serve", "--model", "tiny-llama", *s.server_args()]))
    assert (cfg.xp_mode, cfg.scheduler.policy) == (s.xp_mode, s.policy)
    assert (cfg.instances or 1) == s.instances
    if s.router_policy:
        assert cfg.router_policy.value == s.router_policy and s.gpus(8) == 2
    sim = s.sim_config(EngineLimits.from_engine(max_num_batched_tokens=1536))
    assert sim.policy == s.policy and sim.kind in ("conflux", "chunked-sp", "chunked-tp", "no-cobatch")
    assert dict(sim.knobs).get("budget") == (1536 if s.is_baseline else None)  # the engine's own fixed budget


def test_default_systems_are_conflux_and_six_baselines():
    names = [s.name for s in pick("default")]
    assert names == list(DEFAULT_SYSTEMS) and names[0] == "conflux"
    assert {s.policy for s in pick("default")[1:]} == {"fcfs", "srpt"}
    assert [s.name for s in pick("conflux,router")][1:] == ["router-lowest_load", "router-round_robin",
                                                            "router-power_of_two"]
    with pytest.raises(ValueError, match="loongserve"):
        pick("conflux,loongserve")


def test_workload_is_scaled_capped_and_rate_scaled_like_the_simulator():
    wl = shape_workload("toolagent", 50, context=300, prompt_scale=0.01, max_output=8, seed=1)
    raw = make_workload("toolagent", 50, seed=1)
    assert len(wl) == 50 and all(r.prompt_len + r.output_len <= 300 and r.output_len <= 8 for r in wl.requests)
    small = [(a, b) for a, b in zip(raw.requests, wl.requests) if a.prompt_len * 0.01 + 8 < 290]
    assert small and all(b.prompt_len == max(1, round(a.prompt_len * 0.01)) for a, b in small)
    reqs = bench_requests(wl, 4.0)
    assert reqs[0].arrival_s == 0.0 and (len(reqs) - 1) / reqs[-1].arrival_s == pytest.approx(4.0)
    assert [r.input_len for r in reqs] == [r.prompt_len for r in wl.requests]


def _pt(rate, att, ttft=0.5, tbt=0.02):
    return {"rate": rate, "attainment": att, "ttft_p50": ttft, "ttft_p99": 2 * ttft, "tbt_p50": tbt, "tbt_p99": 2 * tbt}


def test_goodput_and_errors():
    real = [_pt(1, 1.0), _pt(2, 0.96), _pt(4, 0.5)]
    sim = [_pt(1, 1.0, 0.6), _pt(2, 1.0, 0.6), _pt(4, 0.97, 0.6)]
    assert goodput(real) == 2 and goodput(sim) == 4 and goodput([_pt(1, 0.9)]) == 0.0
    c = compare(real, sim)
    assert (c["goodput_real"], c["goodput_sim"], c["goodput_error"]) == (2, 4, pytest.approx(1.0))
    assert c["reference_rate"] == 2 and c["latency_error_at_reference"]["ttft_p50"] == pytest.approx(0.2)
    assert c["latency_error_per_rate"][0]["tbt_p99"] == pytest.approx(0.0)
    none = compare([_pt(1, 0.5)], [_pt(1, 0.4)])
    assert none["goodput_error"] == 0.0 and none["reference_rate"] == 1  # both zero: agree
    assert rel_error(1.0, 0.0) is None and rel_error(float("nan"), 1.0) is None


def test_ratio_table_divides_by_the_best_baseline():
    res = {"conversation": {"conflux": {"goodput_real": 6.0, "goodput_sim": 5.0},
                            "chunked-sp++": {"goodput_real": 4.0, "goodput_sim": 5.0},
                            "chunked-tp": {"goodput_real": 3.0, "goodput_sim": 1.0},
                            "router-round_robin": {"goodput_real": 9.0, "goodput_sim": 9.0}}}
    text, ratios = ratio_table(res, {"conflux": 2, "chunked-sp++": 2, "chunked-tp": 2, "router-round_robin": 2})
    r = ratios["conversation"]
    assert r["goodput_real"]["best_baseline"] == "chunked-sp++" and r["goodput_real"]["ratio"] == pytest.approx(1.5)
    assert r["goodput_sim"]["ratio"] == pytest.approx(1.0)
    assert "1.50x vs chunked-sp++" in text and "4.5/GPU" in text  # routers are not baselines; per GPU shown


def test_the_prefix_cache_system_is_conflux_not_a_baseline():
    pc = SYSTEMS["conflux-pc"]
    assert "--enable-prefix-caching" in pc.server_args() and not pc.is_baseline
    assert "--enable-prefix-caching" not in SYSTEMS["conflux"].server_args()
    assert "--no-enable-prefix-caching" in SYSTEMS["conflux"].server_args()  # the engine's default is on
    assert dict(pc.sim_config(EngineLimits.from_engine()).knobs).get("prefix_cache") is True
    res = {"conversation": {"conflux": {"goodput_real": 2.0, "goodput_sim": 2.0},
                            "conflux-pc": {"goodput_real": 3.0, "goodput_sim": 4.0},
                            "chunked-sp": {"goodput_real": 1.0, "goodput_sim": 1.0}}}
    _, ratios = ratio_table(res, {"conflux": 1, "conflux-pc": 1, "chunked-sp": 1})
    r = ratios["conversation"]
    assert r["goodput_real"]["best_baseline"] == "chunked-sp" and r["goodput_real"]["ratio"] == pytest.approx(2.0)
    assert r["prefix_cache_real"]["ratio"] == pytest.approx(1.5)


def test_trace_prompt_blocks_reach_the_client_only_at_full_scale():
    wl = shape_workload("conversation", 40, context=1 << 17)
    assert any(r.hash_ids for r in wl.requests)
    reqs = bench_requests(wl, 2.0)
    assert [r.hash_ids for r in reqs] == [r.hash_ids for r in wl.requests]
    rng = random.Random(0)
    prompts = [trace_prompt_ids(r, 32000, rng) for r in reqs]
    assert [len(p) for p in prompts] == [r.input_len for r in reqs]
    shared = [(a, b) for a, b in zip(reqs, reqs[1:]) if a.hash_ids[:1] == b.hash_ids[:1] and a.hash_ids]
    assert shared  # the conversation trace repeats prefixes ...
    i, j = reqs.index(shared[0][0]), reqs.index(shared[0][1])
    assert prompts[i][:512] == prompts[j][:512]  # ... and equal ids give equal tokens
    scaled = shape_workload("conversation", 40, context=1 << 17, prompt_scale=0.5)
    assert not any(r.hash_ids for r in scaled.requests)  # scaled prompts no longer match their blocks


def test_real_point_reads_the_client_summary():
    s = {"slo_attainment": 0.97, "completed": 10, "failed": 0, "median_ttft_ms": 120.0, "p99_ttft_ms": 900.0,
         "median_itl_ms": 20.0, "p99_itl_ms": 45.0, "output_throughput": 100.0}
    p = real_point(3.0, s)
    assert (p["ttft_p50"], p["ttft_p99"], p["tbt_p50"], p["tbt_p99"]) == (0.12, 0.9, 0.02, 0.045)


def test_real_latency_counts_requests_cut_off_after_their_first_token():
    """A request whose first token came 29 s late and whose stream was then cut at the window's end is in
    the TTFT percentiles the simulator is compared with (vLLM's completed-only figures miss it)."""
    from conflux_cluster.bench.client import RequestResult
    from conflux_cluster.bench.report import summarize

    done = [RequestResult(100, 3, arrival_s=float(i), chunk_times=[i + 0.5, i + 0.55, i + 0.6], output_tokens=3,
                          end_s=i + 0.6, finish_reason="length") for i in range(9)]
    cut = RequestResult(100_000, 256, arrival_s=1.0, chunk_times=[30.0, 30.2], output_tokens=2,
                        error="unfinished when the run ended")
    silent = RequestResult(100_000, 256, arrival_s=2.0, error="unfinished when the run ended")  # no token at all
    results = done + [cut, silent]
    p = real_point(1.0, summarize(results, 40.0, 5.0, 0.1).to_dict() | {
        "median_ttft_ms": 500.0, "p99_ttft_ms": 500.0, "median_itl_ms": 50.0, "p99_itl_ms": 50.0,
        "output_throughput": 1.0}, results)
    assert p["ttft_p99_completed"] == 0.5 and p["tbt_p99_completed"] == 0.05
    assert p["ttft_p50"] == pytest.approx(0.5) and 0.5 < p["ttft_p99"] <= 29.0  # the cut request's 29 s
    assert p["tbt_p99"] == pytest.approx(0.2, rel=0.2)  # its one 0.2 s gap
    assert p["ttft_censored"] == 0  # the silent one has no end: nothing to bound its TTFT with
    assert real_point(1.0, {**p, "slo_attainment": 0.0, "median_ttft_ms": 1.0, "p99_ttft_ms": 1.0,
                            "median_itl_ms": 1.0, "p99_itl_ms": 1.0, "output_throughput": 0.0},
                      [silent])["ttft_p99"] == 0.001  # no token anywhere: the summary's figures stay


def test_real_ttft_counts_requests_cut_off_before_their_first_token_at_their_wait():
    """A policy that leaves its latest arrivals unstarted when the window closes must not show a shorter
    TTFT tail than one that started them: a request cut off waiting counts with the wait it had (a lower
    bound of its TTFT); a refused one (HTTP 503) is not a TTFT at all."""
    from conflux_cluster.bench.client import RequestResult
    from conflux_cluster.bench.goodput_compare import observed_latency

    done = [RequestResult(100, 1, arrival_s=0.0, chunk_times=[0.5], output_tokens=1, end_s=0.5,
                          finish_reason="length") for _ in range(9)]
    waiting = RequestResult(100, 1, arrival_s=1.0, end_s=13.0, cut=True, error="unfinished when the run ended")
    refused = RequestResult(100, 1, arrival_s=1.0, end_s=30.0, error="HTTP 503: overloaded")
    out = observed_latency(done + [waiting, refused])
    assert out["ttft_censored"] == 1 and out["ttft_p99"] > 10.0  # the 12 s wait is the tail
    assert out["ttft_p50"] == pytest.approx(0.5)
    assert observed_latency(done + [refused])["ttft_p99"] == pytest.approx(0.5)
    assert observed_latency([waiting]) == {"ttft_p50": 12.0, "ttft_p99": 12.0, "ttft_censored": 1}


def test_goodput_search_doubles_halves_then_bisects_within_bounds():
    from conflux_cluster.bench.goodput_compare import next_search_rate

    def pts(*xs):
        return [{"rate": r, "attainment": a} for r, a in xs]

    assert next_search_rate(pts((1, 1.0)), 0.125, 8) == 2  # passes: go up
    assert next_search_rate(pts((1, 1.0), (2, 0.5)), 0.125, 8) == pytest.approx(2 ** 0.5)  # bracketed: bisect
    assert next_search_rate(pts((1, 1.0), (2, 0.5), (2 ** 0.5, 0.96)), 0.125, 8) is None  # within √2: done
    assert next_search_rate(pts((1, 0.5)), 0.125, 8) == 0.5  # nothing passed: go down
    assert next_search_rate(pts((1, 0.5), (0.5, 0.9)), 0.125, 8) == 0.25
    assert next_search_rate(pts((1, 0.5), (0.5, 0.97)), 0.125, 8) == pytest.approx(0.5 ** 0.5)
    assert next_search_rate(pts((8, 1.0)), 0.125, 8) is None  # at the upper bound
    assert next_search_rate(pts((0.125, 0.1)), 0.125, 8) is None  # at the lower bound
    assert next_search_rate(pts((0.25, 0.9)), 0.177, 8) == 0.177  # halving passes the bound: the bound
    assert next_search_rate(pts((0.25, 0.9), (0.177, 0.5)), 0.177, 8) is None  # bound measured: done
    assert next_search_rate(pts((6, 1.0)), 0.125, 8) == 8  # doubling passes the bound: the bound
    assert next_search_rate(pts((1, 1.0), (2, 1.0), (4, 1.0), (8, 0.0)), 0.125, 16) is None  # max_points 4
    assert next_search_rate([], 0.125, 8) is None


def test_resimulate_replays_a_served_result_file(tmp_path):
    """python -m benchmarks.simulator resimulate: every real point of a gpu_goodput result gets a simulated twin at its rate."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = root / "docs/results/gpu_goodput_h200x1_conversation_srpt_nocobatch_1515utc.json"
    out = tmp_path / "resim.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.simulator", "resimulate", str(result), "--profile",
                           str(root / "engine/scheduler/profiles/h200-llama-3.1-8b-n1.json"), "--out", str(out)],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    doc = json.loads(result.read_text())
    assert [(r["system"], r["rate"]) for r in rows] == [("chunked-sp++", 0.5), ("no-cobatch++", 0.5)]
    for r in rows:
        real = doc["systems"][r["system"]]["workloads"]["conversation"]["real"][0]
        assert r["real"]["attainment"] == real["attainment"] and 0.0 <= r["sim"]["attainment"] <= 1.0
        assert 0 < r["sim"]["ttft_p50"] <= r["sim"]["ttft_p99"]

    # other systems at the run's rates: a smaller token budget for the baseline (the paper's sweep)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.simulator", "resimulate", str(result), "--profile",
                           str(root / "engine/scheduler/profiles/h200-llama-3.1-8b-n1.json"), "--out", str(out),
                           "--systems", "chunked-sp++@512"], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows512 = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["rate"], r["real"]) for r in rows512] == [("chunked-sp++@512", 0.5, None)]
    # 512-token chunks over a long history: shorter steps than 2048-token ones
    assert rows512[0]["sim"]["tbt_p99"] < rows[0]["sim"]["tbt_p99"]

    # ConfluxServe planning with the shipped profile while a slower one times its steps
    slow = json.loads((root / "engine/scheduler/profiles/h200-llama-3.1-8b-n1.json").read_text())
    slow["f_gemm"] = {k: 1.3 * v for k, v in slow["f_gemm"].items()}
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.simulator", "resimulate", str(result), "--profile",
                           str(tmp_path / "slow.json"), "--plan-profile",
                           str(root / "engine/scheduler/profiles/h200-llama-3.1-8b-n1.json"), "--out", str(out),
                           "--systems", "conflux", "--rates", "0.5"], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [(r["system"], r["rate"]) for r in json.loads(out.read_text())["rows"]] == [("conflux", 0.5)]


def test_server_latency_reads_one_points_window_of_the_instances_tallies():
    from conflux_cluster.bench.goodput_compare import server_latency
    from conflux_cluster.tally import EDGES_MS, Tally

    a, b = Tally(), Tally()
    a.add(0.050)  # before the point
    before = [{"step_ms_counts": a.snapshot(), "itl_ms_counts": b.snapshot()}]
    for s in [0.018] * 97 + [0.095, 0.130, 0.400]:
        a.add(s)
    for s in [0.019] * 98 + [0.190, 0.210]:
        b.add(s)
    got = server_latency(before, [{"step_ms_counts": a.snapshot(), "itl_ms_counts": b.snapshot()}], tbt_s=0.1)
    assert got["server_steps"] == 100 and got["server_steps_over_tbt"] == 2  # 130 and 400 ms; not 95
    assert got["server_step_p50_ms"] == 20 and got["server_step_p99_ms"] == 140
    assert got["server_itl_p50_ms"] == 20 and got["server_itl_p99_ms"] == 200
    assert server_latency([{}], [{"step_scale": 1.0}], 0.1) == {}  # a server without tallies
    assert len(EDGES_MS) + 1 == len(a.snapshot())


def test_tally_quantiles_and_bad_windows():
    from conflux_cluster.tally import Tally, quantile_ms, window

    t = Tally()
    assert quantile_ms(t.snapshot(), 0.99) is None
    t.add(9.0)  # past the last edge
    assert quantile_ms(t.snapshot(), 0.5) == float("inf")
    with pytest.raises(ValueError, match="differ in length"):
        window([0, 1], t.snapshot())
    with pytest.raises(ValueError, match="quantile"):
        quantile_ms(t.snapshot(), 1.5)


def test_misses_name_the_late_requests_and_their_first_late_token():
    from conflux_cluster.bench.client import RequestResult
    from conflux_cluster.bench.goodput_compare import misses

    def res(arrival, times, finish="length"):
        return RequestResult(input_len=100, output_len=len(times), arrival_s=arrival, chunk_times=list(times),
                             output_tokens=len(times), finish_reason=finish)

    ok = res(0.0, [0.5, 0.6, 0.7])
    slow_first = res(1.0, [7.0, 7.05])  # TTFT 6 s > 5 s
    late_third = res(0.0, [0.5, 0.6, 5.3])  # token 3's deadline: 5 + 2 * 0.1 = 5.2
    unfinished = res(0.0, [0.5], finish=None)
    got = misses([ok, slow_first, late_third, unfinished], ttft_s=5.0, tbt_s=0.1)
    assert [(m["ttft_s"], m["first_late_token"]) for m in got] == [(6.0, 1), (0.5, 3), (0.5, None)]


def test_a_workload_spec_may_carry_its_own_prompt_scale():
    from conflux_cluster.bench.goodput_compare import shape_workload, workload_spec

    assert workload_spec("synthetic", 1.0) == ("synthetic", 1.0)
    assert workload_spec("synthetic:0.5", 1.0) == ("synthetic", 0.5)
    full, half = (shape_workload("synthetic", 10, 200_000, workload_spec(w)[1]) for w in ("synthetic", "synthetic:0.5"))
    assert [round(r.prompt_len / 2) for r in full.requests] == [r.prompt_len for r in half.requests]


def test_a_baseline_may_name_its_token_budget():
    """The paper sweeps the chunked baselines' token budget and keeps the best (§8): chunked-sp++@512 is
    chunked-sp++ with --max-num-batched-tokens 512, in the server's flags and the simulator's model."""
    from conflux_cluster.bench.served_systems import pick
    from conflux_cluster.sim.limits import EngineLimits

    s512, plain = pick("chunked-sp++@512,chunked-sp++")
    assert s512.name == "chunked-sp++@512" and s512.policy == "srpt" and s512.xp_mode == "uniform-sp"
    assert s512.server_args()[-2:] == ["--max-num-batched-tokens", "512"]
    assert "--max-num-batched-tokens" not in plain.server_args()
    assert s512.file_name == "chunked-sppp-b512"
    limits = EngineLimits.from_engine()  # the GPU default budget, 2048
    assert ("budget", 512) in s512.sim_config(limits).knobs and ("budget", 2048) in plain.sim_config(limits).knobs
    for bad in ("conflux@512", "chunked-sp++@", "chunked-sp++@0", "chunked-sp++@x", "loong@512"):
        with pytest.raises(ValueError, match="unknown systems"):
            pick(bad)


def test_conflux_may_name_its_step_stretch():
    """conflux@x4 is conflux with --max-step-stretch 4, in the server's flags and the simulator's model."""
    from conflux_cluster.bench.served_systems import pick
    from conflux_cluster.sim.limits import EngineLimits

    x4, pc2, plain = pick("conflux@x4,conflux-pc@x2.5,conflux")
    assert (x4.xp_mode, x4.policy, x4.stretch) == ("xp", "slo", 4.0)
    assert x4.server_args()[-2:] == ["--max-step-stretch", "4"] and pc2.server_args()[-1] == "2.5"
    assert "--max-step-stretch" not in plain.server_args() and x4.file_name == "conflux-bx4"
    assert ("stretch", 4.0) in x4.sim_config(EngineLimits.from_engine()).knobs
    for bad in ("conflux@x0.5", "conflux@x17", "conflux@xx", "conflux@4", "chunked-sp@x2"):
        with pytest.raises(ValueError, match="unknown systems"):
            pick(bad)


def test_the_simulator_held_to_a_served_run_models_its_pipelining():
    """gpu_goodput's simulator twin defers first decodes as the served (async-scheduling) engine does;
    `conflux simulate`'s limits do not."""
    from benchmarks import gpu_goodput as gg

    args = gg.parse_args(["--model", "llama-3.1-8b", "--device", "cuda", "--ranks", "1", "--profile", "roofline"])
    system = pick("conflux")[0]
    ecfg = gg.engine_config(args, system)
    setting = gg.sim_setting(args, system, ecfg, None)
    assert ecfg.async_scheduling and setting.limits.pipelined
    assert not EngineLimits.from_engine().pipelined


def test_one_device_serves_the_uniform_baselines_as_xp():
    """On one rank uniform SP / TP compute what XP computes: the baselines get the engine's graphed
    decode there (their order and budget stay), and keep their own mode on more ranks."""
    for name in ("chunked-sp", "chunked-tp++", "chunked-sp@4096"):
        s = pick(name)[0]
        one, two = s.server_args(1), s.server_args(2)
        assert one[:2] == ["--xp-mode", "xp"] and two[:2] == ["--xp-mode", s.xp_mode]
        assert one[2:] == two[2:]
        lim = EngineLimits.from_engine()  # the simulator models what was served: XP on one rank
        assert s.sim_config(lim, 1).kind == "conflux" and s.sim_config(lim, 2).kind == SIM_KIND[s.xp_mode]
        assert s.sim_config(lim, 1).policy == s.policy and ("budget", s.budget or 2048) in s.sim_config(lim, 1).knobs
    for name in ("no-cobatch", "conflux", "router-round_robin"):
        s = SYSTEMS[name]
        assert s.server_args(1)[:2] == ["--xp-mode", s.xp_mode]


def test_server_prefix_is_one_points_share_over_all_instances():
    from conflux_cluster.bench.goodput_compare import server_prefix

    before = [{"prefix_cache_queries": 100, "prefix_cache_hits": 40}, {"prefix_cache_queries": 0, "prefix_cache_hits": 0}]
    after = [{"prefix_cache_queries": 1100, "prefix_cache_hits": 340}, {"prefix_cache_queries": 1000, "prefix_cache_hits": 0}]
    assert server_prefix(before, after) == {"server_cached_fraction": 300 / 2000}
    assert server_prefix(before, before) == {}  # nothing started in the window
    assert server_prefix([{}], [{"step_scale": 1.0}]) == {}  # no prefix cache on the server
