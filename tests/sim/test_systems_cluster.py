"""Every system completes a small workload correctly; cluster routing; the CLI end to end."""

from __future__ import annotations

import json

import pytest

from conflux_cluster.commands.simulate import main as simulate_main
from conflux_cluster.router.registry import make_policy
from conflux_cluster.sim.cluster import run_cluster
from conflux_cluster.sim.core import Simulation
from conflux_cluster.sim.hardware import get_hardware, get_model
from conflux_cluster.sim.metrics import summarize
from conflux_cluster.slo import SLO
from conflux_cluster.sim.registry import ALL_SYSTEMS, Setting, sweep
from conflux_cluster.sim.workloads import cap_lengths, make_workload, scale_to_rate, toolagent_like

QWEN = get_model("qwen-32b")
S32 = Setting(QWEN, get_hardware("h200"), 8, 2, SLO(2.0, 0.1))
WL = cap_lengths(toolagent_like(40, seed=11), QWEN.max_context)


@pytest.mark.parametrize("system", ALL_SYSTEMS)
def test_every_configuration_serves_every_token(system):
    for cfg in sweep(system, S32):
        res = Simulation(cfg.build(S32), scale_to_rate(WL, 1.0), S32.slo).run()
        assert len(res.records) == len(WL)
        for r in res.records:
            assert len(r.token_times) == r.output_len, cfg.label
            assert r.token_times[0] > r.arrival
            assert all(b >= a for a, b in zip(r.token_times, r.token_times[1:]))


def test_low_load_meets_slo_and_tbt_bound():
    """At a trickle every system meets the (loose) SLO; XP's steps respect the TBT SLO."""
    for system in ("conflux", "chunked++", "distserve++", "loongserve++", "muxwise++"):
        cfg = sweep(system, S32, quick=True)[0]
        summ = summarize(Simulation(cfg.build(S32), scale_to_rate(WL, 0.2), S32.slo).run().records, S32.slo)
        assert summ.attainment >= 0.95, system
    cfg = sweep("conflux", S32)[0]
    summ = summarize(Simulation(cfg.build(S32), scale_to_rate(WL, 2.0), S32.slo).run().records, S32.slo)
    assert summ.tbt["p99"] <= S32.slo.tbt_s * 1.01


def test_cluster_routes_and_times_decisions():
    s = Setting(get_model("llama-8b"), get_hardware("h200"), 4, 1, SLO(1.0, 0.05))
    wl = cap_lengths(make_workload("conversation", 80), s.model.max_context)
    out = {p: run_cluster(s, wl, "conflux", 4, p, rate=4.0) for p in ("lowest_load", "round_robin")}
    assert all(0 < o["router_us"] < 5000 for o in out.values())
    assert all(0.0 <= o["attainment"] <= 1.0 for o in out.values())
    # round robin spreads arrivals exactly evenly
    counts = [0] * 4
    rr = make_policy("round_robin")

    def factory(rec):
        return sweep("conflux", s, quick=True)[0].build(s)(rec)

    sim = Simulation(factory, scale_to_rate(wl, 4.0), s.slo, 4, rr)
    orig = [inst.admit for inst in sim.instances]
    for i, inst in enumerate(sim.instances):
        inst.admit = (lambda i: lambda req, now: (counts.__setitem__(i, counts[i] + 1), orig[i](req, now)))(i)
    sim.run()
    assert counts == [20, 20, 20, 20]


