"""``conflux bench`` workload/report/token counting and ``conflux serve`` flag parsing (pure Python),
and one slow end-to-end run of ``conflux bench`` against the real server (Ray, tiny random model)."""

from __future__ import annotations

import json

import pytest

from conflux_cluster.bench.client import RequestResult
from conflux_cluster.bench.report import meets_token_deadlines, summarize, vllm_result
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
    ok = '{"timestamp": 0, "input_length": 5, "output_length": 2}\n'
    for bad, message in (("not json", ":2: not JSON"), ("[1]", ":2:"), ('{"timestamp": NaN, "input_length": 5, '
                         '"output_length": 2}', "not finite"), ('{"timestamp": 1, "input_length": "x", '
                         '"output_length": 2}', ":2:")):
        (tmp_path / "bad.jsonl").write_text(ok + bad + "\n")
        with pytest.raises(ValueError, match=message):
            load_trace(tmp_path / "bad.jsonl")
    # out of order and zero lengths: replayed in arrival order, a length under 1 as 1
    (tmp_path / "odd.jsonl").write_text('{"timestamp": 900, "input_length": 0, "output_length": 3}\n' + ok)
    reqs = load_trace(tmp_path / "odd.jsonl")
    assert [(r.arrival_s, r.input_len) for r in reqs] == [(0.0, 5), (0.9, 1)]


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
    r = RequestResult(10, len(times), arrival_s=arrival, chunk_times=times, end_s=times[-1], finish_reason="length")
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


def _chunk(text: str, ids: list[int] | None = None, finish: str | None = None, usage: int | None = None) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    out = {"choices": [choice] if text is not None else []}
    if usage is not None:
        out["usage"] = {"prompt_tokens": 3, "completion_tokens": usage, "total_tokens": 3 + usage}
    return out


def test_client_counts_tokens_not_text():
    # A random-weight model: tokens 1-2 decode to nothing, token 3 completes a character, the
    # last chunk carries 3 tokens. TTFT is the first token's chunk, not the first text.
    r = RequestResult(3, 6, arrival_s=0.0)
    for t, c in [(0.2, _chunk("", [7])), (0.3, _chunk("", [8])), (0.4, _chunk("é", [9])),
                 (0.6, _chunk("ab", [1, 2, 3], finish="length")), (0.61, _chunk(None, usage=6))]:
        r.absorb(c, t)
    r.close(0.62)
    assert r.ok and r.finish_reason == "length" and r.output_tokens == 6
    assert r.ttft == pytest.approx(0.2)
    assert r.token_times == [0.2, 0.3, 0.4, 0.6, 0.6, 0.6]
    assert r.itls == pytest.approx([0.1, 0.1, 0.2, 0.0, 0.0])  # a k-token chunk: its gap, then k-1 zeros
    assert meets_token_deadlines(r, 0.2, 0.15) and not meets_token_deadlines(r, 0.19, 0.15)
    assert not meets_token_deadlines(r, 0.2, 0.1)  # token 4 (deadline 0.5) came at 0.6

    # No token ids (another server): text chunks count one token each, usage fixes the total,
    # the missing tokens came with the last text chunk.
    r = RequestResult(3, 6, arrival_s=0.0)
    for t, c in [(0.4, _chunk("é")), (0.5, _chunk("", finish="length")), (0.51, _chunk(None, usage=6))]:
        r.absorb(c, t)
    r.close(0.52)
    assert r.ok and r.output_tokens == 6 and r.token_times == [0.4] * 6 and r.ttft == pytest.approx(0.4)

    # Not completed: an in-band error, or a stream that ended without a finish_reason.
    err = RequestResult(3, 6)
    err.absorb(_chunk("", [5]), 0.1)
    err.absorb({"error": {"message": "boom", "type": "internal_error"}}, 0.2)
    err.close(0.3)
    cut = RequestResult(3, 6)
    cut.absorb(_chunk("x", [5]), 0.1)
    cut.close(0.2)
    assert not err.ok and err.error == "boom" and not cut.ok
    rep = summarize([r, err, cut], duration=1.0, ttft_slo=1.0, tbt_slo=0.1)
    assert (rep.completed, rep.failed, rep.total_output_tokens) == (1, 2, 6)
    flat = vllm_result(rep, [r, err, cut])
    assert flat["output_lens"] == [6, 0, 0] and flat["ttfts"][1:] == [0.0, 0.0]
    assert flat["mean_ttft_ms"] == pytest.approx(400.0) and flat["errors"] == ["", "boom", "no finish_reason"]
    assert flat["error_messages"] == ["boom"] and flat["generated_texts"] == ["é", "", "x"]


