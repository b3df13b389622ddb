"""``conflux bench`` workload/report and ``conflux serve`` flag parsing: pure Python, no Ray."""

from __future__ import annotations

import json

import pytest

from conflux_cluster.bench.client import RequestResult
from conflux_cluster.bench.report import meets_token_deadlines, summarize
from conflux_cluster.bench.workload import LengthPolicy, load_trace, synthetic
from conflux_cluster.cli import build_parser
from conflux_cluster.commands.serve import config_from_args
from conflux_cluster.data import TRACES_DIR

TRACES = TRACES_DIR


def test_trace_replay_scales_rate_and_lengths(tmp_path):
    f = tmp_path / "t.jsonl"
    rows = [(0, 1000, 10), (500, 2000, 20), (1500, 3000, 30), (2000, 400000, 5)]
    f.write_text("\n".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": []})
                           for t, i, o in rows))
    reqs = load_trace(f, rate_scale=2.0)  # twice the trace's rate: half the gaps
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 0.75, 1.0]
    reqs = load_trace(f, request_rate=4.0, lengths=LengthPolicy(0.1, max_model_len=2048))
    assert reqs[-1].arrival_s == pytest.approx(4 / 4.0)  # n / rate
    assert [(r.input_len, r.output_len) for r in reqs[:3]] == [(100, 1), (200, 2), (300, 3)]
    assert reqs[3].input_len + reqs[3].output_len <= 2048  # capped to the context
    with pytest.raises(ValueError, match="lacks"):
        (tmp_path / "bad.jsonl").write_text('{"timestamp": 0}\n')
        load_trace(tmp_path / "bad.jsonl")


@pytest.mark.skipif(not (TRACES / "mooncake_conversation_trace.jsonl").is_file(), reason="traces not present")
def test_real_mooncake_trace_loads():
    reqs = load_trace(TRACES / "mooncake_conversation_trace.jsonl", num_requests=200)
    assert len(reqs) == 200 and reqs[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert sum(r.input_len for r in reqs) / 200 > 1000  # long-context prompts


def test_synthetic_poisson_rate():
    reqs = synthetic(2000, 100, 10, request_rate=5.0, seed=1)
    rate = len(reqs) / reqs[-1].arrival_s
    assert 4.5 < rate < 5.5 and {r.input_len for r in reqs} == {100}


def _result(arrival: float, times: list[float], n: int | None = None) -> RequestResult:
    r = RequestResult(10, len(times), arrival_s=arrival, chunk_times=times, end_s=times[-1])
    r.output_tokens = n or len(times)
    return r


def test_report_metrics_and_goodput():
    ok = _result(0.0, [0.5, 0.6, 0.7, 0.8])  # TTFT 0.5, TPOT 0.1
    slow_tbt = _result(1.0, [1.2, 2.0, 2.1])  # TTFT 0.2, a 0.8 s gap
    failed = RequestResult(10, 4, arrival_s=0.0, error="HTTP 500")
    rep = summarize([ok, slow_tbt, failed], duration=4.0, ttft_slo=1.0, tbt_slo=0.2)
    assert (rep.completed, rep.failed, rep.total_output_tokens) == (2, 1, 7)
    assert rep.ttft.mean_ms == pytest.approx(350.0) and rep.ttft.median_ms == pytest.approx(350.0)
    assert rep.tpot.mean_ms == pytest.approx((100.0 + 450.0) / 2)
    assert rep.itl.mean_ms == pytest.approx(1e3 * (0.1 * 3 + 0.8 + 0.1) / 5)
    assert rep.request_goodput == pytest.approx(1 / 4.0)  # only `ok` meets TPOT <= 200 ms
    # per-token deadlines: token 2 of slow_tbt came 1.0 s after arrival <= 1.0 + 1 * 0.2
    assert meets_token_deadlines(slow_tbt, 1.0, 0.2)
    assert not meets_token_deadlines(slow_tbt, 0.1, 0.2)
    assert rep.slo_attainment == pytest.approx(2 / 3)
    assert "Serving Benchmark Result" in rep.format() and rep.errors == ["HTTP 500"]


def test_serve_flags_and_yaml(tmp_path):
    parser = build_parser()
    args = parser.parse_args(["serve", "--instances", "3", "--router-policy", "power_of_two", "--port", "0"])
    cfg = config_from_args(args)
    assert (cfg.instances, cfg.router_policy.value, cfg.port, cfg.host) == (3, "power_of_two", 0, "127.0.0.1")
    defaults = config_from_args(parser.parse_args(["serve"]))
    assert (defaults.port, defaults.instances, defaults.ranks, defaults.model) == (8000, None, None,
                                                                                  "smollm2-135m-instruct")
    f = tmp_path / "s.yaml"
    f.write_text("instances: 2\nport: 9001\n")
    cfg = config_from_args(parser.parse_args(["serve", "--config", str(f), "--port", "9002"]))
    assert (cfg.instances, cfg.port) == (2, 9002)  # explicit flags win over the file
    with pytest.raises(ValueError, match="router_policy"):
        config_from_args(parser.parse_args(["serve", "--router-policy", "fastest"]))
