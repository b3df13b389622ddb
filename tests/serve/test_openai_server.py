"""The real thing on CPU: Ray + Serve + 2 XP instances x 2 rank actors + HTTP + the official ``openai`` client.

One deployment is shared by every test of this module (Ray on 2 shared cores is slow): SmolLM2,
2 instances of 2 CPU ranks, 2 ingress replicas, an API key, a 512-token context. References
come from the offline ``LLM`` (one in-process rank), which the server must reproduce token for token.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import ray
from ray import serve

from conflux_cluster.config import ServeConfig
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.serve.app import run

pytestmark = pytest.mark.slow  # Ray + Serve deployments: minutes on 2 shared cores

KEY = "sk-test-conflux"
MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def server(tmp_path_factory, shared_ray):
    cfg = run(ServeConfig(port=0, instances=2, ranks=2, ingress_replicas=2, api_key=KEY,
                          max_model_len=512, num_kv_blocks=96,
                          step_log=str(tmp_path_factory.mktemp("steps") / "steps.jsonl")))
    yield cfg
    serve.shutdown()


@pytest.fixture(scope="module")
def base(server):
    return f"http://127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def offline():
    from conflux_cluster.llm import LLM

    return LLM(model=MODEL, num_threads=1, load_progress=False, num_kv_blocks=96)


def _offline_chat(offline, **kw) -> list[str]:
    return [o.text for o in offline.chat(CHAT, SamplingParams(**kw))[0].outputs]


def _healthy_within(base: str, seconds: float) -> int:
    """/health's status once it is 200, or the last one after ``seconds``. Right after deploying, /health may
    answer 503 (Retry-After) while the instances' first answers take longer than its 0.5 s on a loaded machine;
    a load balancer probes again, and so does this."""
    end = time.monotonic() + seconds
    while True:
        status = httpx.get(f"{base}/health").status_code
        if status == 200 or time.monotonic() > end:
            return status
        time.sleep(0.5)


def _models_within(client: openai.OpenAI, seconds: float) -> list[str]:
    """The served model ids, asked again while an ingress replica still answers 503 "starting" (the replica that
    answered /health may be ready before the other one is; a client retries a 503 as its Retry-After says)."""
    end = time.monotonic() + seconds
    while True:
        try:
            return [m.id for m in client.models.list().data]
        except openai.InternalServerError as e:
            if e.status_code != 503 or time.monotonic() > end:
                raise
            time.sleep(0.5)


def test_health_models_and_auth(base, client):
    assert _healthy_within(base, 60) == 200
    assert _models_within(client, 60) == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{base}/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
    # the replica that answered "ready" opened its delta feed to every instance before any request
    deadline = time.time() + 30
    while not all(feeds := [serve.get_deployment_handle(f"xp-{i}", app_name="conflux").get_stats.remote().result()
                            .open_feeds for i in range(2)]):
        assert time.time() < deadline, feeds
        time.sleep(0.2)


def test_chat_greedy_equals_offline_streamed_and_not(client, offline):
    ref = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=24))[0]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24)
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.outputs[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    # vLLM's return_token_ids on a whole response too; logprob entries carry the token's UTF-8 bytes
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24, logprobs=True,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == list(ref.outputs[0].token_ids)
    entries = r.choices[0].logprobs.content
    assert len(entries) == len(ref.outputs[0].token_ids) and all(e.bytes == list(e.token.encode()) for e in entries)


def test_completions_greedy_equals_offline_streamed_and_not(client, offline, base):
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, logprobs=0))[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12, logprobs=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=2e-3)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12, stream=True) if c.choices)
    assert streamed == ref.text
    raw = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                     json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True})
    events = [line for line in raw.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)



def test_top_logprobs_streamed_equal_whole_and_offline(client, offline):
    """top_logprobs through the deployment (ingress replica -> XP instance -> 2 rank actors, whose sampling
    rank sends them back with the token): the streamed deltas carry the whole response's entries, and
    both are the offline engine's alternatives (one in-process rank; a 2-rank split sums differently)."""
    kw = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    whole = [e.model_dump() for e in client.chat.completions.create(**kw).choices[0].logprobs.content]
    streamed = [e.model_dump() for c in client.chat.completions.create(stream=True, **kw)
                for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert len(whole) == len(streamed) == 8

    def tops(entries):
        return [[t["token"] for t in e["top_logprobs"]] for e in entries]

    def values(entries):  # flat: approx compares no nested lists
        return [t["logprob"] for e in entries for t in e["top_logprobs"]]

    assert tops(streamed) == tops(whole) and values(streamed) == pytest.approx(values(whole), abs=1e-4)
    ref = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0].outputs[0]
    assert tops(whole) == [[offline.tokenizer.decode([i]) for i, _ in alts] for alts in ref.top_logprobs]
    assert values(whole) == pytest.approx([lp for alts in ref.top_logprobs for _, lp in alts], abs=2e-3)
    assert [e["token"] for e in whole] == [offline.tokenizer.decode([t]) for t in ref.token_ids]