def test_cli_writes_table_json_and_plot(tmp_path, capsys):
    rc = simulate_main(["--model", "qwen-14b", "--ttft", "2", "--tbt", "0.1", "--workload", "toolagent",
                        "--num-requests", "40", "--systems", "conflux,chunked++", "--quick", "--rates", "1,3",
                        "--out", str(tmp_path), "--name", "t", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "conflux" in out and "chunked++" in out and "generated" in out
    doc = json.loads((tmp_path / "t.json").read_text())
    assert set(doc["systems"]) == {"conflux", "chunked++"} and (tmp_path / "t.png").stat().st_size > 1000
    assert [p[0] for p in doc["systems"]["conflux"]["curve"]] == [1.0, 3.0]


def test_cli_rejects_bad_input(tmp_path, capsys):
    """User mistakes: exit status 2 and one 'conflux simulate: error:' line naming the problem, no traceback."""
    def error_of(*argv: str) -> str:
        assert simulate_main([*argv, "--out", str(tmp_path), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("conflux simulate: error: ") and "Traceback" not in err, err
        return err

    assert "unknown systems" in error_of("--systems", "vllm")
    assert "unknown model" in error_of("--model", "gpt-5")
    assert "no such file" in error_of("--trace", str(tmp_path / "missing.jsonl"))
    assert "only read with --workload file" in error_of("--trace", str(tmp_path / "t.csv"), "--workload", "synthetic")
    assert "needs --trace" in error_of("--workload", "file")
    assert "No such file" in error_of("--profile", str(tmp_path / "missing.json"))


def test_cli_trace_alone_is_replayed_with_timestamp_arrivals(tmp_path, capsys):
    """``--trace FILE`` without ``--workload`` replays that file (it used to run the default workload);
    its arrival column may hold ISO timestamps."""
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,900,20\n"
                     "2023-11-16 18:15:47.18,700,30\n2023-11-16 18:15:49.68,500,10\n")
    rc = simulate_main(["--trace", str(trace), "--columns", "TIMESTAMP,ContextTokens,GeneratedTokens",
                        "--num-requests", "3", "--systems", "conflux", "--quick", "--rates", "1",
                        "--out", str(tmp_path), "--name", "t", "--no-progress"])
    assert rc == 0
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["setting"]["workload"] == "azure" and doc["setting"]["workload_stats"]["prompt_mean"] == 700
    assert doc["setting"]["workload_stats"]["rate"] == pytest.approx(2 / 3.0)  # 3 arrivals over 3.0 s


def test_simulate_flags_out_of_range_fail_before_simulating():
    from conflux_cluster.cli import build_parser
    from conflux_cluster.commands.simulate import check_args

    parse = build_parser().parse_args
    check_args(parse(["simulate"]))  # the defaults are valid
    for argv, flag in ((["--gpus", "0"], "--gpus"), (["--ttft", "0"], "--ttft"), (["--tbt", "nan"], "--tbt"),
                       (["--num-requests", "0"], "--num-requests"), (["--offset", "-1"], "--offset"),
                       (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization")):
        with pytest.raises(ValueError, match=flag):
            check_args(parse(["simulate", *argv]))


def test_simulate_rejects_non_finite_numbers_and_unwritable_outputs(tmp_path, capsys):
    """--rates nan used to end in a KeyError deep in admission, inf ran; outputs are checked before
    anything is simulated (a file as --out, a folder in --name)."""
    import math

    from conflux_cluster.cli import build_parser
    from conflux_cluster.commands.simulate import check_args

    for rates in ("nan", "2,inf", "0", "-1", "2,x"):
        with pytest.raises(SystemExit) as e:
            simulate_main(["--rates", rates, "--out", str(tmp_path), "--no-progress"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --rates" in err and "Traceback" not in err, err
    with pytest.raises(SystemExit):
        simulate_main(["--time-unit", "inf"])
    assert "argument --time-unit" in capsys.readouterr().err
    with pytest.raises(ValueError, match="rate"):
        scale_to_rate(WL, math.nan)

    parse = build_parser().parse_args
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    check_args(parse(["simulate", "--out", str(tmp_path / "new" / "deeper"), "--name", "run1"]))  # made later
    for argv, match in ((["--ttft", "inf"], "--ttft"), (["--cv", "inf"], "--cv"),
                        (["--prefix-weight", "nan"], "--prefix-weight"),
                        (["--out", str(a_file)], "--out.*not a folder"),
                        (["--out", str(a_file / "sub")], "--out.*not a folder"),
                        (["--out", str(tmp_path), "--name", "a/b"], "--name"),
                        (["--out", str(tmp_path), "--name", ".."], "--name")):
        with pytest.raises(ValueError, match=match):
            check_args(parse(["simulate", *argv]))
    assert simulate_main(["--out", str(a_file), "--no-progress", "--rates", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("conflux simulate: error: --out") and "Traceback" not in err


def test_simulate_profile_that_is_not_a_profile_is_named(tmp_path, capsys):
    """A binary file, broken JSON or a JSON without a profile's fields as --profile: one line naming the
    flag, the file and what is wrong (not a UnicodeDecodeError / JSONDecodeError / TypeError)."""
    cases = {"bin.json": (b"\x89PNG\r\n\x1a\n\x00", "not a text file"), "cut.json": (b'{"model": "m",', "invalid JSON"),
             "list.json": (b"[1, 2]", "not an estimator profile"),
             "partial.json": (b'{"model": "m", "hardware": "h", "num_ranks": 1}', "missing field(s) num_layers"),
             "typo.json": (json.dumps({"model": "m", "hardware": "h", "num_ranks": 1, "num_layers": 2,
                                       "f_gemm": {"slope": 1, "intercept": 0}, "f_prefill_attn": [1, 2],
                                       "f_decode_attn": {"slope": 1, "intercept": 0},
                                       "f_comm": {"slope": 1, "intercept": 0}}).encode(), "field f_prefill_attn")}
    for name, (data, what) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        assert simulate_main(["--profile", str(path), "--out", str(tmp_path), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"conflux simulate: error: --profile {path}: ") and what in err, err
        assert "Traceback" not in err