@pytest.mark.slow
def test_bench_against_real_server_counts_every_token(tmp_path, shared_ray):
    """``conflux bench`` through HTTP against ``conflux serve`` (Ray, 2 CPU ranks, tiny-llama with
    random weights, an API key): every request completes with exactly its output length, although
    most of the random model's tokens decode to no text."""
    import httpx
    from ray import serve

    from conflux_cluster.cli import main
    from conflux_cluster.config import ServeConfig
    from conflux_cluster.serve.app import run

    try:
        cfg = run(ServeConfig(model="tiny-llama", port=0, ranks=2, api_key="sk-bench",
                              num_kv_blocks=64))
        base = f"http://127.0.0.1:{cfg.port}"
        out = tmp_path / "bench.json"
        n, olen = 6, 12
        assert main(["bench", "--base-url", base, "--api-key", "sk-bench", "--num-prompts", str(n), "--ignore-eos",
                     "--input-len", "40", "--output-len", str(olen), "--save-result", str(out)]) == 0
        d = json.loads(out.read_text())
        assert (d["completed"], d["failed"], d["errors"]) == (n, 0, [""] * n)
        assert d["total_output_tokens"] == n * olen and d["output_lens"] == [olen] * n
        assert all(t > 0 for t in d["ttfts"]) and all(len(x) == olen - 1 for x in d["itls"])
        assert d["p99_ttft_ms"] >= d["median_ttft_ms"] > 0 and d["mean_itl_ms"] > 0

        # What the client reads: with return_token_ids every token has a chunk, text or not.
        body = {"model": "tiny-llama", "prompt": list(range(100, 140)), "max_tokens": olen, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        r = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer sk-bench"},
                       timeout=120)
        chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == olen
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        body.pop("return_token_ids")
        r = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer sk-bench"},
                       timeout=120)
        assert "token_ids" not in r.text  # only when asked

        # A wrong key is a clear error, not a report of failures.
        assert main(["bench", "--base-url", base, "--api-key", "wrong", "--num-prompts", "1"]) == 2
    finally:
        serve.shutdown()


def test_files_that_cannot_be_read_are_one_line_errors(tmp_path, capsys):
    """A --dataset-path, --trace or --file that is a folder, lies under a file, or cannot be read (as another
    user's file) raised IsADirectoryError / NotADirectoryError / PermissionError out of ``conflux``: a
    traceback, exit status 1. Only FileNotFoundError was a one-line error (exit status 2); every OSError is."""
    from conflux_cluster.cli import main

    from .fake_openai import FakeOpenAI

    folder = tmp_path / "data.jsonl"
    folder.mkdir()
    under_a_file = tmp_path / "notes.txt"
    under_a_file.write_text("x")
    with FakeOpenAI() as srv:
        bench = ["bench", "--base-url", srv.url, "--disable-tqdm", "--tokenizer", "tiny-llama"]
        for argv in ([*bench, "--dataset-name", "custom", "--dataset-path", str(folder)],
                     [*bench, "--dataset-name", "sharegpt", "--dataset-path", str(under_a_file / "sg.json"),
                      "--endpoint", "/v1/chat/completions"],
                     ["simulate", "--trace", str(folder), "--out", str(tmp_path / "sim"), "--no-progress"],
                     ["dashboards", "push", "--url", "http://127.0.0.1:9", "--token", "t", "--file", str(folder)]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert err.startswith(f"conflux {argv[0]}: error: ") and len(err.strip().splitlines()) == 1, (argv, err)
            assert "Traceback" not in err and ("Is a directory" in err or "Not a directory" in err), err
