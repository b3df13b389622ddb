"""The policy matrix's pure parts (conflux_cluster/bench/policy_matrix.py): workload shapes, aggregation over
seeds, the issue-39 targets, and one simulated point of each policy."""

from __future__ import annotations

import pytest

from conflux_cluster.bench import policy_matrix as pm


def test_shapes_have_the_lengths_and_arrivals_they_promise():
    uni = pm.shape_workload(pm.SHAPES["uniform"], 10.0, 30.0, seed=1)
    assert len(uni) == 300 and {(r.prompt_len, r.output_len) for r in uni.requests} == {(2048, 128)}
    assert uni.mean_rate == pytest.approx(10.0, rel=0.2)
    mix = pm.shape_workload(pm.SHAPES["longmix"], 20.0, 50.0, seed=2)
    longs = sum(r.prompt_len == 32768 for r in mix.requests)
    assert 0.02 * len(mix) < longs < 0.09 * len(mix)
    assert pm.shape_workload(pm.SHAPES["bursty"], 5.0, 20.0, 3).requests == \
        pm.shape_workload(pm.SHAPES["bursty"], 5.0, 20.0, 3).requests  # seeded: both policies see the same
    tiny = pm.shape_workload(pm.SHAPES["longmix"], 20.0, 10.0, 2, length_scale=0.01, max_context=256)
    assert all(r.prompt_len + r.output_len <= 256 for r in tiny.requests)


def _pt(shape, factor, policy, seed, att, p99):
    return {"shape": shape, "factor": factor, "rate": factor * 10, "policy": policy, "seed": seed,
            "attainment": att, "ttft_p50": p99 / 4, "ttft_p99": p99, "tbt_p99": 0.09}


def test_verdict_names_each_missed_target():
    pts = [_pt("u", 1.0, "slo", s, a, 1.0) for s, a in ((1, 0.97), (2, 0.95))]
    pts += [_pt("u", 1.0, "fcfs", s, 0.99, 0.4) for s in (1, 2)]
    pts += [_pt("u", 1.5, "slo", 1, 0.5, 2.0), _pt("u", 1.5, "fcfs", 1, 0.3, 9.0)]
    rows = pm.aggregate(pts)
    slo = next(r for r in rows if r["policy"] == "slo" and r["factor"] == 1.0)
    assert (slo["attainment"], slo["attainment_min"], slo["seeds"]) == (pytest.approx(0.96), 0.95, 2)
    v = pm.verdict(rows)
    assert not v["attainment_within_2_points"] and v["attainment_failures"] == ["u@1x: 96.0 vs 99.0 %"]
    assert not v["ttft_p99_within_2x"] and len(v["ttft_p99_failures"]) == 1  # 1.0 > 2 x 0.4, at 1x only
    assert v["goodput_at_least_fcfs"] and v["goodput"] == {"u": {"slo": 10.0, "fcfs": 10.0}}
    table = pm.markdown(rows)
    assert "| u | 1.5 | 15 | 50.0 (50–50) | 30.0 (30–30) |" in table


def test_one_simulated_point_per_policy_runs_the_engine_scheduler():
    setting = pm.sim_setting(str(pm.DEFAULT_PROFILE), 1.0, 0.1)
    wl = pm.shape_workload(pm.SHAPES["uniform"], 4.0, 2.0, seed=1)
    for policy in pm.POLICIES:
        p = pm.sim_point(pm.sim_factory(setting, policy), wl, setting.slo)
        assert p["requests"] == len(wl) == p["completed"] and p["attainment"] == 1.0  # well below the knee


def test_a_lone_long_prompt_is_faster_with_the_idle_step_stretch():
    """No decode rides in a lone prompt's steps: at idle_step_stretch 4 its chunks stay large as its
    history grows (the shipped H200 profile: 131K tokens in ~12.5 s simulated, ~15.7 s at 1)."""
    from dataclasses import replace

    import conflux_cluster.bench.policy_matrix as pm
    from conflux_cluster.sim.registry import SystemConfig

    setting = pm.sim_setting(str(pm.DEFAULT_PROFILE), 1.0, 0.1)
    lone = replace(pm.SHAPES["longmix"], long_share=1.0, long_prompt=131064, prompt=(131064, 131064))
    wl = pm.shape_workload(lone, 0.05, 20.0, 1)
    ttft = {f: pm.sim_point(SystemConfig("slo", "conflux", "slo", (("idle_stretch", f),)).build(setting), wl,
                            setting.slo)["ttft_p50"] for f in (1.0, 4.0)}
    assert ttft[4.0] < 0.9 * ttft[1.0]


