"""``benchmarks/bursty.py report``: the estimator's error on logged steps (against the measured gap and
against the engine's own step time), and attainment against the ideal bound per rate over traces."""

from __future__ import annotations

import json

import pytest

from benchmarks import bursty


def _step(seconds: float, estimated: float, compute: float, chunks: list[list[int]]) -> str:
    return json.dumps({"seconds": seconds, "estimated_s": estimated, "compute_s": compute,
                       "prefill_tokens": [sum(c for c, _ in chunks)], "decode_tokens": [2], "decode_context": [900],
                       "prefill_chunks": chunks})


def test_report_splits_the_error_and_groups_rates_over_traces(tmp_path):
    log = tmp_path / "steps.0.jsonl"
    log.write_text("\n".join([_step(0.110, 0.100, 0.100, [[1024, 0]]),      # host lag of 10 ms: 10 % vs 0 %
                              _step(0.090, 0.100, 0.090, [[512, 0], [512, 64]]),  # engine 10 % faster
                              _step(0.050, 0.050, 0.050, [[2048, 0]])]) + "\n")
    traces = []
    for seed in (0, 1):
        path = tmp_path / f"b{seed}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in bursty.make_trace(40, 0.25, 1500, 7000, 15, 16000, seed)))
        traces.append(str(path))
    results = []
    for k, (trace, att) in enumerate([(traces[0], 0.8), (traces[1], 0.6)]):
        r = tmp_path / f"r{k}.json"
        r.write_text(json.dumps({"request_rate": 4.0, "slo_attainment": att, "trace": trace, "num_requests": None}))
        results.append(str(r))
    args = bursty.argparse.Namespace(step_log=str(log), full_step_tokens=1024, prefill_tok_s=30000.0,
                                     results=results, trace=traces, ttft_slo=1.0, out=str(tmp_path / "o.json"))
    out = bursty.report(args)
    steps = out["steps"]
    assert steps["mape_percent"] == pytest.approx(100 * (0.01 / 0.11 + 0.01 / 0.09) / 3, rel=1e-6)
    assert steps["engine_mape_percent"] == pytest.approx(100 * (0.01 / 0.09) / 3, rel=1e-6)
    assert steps["multi_chunk_share"] == pytest.approx(1 / 3)
    assert [p["trace"] for p in out["points"]] == traces
    bounds = [bursty.srpt_attainment(*_arrivals(t, 4.0), 30000.0, 1.0) for t in traces]
    assert [p["bound"] for p in out["points"]] == pytest.approx(bounds)
    b = out["by_rate"]["4"]
    assert b["runs"] == 2 and (b["attainment_min"], b["attainment_max"]) == pytest.approx((60.0, 80.0))
    assert b["of_bound_mean"] == pytest.approx((0.8 / bounds[0] + 0.6 / bounds[1]) / 2)
    assert json.loads((tmp_path / "o.json").read_text())["by_rate"]["4"]["runs"] == 2


def _arrivals(trace: str, rate: float) -> tuple[list[float], list[int]]:
    reqs = bursty.load_trace(trace, request_rate=rate)
    return [q.arrival_s for q in reqs], [q.input_len for q in reqs]


def test_sim_runs_the_points_against_the_same_bound_and_reads_gzipped_logs(tmp_path):
    """``bursty.py sim``: each trace at each rate through the simulator, per policy, against the bound the
    served report uses; a served step log may be gzipped (docs/results/steps/ keeps them so)."""
    import gzip

    log = tmp_path / "steps.0.jsonl.gz"
    with gzip.open(log, "wt") as f:
        f.write(_step(0.060, 0.050, 0.055, [[2048, 0]]) + "\n" + _step(0.050, 0.050, 0.050, [[1024, 0], [1024, 0]]) + "\n")
    trace = tmp_path / "b0.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in bursty.make_trace(30, 0.25, 1500, 7000, 15, 16000, 0)))
    bursty.main(["sim", "--trace", str(trace), "--rates", "2,400", "--policies", "slo,fcfs", "--step-log", str(log),
                 "--out", str(tmp_path / "s.json")])
    out = json.loads((tmp_path / "s.json").read_text())
    assert out["prefill_tok_s_for_bound"] == pytest.approx(4096 / 0.11)  # the log's full steps
    assert len(out["points"]) == 4 and {p["policy"] for p in out["points"]} == {"slo", "fcfs"}
    for p in out["points"]:
        assert p["bound"] == pytest.approx(bursty.srpt_attainment(*_arrivals(str(trace), p["rate"]),
                                                                  out["prefill_tok_s_for_bound"], 1.0))
    slo = out["by_policy"]["slo"]
    assert slo["2"]["attainment_mean"] > slo["400"]["attainment_mean"]  # 400 req/s: one burst of 60K tokens
    with pytest.raises(SystemExit):
        bursty.main(["sim", "--trace", str(trace), "--scheduler", "no_such_field=1"])


def test_report_without_full_steps_bounds_at_the_prefill_rate_and_without_steps_not_at_all(tmp_path, capsys):
    """Short prompts (a CPU smoke run) leave no step of >= 1,024 prompt tokens: the bound then prefills at
    the rate over every prefill step; with no step log and no --prefill-tok-s there is no bound to divide by."""
    log = tmp_path / "steps.0.jsonl"
    log.write_text(_step(0.010, 0.010, 0.010, [[100, 0]]) + "\n" + _step(0.010, 0.010, 0.010, [[60, 0], [40, 0]]) + "\n")
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in bursty.make_trace(10, 0.25, 60, 300, 4, 400, 0)))
    r = tmp_path / "r.json"
    r.write_text(json.dumps({"request_rate": 2.0, "slo_attainment": 1.0, "trace": str(trace), "num_requests": None,
                             "admission": [{"fallbacks": 1, "fallback": False}]}))
    args = bursty.argparse.Namespace(step_log=str(log), full_step_tokens=1024, prefill_tok_s=None, results=[str(r)],
                                     trace=[str(trace)], ttft_slo=1.0, out=None)
    out = bursty.report(args)
    assert out["prefill_tok_s_for_bound"] == pytest.approx(200 / 0.02)
    assert out["points"][0]["bound"] == pytest.approx(bursty.srpt_attainment(*_arrivals(str(trace), 2.0), 10000.0, 1.0))
    assert "fell back to FCFS 1 time(s)" in capsys.readouterr().out
    args.step_log = None
    out = bursty.report(args)
    assert out["points"][0]["bound"] is None and out["points"][0]["of_bound"] is None
    assert "no bound" in capsys.readouterr().out
