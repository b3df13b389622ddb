"""``conflux bench``'s vLLM options against a stand-in server (tests/serve/fake_openai.py, stdlib HTTP on a
free port): endpoints, datasets read from local files, --ignore-eos, --api-key, --goodput,
--metric-percentiles, --burstiness, the saved JSON's vLLM keys. No Ray, no model."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from conflux_cluster.bench.client import RequestResult
from conflux_cluster.bench.report import GoodputSLO, percentile, summarize, vllm_result
from conflux_cluster.bench.workload import synthetic
from conflux_cluster.cli import main

from .fake_openai import FakeOpenAI


def _bench(srv: FakeOpenAI, tmp_path, *argv: str) -> dict:
    out = tmp_path / "r.json"
    rc = main(["bench", "--base-url", srv.url, "--disable-tqdm", "--save-result", str(out), *argv])
    assert rc == 0
    return json.loads(out.read_text())


def test_completions_random_ignore_eos_and_api_key(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with FakeOpenAI(api_key="sk-1") as srv:
        d = _bench(srv, tmp_path, "--api-key", "sk-1", "--num-prompts", "4", "--input-len", "20",
                   "--output-len", "6", "--ignore-eos", "--metric-percentiles", "50,90,99.9",
                   "--goodput", "ttft:60000", "tpot:60000", "e2el:60000")
        paths = {p for p, _, _ in srv.requests}
        bodies = [b for p, _, b in srv.requests if p == "/v1/completions"]
        assert paths == {"/v1/completions"}
        assert all(h["Authorization"] == "Bearer sk-1" for _, h, _ in srv.requests)
        assert all(b["ignore_eos"] and b["return_token_ids"] and len(b["prompt"]) == 20 and b["max_tokens"] == 6
                   for b in bodies)
        # vLLM's flat keys, its percentiles naming and per-request arrays
        assert (d["completed"], d["total_output_tokens"], d["output_lens"], d["input_lens"]) == (4, 24, [6] * 4,
                                                                                                [20] * 4)
        for m in ("ttft", "tpot", "itl", "e2el"):
            assert {f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms", f"p50_{m}_ms", f"p90_{m}_ms",
                    f"p99.9_{m}_ms"} <= set(d)
        assert "p99_ttft_ms" not in d  # only the percentiles asked for
        assert d["request_goodput"] > 0 and d["errors"] == [""] * 4 and d["generated_texts"] == ["x" * 6] * 4
        assert (d["backend"], d["endpoint"], d["model_id"], d["burstiness"]) == ("openai", "/v1/completions",
                                                                                 "fake-model", 1.0)

        # the same key from OPENAI_API_KEY (vLLM's variable); a wrong key: exit 2 and a message, not a report
        monkeypatch.setenv("OPENAI_API_KEY", "sk-1")
        assert _bench(srv, tmp_path, "--num-prompts", "1", "--output-len", "2")["completed"] == 1
        monkeypatch.delenv("OPENAI_API_KEY")
        assert main(["bench", "--base-url", srv.url, "--disable-tqdm", "--num-prompts", "1"]) == 2


def test_without_ignore_eos_outputs_end_at_eos(tmp_path):
    with FakeOpenAI(eos_after=3) as srv:
        d = _bench(srv, tmp_path, "--num-prompts", "3", "--output-len", "8")
        assert not any("ignore_eos" in b for p, _, b in srv.requests if p == "/v1/completions")
    assert d["output_lens"] == [3, 3, 3] and d["completed"] == 3  # ended early ("stop"), still completed


def test_chat_endpoint_with_sharegpt_and_custom_files(tmp_path, capsys):
    convs = [{"conversations": [{"from": "human", "value": f"question number {i} " * 3},
                                {"from": "gpt", "value": "an answer of some length"}]} for i in range(6)]
    convs.append({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "too short"}]})
    convs.append({"conversations": [{"from": "human", "value": "one turn only"}]})
    share = tmp_path / "sharegpt.json"
    share.write_text(json.dumps(convs))
    custom = tmp_path / "prompts.jsonl"
    custom.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(5)))
    with FakeOpenAI() as srv:
        d = _bench(srv, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset-name", "sharegpt",
                   "--dataset-path", str(share), "--tokenizer", "tiny-llama", "--num-prompts", "6",
                   "--ignore-eos", "--print-json")
        chat = [b for p, _, b in srv.requests if p == "/v1/chat/completions"]
        sent = sorted(b["messages"][0]["content"] for b in chat)
        assert sent == sorted(c["conversations"][0]["value"] for c in convs[:6])  # the filter drops "hi"
        assert {b["max_completion_tokens"] for b in chat} == {len("an answer of some length")}  # tiny-llama: bytes
        assert d["backend"] == "openai-chat" and d["completed"] == 6
        assert sorted(d["input_lens"]) == sorted(len(b["messages"][0]["content"].encode()) for b in chat)  # usage's
        printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
        assert json.loads(printed[-1])["completed"] == 6  # --print-json: the result in the log

        srv.requests.clear()
        d = _bench(srv, tmp_path, "--dataset-name", "custom", "--dataset-path", str(custom),
                   "--tokenizer", "tiny-llama", "--custom-output-len", "2", "--num-prompts", "5", "--ignore-eos")
        assert sorted(b["prompt"] for p, _, b in srv.requests if p == "/v1/completions") == [f"prompt {i}" for i in
                                                                                                range(5)]
        assert d["output_lens"] == [2] * 5


def test_bench_user_errors_are_one_line(tmp_path, capsys):
    sharegpt = {}  # ShareGPT files of the wrong shape: turns that are text, numbers, or values that are not text
    for name, entry in (("text", {"conversations": "a conversation"}), ("ints", {"conversations": [1, 2]}),
                        ("value", {"conversations": [{"value": 5}, {"value": "six"}]})):
        sharegpt[name] = tmp_path / f"{name}.json"
        sharegpt[name].write_text(json.dumps([entry]))
    chat_sharegpt = ["--dataset-name", "sharegpt", "--tokenizer", "tiny-llama", "--endpoint", "/v1/chat/completions"]
    with FakeOpenAI() as srv:
        for path in sharegpt.values():  # AttributeError tracebacks before
            assert main(["bench", "--base-url", srv.url, *chat_sharegpt, "--dataset-path", str(path)]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"conflux bench: error: {path}: entry 0: ") and "Traceback" not in err, err
        for argv, message in [(["--dataset-name", "sharegpt"], "--dataset-path"),
                              (["--dataset-name", "custom", "--dataset-path", str(tmp_path / "none.jsonl"),
                                "--tokenizer", "tiny-llama"], "No such file"),
                              (["--goodput", "ttft=5"], "ttft:MS"),
                              (["--metric-percentiles", "50,101"], "[0, 100]"),
                              (["--trace", "mooncake-conversation", "--endpoint", "/v1/chat/completions"], "--trace"),
                              (["--endpoint", "/v1/chat/completions", "--tokenizer", "no-such-model"], "tokenizer")]:
            assert main(["bench", "--base-url", srv.url, "--disable-tqdm", *argv]) == 2, argv
            err = capsys.readouterr().err
            assert err.startswith("conflux bench: error:") and message in err and "Traceback" not in err, (argv, err)


def test_report_percentiles_std_and_goodput_bounds():
    xs = [0.1, 0.2, 0.4, 0.8, 1.6]
    import numpy as np

    for p in (0, 25, 50, 90, 99, 99.9, 100):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))  # vLLM's numbers
    rs = []
    for k, ttft in enumerate(xs):
        r = RequestResult(10, 2, arrival_s=0.0, chunk_times=[ttft, ttft + 0.05 * (k + 1)], finish_reason="length")
        r.output_tokens, r.end_s = 2, ttft + 0.05 * (k + 1)
        rs.append(r)
    g = GoodputSLO.parse(["ttft:500", "tpot:120"])
    assert (g.ttft_s, g.tpot_s, g.e2el_s) == (0.5, 0.12, None)
    rep = summarize(rs, 10.0, 1.0, 1.0, g, (50.0, 75.0))
    assert rep.request_goodput == pytest.approx(2 / 10.0)  # ttft 0.1/tpot 0.05 and 0.2/0.10; 0.4 has tpot 0.15
    assert rep.ttft.std_ms == pytest.approx(1e3 * statistics.pstdev(xs))
    assert rep.ttft.percentiles_ms == pytest.approx({"p50": 400.0, "p75": 800.0})
    flat = vllm_result(rep, rs)
    assert flat["p75_ttft_ms"] == pytest.approx(800.0) and flat["std_ttft_ms"] == pytest.approx(rep.ttft.std_ms)
    assert "TTFT<=500ms, TPOT<=120ms" in rep.format() and "Std TTFT (ms)" in rep.format()
    with pytest.raises(ValueError, match="milliseconds"):
        GoodputSLO.parse(["tpot:-1"])


def test_burstiness_keeps_the_rate_and_changes_the_spread():
    def gaps(b: float) -> list[float]:
        reqs = synthetic(4000, 10, 2, request_rate=4.0, seed=3, burstiness=b)
        return [y.arrival_s - x.arrival_s for x, y in zip(reqs, reqs[1:])]

    for b in (0.25, 1.0, 4.0):
        g = gaps(b)
        cv = statistics.pstdev(g) / statistics.fmean(g)
        assert statistics.fmean(g) == pytest.approx(0.25, rel=0.1)  # mean rate unchanged
        assert cv == pytest.approx(b ** -0.5, rel=0.1)  # gamma(shape b): CV = 1/sqrt(b)
    random.seed(0)


def test_run_ends_once_every_running_request_missed_its_slo():
    """decided_slo: a server slower than the TBT SLO makes every request a certain miss long before its
    last token; the run ends then (not at the deadline) and each unfinished request is a miss. A fast
    server's run is not cut: every request completes."""
    import asyncio
    import time

    from conflux_cluster.bench.client import ClientConfig, run_workload
    from conflux_cluster.bench.workload import BenchRequest

    reqs = [BenchRequest(0.05 * i, 8, 80) for i in range(3)]
    with FakeOpenAI(token_delay_s=0.05) as srv:  # 80 tokens: 4 s each; the SLO wants 10 ms gaps (a miss by ~1.3 s)
        cfg = ClientConfig(srv.url, "fake-model", deadline_s=30.0, decided_slo=(1.0, 0.01))
        t0 = time.perf_counter()
        results, duration = asyncio.run(run_workload(cfg, reqs))
        assert time.perf_counter() - t0 < 3.0 and duration < 3.0  # decided: no request streams its 4 s
        assert all(not r.ok and r.cut and "missed its SLO" in r.error for r in results)
        assert all(r.late(duration, 1.0, 0.01) for r in results)
    with FakeOpenAI() as srv:
        cfg = ClientConfig(srv.url, "fake-model", deadline_s=30.0, decided_slo=(1.0, 0.01))
        results, _ = asyncio.run(run_workload(cfg, reqs))
        assert all(r.ok and not r.cut and r.output_tokens == 80 for r in results)
        assert not any(r.late(1e9, 1.0, 1.0) for r in results)  # finished by its deadlines: never late