def test_scheduler_fields_reach_the_simulated_scheduler():
    """``policy_matrix --scheduler FIELD=VALUE`` sets a SchedulerConfig field on the simulated scheduler
    (as ``conflux serve --FIELD VALUE`` on the served one): past the knee, deferred requests that never
    jump ahead (a huge deferred_wait_factor) leave the admitted ones more room than the default."""
    from benchmarks.policy_matrix import parse_args

    setting = pm.sim_setting(str(pm.DEFAULT_PROFILE), 1.0, 0.1)
    wl = pm.shape_workload(pm.SHAPES["uniform"], 2.5 * pm.SHAPES["uniform"].knee, 6.0, seed=1)
    default = pm.sim_point(pm.sim_factory(setting, "slo"), wl, setting.slo)
    never = pm.sim_point(pm.sim_factory(setting, "slo", (("deferred_wait_factor", "1000"),)), wl, setting.slo)
    assert never["attainment"] > default["attainment"] and never["ttft_p99"] > default["ttft_p99"]
    args = parse_args(["--sim", "--scheduler", "deferred_wait_factor=3", "--out", "/dev/null"])
    assert args.scheduler == (("deferred_wait_factor", "3"),)
    for bad in ("deferred_wait_factor", "no_such_field=1", "deferred_wait_factor=-1"):
        with pytest.raises(SystemExit):
            parse_args(["--sim", "--scheduler", bad, "--out", "/dev/null"])


def test_repeats_of_the_same_arrivals_report_their_spread():
    """Runs of one seed's arrivals: the row pools them, ``repeat_spread`` is the mean over seeds of each
    seed's max - min, and the verdict names points where slo spreads wider than fcfs."""
    pts = [{**_pt("u", 1.0, "slo", s, a, 1.0), "repeat": r}
           for s, runs in ((1, (0.90, 0.94)), (2, (0.96, 0.96))) for r, a in enumerate(runs)]
    pts += [{**_pt("u", 1.0, "fcfs", s, a, 1.0), "repeat": r}
            for s, runs in ((1, (0.50, 0.90)), (2, (0.80, 0.90))) for r, a in enumerate(runs)]
    rows = pm.aggregate(pts)
    slo, fcfs = (next(r for r in rows if r["policy"] == p) for p in ("slo", "fcfs"))
    assert (slo["seeds"], slo["runs"]) == (2, 4)
    assert slo["repeat_spread"] == pytest.approx(0.02) and fcfs["repeat_spread"] == pytest.approx(0.25)
    v = pm.verdict(rows)
    assert v["spread_at_most_fcfs"] and v["spread_wider_than_fcfs"] == []
    assert "| u | 1 | 2 | 2.0 / 25.0 |" in pm.markdown(rows)
    flipped = pm.verdict(pm.aggregate([{**p, "policy": "fcfs" if p["policy"] == "slo" else "slo"} for p in pts]))
    assert flipped["spread_wider_than_fcfs"] == ["u@1x: 25.0 vs 2.0 points"]
    single = pm.aggregate([_pt("u", 1.0, "slo", 1, 0.9, 1.0)])
    assert single[0]["repeat_spread"] is None and "spread_at_most_fcfs" not in pm.verdict(single)


def test_simulated_repeats_draw_the_served_step_times_anew(tmp_path):
    """--sim --repeats: each run of the same arrivals scales its steps by another draw of the served
    measured / modelled ratios (a seed of its own), so runs differ; without a step log the flag is refused."""
    import json

    from benchmarks.policy_matrix import parse_args

    from conflux_cluster.engine.scheduler.estimator import BatchLoad, EstimatorProfile, LatencyEstimator

    log = tmp_path / "steps.jsonl"
    # served steps 0.5x-2x their estimate: a wide spread, so a run's draws change its outcome
    e = LatencyEstimator(EstimatorProfile.from_json(str(pm.DEFAULT_PROFILE)))
    rows = []
    for i in range(40):
        t = e.estimate(BatchLoad((2048,), (8,), (16384,), ((2048, 0),))).total
        rows.append({"seconds": t * (0.5 + 1.5 * (i % 4) / 3), "prefill_tokens": [2048], "decode_tokens": [8],
                     "decode_context": [16384], "prefill_chunks": [[2048, 0]]})
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    draws = []
    served = pm.sim_setting(str(pm.DEFAULT_PROFILE), 1.0, 0.1, step_logs=(str(log),))
    for r in range(2):
        setting = pm.rerun(served, r)
        wl = pm.shape_workload(pm.SHAPES["uniform"], pm.SHAPES["uniform"].knee, 6.0, seed=1)
        draws.append(pm.sim_point(pm.sim_factory(setting, "fcfs"), wl, setting.slo))
    assert draws[0] != draws[1]
    assert parse_args(["--sim", "--repeats", "2", "--step-log", str(log), "--out", "/dev/null"]).repeats == 2
    for bad in (["--sim", "--repeats", "2"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            parse_args([*bad, "--out", "/dev/null"])


def test_result_files_name_repository_files_relative_to_it():
    """A result JSON records its arguments; the default profile is a file of the repository, written relative
    to it (the same in anyone's checkout), not as this machine's absolute path."""
    from pathlib import Path

    from benchmarks.policy_matrix import REPO, parse_args
    from conflux_cluster.bench.server import run_record

    argv = ["--sim", "--step-log", str(REPO / "docs" / "x.jsonl"), "--out", "/dev/null"]
    rec = run_record(parse_args(argv), argv, REPO)
    assert rec["args"]["profile"] == "engine/scheduler/profiles/h200-llama-3.1-8b-n1.json"
    assert rec["args"]["step_log"] == ["docs/x.jsonl"] and rec["args"]["out"] == "/dev/null"
    assert not Path(rec["args"]["profile"]).is_absolute()
