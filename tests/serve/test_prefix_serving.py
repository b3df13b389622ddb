"""The prefix cache served for real: ``conflux serve`` on Ray (2 instances of one CPU rank, tiny-llama
with random weights, ``--enable-prefix-caching --router-policy prefix_aware``) and the official
``openai`` client. A repeated prompt is routed to the instance that served it, reports its cached
tokens as OpenAI does, and the instances' own counters (``/v1/conflux/stats``, vLLM's
prefix_cache_queries / prefix_cache_hits) agree with what the clients were told."""

from __future__ import annotations

import httpx
import openai
import pytest

KEY = "sk-prefix"


@pytest.fixture(scope="module")
def base(shared_ray):
    from ray import serve

    from conflux_cluster.config import ServeConfig
    from conflux_cluster.serve.app import run

    try:
        cfg = run(ServeConfig(model="tiny-llama", port=0, instances=2, ranks=1, api_key=KEY,
                              num_kv_blocks=128, router_policy="prefix_aware",
                              scheduler={"enable_prefix_caching": True}))
        yield f"http://127.0.0.1:{cfg.port}"
    finally:
        serve.shutdown()


def _stats(base: str) -> list[dict]:
    return httpx.get(f"{base}/v1/conflux/stats", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=60).json()["instances"]


@pytest.mark.slow
def test_repeated_prefix_is_routed_cached_and_counted(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY)
    before = _stats(base)  # (the instances' warm-up prefills were counted too)
    shared = [10 + i % 300 for i in range(512)]  # one router block of 512 tokens, 32 engine blocks of 16
    cached = []
    for i in range(3):
        r = client.completions.create(model="tiny-llama", prompt=shared + [7 + i] * 20, max_tokens=2,
                                      temperature=0)
        assert r.usage.prompt_tokens == 532
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached == [0, 512, 512]  # the whole shared part, on the instance that computed it
    after = _stats(base)
    queries = [a["prefix_cache_queries"] - b["prefix_cache_queries"] for a, b in zip(after, before)]
    hits = [a["prefix_cache_hits"] - b["prefix_cache_hits"] for a, b in zip(after, before)]
    assert sorted(queries) == [0, 3 * 532] and sorted(hits) == [0, 1024]  # one instance served all three