def test_request_late_is_certain_miss():
    r = RequestResult(8, 3, arrival_s=0.0, chunk_times=[0.5, 0.6], chunk_tokens=[1, 1])
    assert not r.late(0.65, ttft_s=1.0, tbt_s=0.1)  # token 3 is due at 1.2
    assert r.late(1.25, ttft_s=1.0, tbt_s=0.1)  # token 3 overdue
    assert r.late(0.0, ttft_s=0.4, tbt_s=0.1)  # token 1 came after its deadline: a miss already
    done = RequestResult(8, 2, arrival_s=0.0, chunk_times=[0.5, 0.6], chunk_tokens=[1, 1])
    assert not done.late(100.0, ttft_s=1.0, tbt_s=0.1)  # every token asked for came in time


def test_served_model_deadline_and_stats_of_a_server_without_them():
    """A rate point's latest end: the given drain, else the longest output's last token deadline (plus a
    grace); a server without /v1/conflux/stats gives no instance stats (not an error)."""
    from conflux_cluster.bench.server import DEADLINE_GRACE_S, ClientSettings, ServedModel
    from conflux_cluster.bench.workload import BenchRequest

    reqs = [BenchRequest(0.0, 8, 10), BenchRequest(3.0, 8, 101), BenchRequest(4.0, 8, 5)]
    with FakeOpenAI() as srv:
        served = ServedModel(srv.url, ClientSettings("none", 1000, ttft_slo=2.0, tbt_slo=0.1))
        assert served.slo_deadline(reqs, 7.5) == 4.0 + 7.5
        assert served.slo_deadline(reqs, None) == pytest.approx(4.0 + 2.0 + 100 * 0.1 + DEADLINE_GRACE_S)
        assert served.instance_stats() == []