def test_stop_strings(client, offline):
    full = _offline_chat(offline, temperature=0, max_tokens=24)[0]
    word = full.split()[3]  # a word in the middle of the greedy answer
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24, stop=[" " + word])
    assert r.choices[0].message.content == full.split(" " + word)[0]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=24, stop=" " + word, stream=True) if c.choices)
    assert streamed == r.choices[0].message.content


def test_seed_reproducible_and_equal_to_offline(client, offline):
    kw = dict(model=MODEL, messages=CHAT, temperature=1.0, top_p=0.95, max_tokens=16, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b == _offline_chat(offline, temperature=1.0, top_p=0.95, max_tokens=16, seed=1234)[0]


def test_n2_choices_and_usage(client, offline):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=1.0, max_tokens=10, seed=7, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == _offline_chat(offline, temperature=1.0, max_tokens=10,
                                                                  seed=7, n=2)
    assert r.usage.completion_tokens <= 20 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("body,status,param", [
    ({"model": MODEL, "messages": CHAT, "temperature": 7}, 400, "temperature"),
    ({"model": MODEL, "messages": CHAT, "best_of": 3}, 400, "best_of"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": CHAT, "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
    ({"model": "gpt-4o", "messages": CHAT}, 404, "model"),
])
def test_bad_inputs_get_openai_errors(base, body, status, param):
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    if "max_tokens" in body or "word" in json.dumps(body):
        assert err["code"] == "context_length_exceeded"


def test_malformed_json_and_official_client_errors(base, client):
    r = httpx.post(f"{base}/v1/completions", content=b'{"model": ', headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", top_p=0)
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x")


def _kv_held() -> list[list[int]]:
    return [serve.get_deployment_handle(f"xp-{i}", app_name="conflux").kv_blocks_held.remote().result()
            for i in range(2)]


def _aborted() -> int:
    return sum(serve.get_deployment_handle(f"xp-{i}", app_name="conflux").get_stats.remote().result().aborted
               for i in range(2))


def test_disconnected_stream_frees_kv_on_every_rank(base):
    """A client that leaves mid-stream: the request is aborted and its KV freed on every rank. On a
    loaded machine the request can finish its 400 tokens before the disconnect reaches the instance
    (its KV is freed then too); the abort is then tried again, up to three times."""
    assert _kv_held() == [[0, 0], [0, 0]]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    for _ in range(3):
        before = _aborted()
        with httpx.Client(timeout=300) as c:
            with c.stream("POST", f"{base}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]  # a few tokens: the request is decoding now
                held = [serve.get_deployment_handle(f"xp-{i}", app_name="conflux").kv_blocks_held
                        .remote(drain=False).result() for i in range(2)]
                assert sum(map(sum, held)) > 0 and got[0].startswith("data: ")  # the open stream holds KV
        deadline = time.time() + 60
        while (held := _kv_held()) != [[0, 0], [0, 0]] and time.time() < deadline:
            time.sleep(0.2)
        assert held == [[0, 0], [0, 0]]
        if _aborted() > before:
            break
    assert _aborted() > before


def test_every_disconnected_stream_is_aborted(base):
    """Streams left after 1-3 events, one after another: each is aborted on its instance (an abort
    sent while Serve cancels the disconnected request used to be cancelled with it: 1-4 of 20 kept
    generating to max_tokens, holding KV), and the KV is back to zero."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    before, n = _aborted(), 16
    with httpx.Client(timeout=300, headers={"Authorization": f"Bearer {KEY}"}) as c:
        for i in range(n):
            with c.stream("POST", f"{base}/v1/completions", json=body) as r:
                lines = (x for x in r.iter_lines() if x.startswith("data: "))
                for _ in range(1 + i % 3):
                    next(lines)
    deadline = time.time() + 60
    while (_aborted() - before < n or _kv_held() != [[0, 0], [0, 0]]) and time.time() < deadline:
        time.sleep(0.2)
    assert _aborted() - before == n and _kv_held() == [[0, 0], [0, 0]]


def test_burst_is_spread_by_lowest_load(client):
    h = serve.get_deployment_handle("router", app_name="conflux")
    before = h.snapshot.remote().result().counts
    n, errors = 8, []

    def one():
        try:
            client.completions.create(model=MODEL, prompt=PROMPT * 8, temperature=0, max_tokens=2)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = h.snapshot.remote().result()
    got = [a - b for a, b in zip(snap.counts, before)]
    assert not errors and sum(got) == n
    # equal requests onto equal instances: lowest normalized queued workload (with in-flight
    # accounting) alternates, so neither instance gets more than half plus one
    assert max(got) - min(got) <= 2, (got, snap.recent[-n:])
    # the decision time is recorded for every routed request; its cost is a benchmark figure
    # (python -m conflux_cluster.sim.cluster), not a timed assertion on a shared CI core
    assert 0 < snap.mean_decision_us <= snap.max_decision_us


def test_handle_from_ray_task_same_text(server, offline):
    ref = _offline_chat(offline, temperature=0, max_tokens=24)[0]

    @ray.remote(num_cpus=0)
    def call(body):
        from ray import serve as s

        h = s.get_app_handle("conflux")
        whole = h.chat.remote(body).result()["choices"][0]["message"]["content"]
        streamed = "".join(h.options(stream=True).chat_stream.remote(body))
        return whole, streamed

    whole, streamed = ray.get(call.remote({"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 24}))
    assert whole == streamed == ref


def test_completions_batch_of_prompts_equals_offline(client, offline):
    """A batch of prompts, n each: choice j * n + i is prompt j's; every prompt's tokens are counted once."""
    prompts = [PROMPT, "Once upon a time"]
    refs = [offline.generate(p, SamplingParams(temperature=0, max_tokens=6))[0] for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=6, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [refs[0].outputs[0].text] * 2 + [refs[1].outputs[0].text] * 2
    assert r.usage.prompt_tokens == sum(len(x.prompt_token_ids) for x in refs)
    assert r.usage.completion_tokens == 4 * 6
    ids = [list(x.prompt_token_ids) for x in refs]  # the same batch as token-id lists, streamed
    texts = ["", ""]
    for c in client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=6, stream=True):
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [x.outputs[0].text for x in refs]


def test_control_plane_share_is_reported(base, server):
    from pathlib import Path

    from conflux_cluster.engine.scheduler.fitting.step_log import instance_path, read_step_log

    openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"priority": 5})
    stats = httpx.get(f"{base}/v1/conflux/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert sum(inst["requests_by_priority"].get("5", 0) for inst in stats["instances"]) == 1  # priority is visible
    for i, inst in enumerate(stats["instances"]):
        assert inst["kind"] in ("compiled_graph", "actor_calls") and inst["calls"] > 0
        assert 0 <= inst["share_of_iteration"] < 1
        # the served steps: tallied (step times) and, with --step-log, logged per instance after its warm-up
        # freeze_gc (default): the replica and each rank froze their start-up heaps after warm-up
        frozen = inst["gc_frozen_objects"]
        assert frozen["replica"] > 50_000 and len(frozen["ranks"]) == 2 and min(frozen["ranks"]) > 50_000, frozen
        steps, path = sum(inst["step_ms_counts"]), Path(instance_path(server.step_log, i))
        logged = read_step_log(str(path)) if path.exists() else []
        assert steps == 0 or (logged and all(s.seconds > 0 for s in logged))
        if path.exists():  # each served step also carries its slowest rank's own time inside it
            lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            assert all(0 < d["compute_s"] < 60 for d in lines), lines[:3]
        print(f"control plane {inst['kind']}: {100 * inst['share_of_iteration']:.2f}% of iteration time "
              f"over {inst['calls']} iterations")
    assert sum(stats["router"]["counts"]) > 10


def test_offline_llm_with_ray_rank_actors_equals_in_process(server, offline):
    from conflux_cluster.actors.ray_llm import RayLLM

    llm = RayLLM(ranks=2, num_threads=1, load_progress=False, num_kv_blocks=96)
    try:
        got = [o.outputs[0].text for o in llm.generate([PROMPT, "Once upon a time"],
                                                        SamplingParams(temperature=0, max_tokens=10))]
    finally:
        llm.shutdown()
    ref = [o.outputs[0].text for o in offline.generate([PROMPT, "Once upon a time"],
                                                       SamplingParams(temperature=0, max_tokens=10))]
    assert got == ref