def test_out_of_range_flags_fail_before_any_request():
    from conflux_cluster.cli import build_parser
    from conflux_cluster.commands.bench import check_args

    parse = build_parser().parse_args
    check_args(parse(["bench"]))  # the defaults are valid
    for argv, flag in ((["--request-rate", "0"], "--request-rate"), (["--request-rate", "nan"], "--request-rate"),
                       (["--num-prompts", "0"], "--num-prompts"), (["--burstiness", "-1"], "--burstiness"),
                       (["--max-concurrency", "0"], "--max-concurrency"), (["--range-ratio", "1"], "--range-ratio")):
        with pytest.raises(ValueError, match=flag):
            check_args(parse(["bench", *argv]))


def test_save_result_and_infinite_flags_are_checked_before_any_request(tmp_path, capsys):
    """An unwritable --save-result fails before the server is asked anything (not after the whole run);
    inf is a rate of 'all at once' for --request-rate only."""
    from conflux_cluster.cli import build_parser
    from conflux_cluster.commands.bench import check_args

    parse = build_parser().parse_args
    check_args(parse(["bench", "--request-rate", "inf", "--save-result", str(tmp_path / "r.json")]))
    for argv, match in ((["--save-result", str(tmp_path / "missing" / "r.json")], "--save-result.*does not exist"),
                        (["--save-result", str(tmp_path)], "--save-result.*is a folder"),
                        (["--rate-scale", "inf"], "--rate-scale"), (["--length-scale", "nan"], "--length-scale"),
                        (["--tbt-slo", "inf"], "--tbt-slo"), (["--burstiness", "inf"], "--burstiness")):
        with pytest.raises(ValueError, match=match):
            check_args(parse(["bench", *argv]))
    with FakeOpenAI() as srv:
        rc = main(["bench", "--base-url", srv.url, "--disable-tqdm", "--num-prompts", "1",
                   "--save-result", str(tmp_path / "missing" / "r.json")])
        assert rc == 2 and not srv.requests
    err = capsys.readouterr().err
    assert err.startswith("conflux bench: error: --save-result") and "Traceback" not in err


def test_results_name_the_commit_and_say_when_the_tree_differs(tmp_path, monkeypatch):
    import subprocess

    from conflux_cluster.bench.server import git_commit

    monkeypatch.delenv("CONFLUX_GIT_COMMIT", raising=False)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")  # a copied tree whose .git lags behind it
    assert git_commit(tmp_path) == head + "+dirty"
    monkeypatch.setenv("CONFLUX_GIT_COMMIT", "1f88634")
    assert git_commit(tmp_path) == "1f88634"
    monkeypatch.delenv("CONFLUX_GIT_COMMIT")
    assert git_commit(tmp_path / "missing") is None


@pytest.mark.parametrize("answer", [b'{"object": "list", "data": []}', b"<html>a web page</html>", b'{"data": [7]}',
                                    b'["m"]'])
def test_a_server_without_an_openai_model_list_is_a_one_line_error(answer: bytes, capsys):
    """``conflux bench`` reads the model from ``/v1/models``: an empty list raised IndexError (a traceback), a web
    page gave "Expecting value: line 1 column 1 (char 0)"; a --base-url httpx cannot parse raised InvalidURL (a
    traceback). One line naming the URL now, exit status 2, before any request is sent."""
    import threading
    from http.server import ThreadingHTTPServer

    from tests.json_http import JSONHandler

    class Handler(JSONHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["bench", "--base-url", url, "--disable-tqdm", "--num-prompts", "1"]) == 2
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert err.startswith(f"conflux bench: error: {url}/v1/models did not answer an OpenAI model list"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert main(["bench", "--base-url", "http://[::1", "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("conflux bench: error: cannot reach http://[::1/v1/models") and "Traceback" not in err


def test_a_base_url_with_a_trailing_slash_reaches_the_routes(monkeypatch, capsys):
    """``--base-url http://host:8000/`` made ``http://host:8000//v1/models``, which ConfluxServe (Starlette) answers
    404, so the run ended "cannot reach ...//v1/models" (http.server, as FakeOpenAI, forgives the double slash;
    the URL the client asks for is recorded here)."""
    import httpx

    asked: list[str] = []
    real_get = httpx.get
    monkeypatch.setattr(httpx, "get", lambda url, **kw: asked.append(url) or real_get(url, **kw))
    with FakeOpenAI() as srv:
        assert main(["bench", "--base-url", srv.url + "//", "--disable-tqdm", "--num-prompts", "1"]) == 0
    assert asked[0] == f"{srv.url}/v1/models" and not any("//v1" in u for u in asked), asked
    assert f"benchmarking {srv.url}/v1/completions" in capsys.readouterr().out


def test_a_base_url_ending_in_v1_is_one_line_with_a_hint(capsys):
    """An OpenAI client's base URL ends in /v1; given as --base-url it made /v1/v1/models, and the 404 came out
    as two lines (httpx adds a "For more information check: ..." line). One line now, saying to leave out /v1."""
    with FakeOpenAI() as srv:
        assert main(["bench", "--base-url", srv.url + "/v1", "--disable-tqdm", "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"conflux bench: error: cannot reach {srv.url}/v1/v1/models: Client error '404")
    assert len(err.strip().splitlines()) == 1 and err.strip().endswith("leave out /v1)"), err
