"""Refusals other than a full queue (tests/serve/test_admission.py): the per-API-key rate limit (429 +
Retry-After), the router's refusals in order (rate limit, no healthy instance, every instance full), and
the SLO scheduler's early rejection (503 slo_unattainable, paper Alg. 4). Pure Python first, then real
servers (Ray + Serve + HTTP, the ``openai`` client)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from conflux_cluster.engine.contracts.cluster import InstanceLoad
from conflux_cluster.router.rate_limit import KeyRateLimiter, RateLimit
from conflux_cluster.router.state import RouterState
from conflux_cluster.engine.contracts.cluster import LoadReport, Overloaded, RateLimited, Routed, Unavailable


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_token_bucket_per_key_burst_refill_and_give_back():
    clock = _Clock()
    lim = KeyRateLimiter(RateLimit(requests_per_minute=30, burst=2), clock)  # one token per 2 s
    assert [lim.take("a"), lim.take("a"), lim.take("a")] == [0, 0, 2]
    assert lim.take("b") == 0  # another key has its own bucket
    clock.t = 1.0
    assert lim.take("a") == 1  # half a token back: one more second
    clock.t = 2.0
    assert lim.take("a") == 0 and lim.take("a") == 2
    lim.give_back("a")
    assert lim.take("a") == 0
    clock.t = 100.0
    assert [lim.take("a") for _ in range(3)] == [0, 0, 2]  # never more than the burst
    with pytest.raises(ValueError):
        RateLimit(requests_per_minute=0, burst=1)


def _load(healthy: bool = True, waiting: int = 0) -> InstanceLoad:
    return InstanceLoad(num_waiting=waiting, prefill_capacity=1000.0, healthy=healthy)


def test_router_refuses_rate_limit_first_then_unavailable_then_overloaded():
    clock = _Clock()
    st = RouterState(2, max_queued_requests=1, clock=clock, rate_limit=RateLimit(60, 3))
    assert isinstance(st.admit(10, client="k1"), Routed) and isinstance(st.admit(10, client="k1"), Routed)
    full = st.admit(10, client="k1")  # both instances hold one queued request: full, token given back
    assert isinstance(full, Overloaded)
    for i in range(2):  # each lost a rank; one expects to be back in 7 s, the other in 12 s
        st.report(LoadReport(i, _load(healthy=False), 10, received_requests=1, incarnation="a",
                             available_in_s=7 + 5 * i))
    assert st.admit(10, client="k1") == Unavailable(retry_after_s=7)  # its token is given back too
    st.report(LoadReport(1, _load(), 10, received_requests=1, incarnation="a"))  # rebuilt, queue empty
    assert st.admit(10, client="k1") == Routed(1)  # k1's third and last token
    limited = st.admit(10, client="k1")
    assert isinstance(limited, RateLimited) and limited.retry_after_s == 1 and limited.requests_per_minute == 60
    assert isinstance(st.admit(10, client="k2"), Overloaded)  # k2 has its own tokens; xp-1 is full again
    assert (st.stats.refused, st.stats.unavailable, st.stats.rate_limited) == (2, 1, 1)


# ---- a real server ------------------------------------------------------------------------------


@pytest.mark.slow
def test_http_429_per_api_key_with_retry_after(tmp_path, shared_ray):
    from ray import serve

    from conflux_cluster.config import ServeConfig
    from conflux_cluster.serve.app import run

    try:
        keys_file = tmp_path / "keys.txt"
        keys_file.write_text("sk-bob\n")
        cfg = run(ServeConfig(model="tiny-llama", port=0, instances=1, ranks=2, num_kv_blocks=64,
                              api_key="sk-alice", api_keys_file=keys_file, rate_limit_requests_per_minute=30,
                              rate_limit_burst=2))
        base = f"http://127.0.0.1:{cfg.port}"
        alice, bob = (openai.OpenAI(base_url=f"{base}/v1", api_key=k, max_retries=0, timeout=120)
                      for k in ("sk-alice", "sk-bob"))

        def complete(client: openai.OpenAI) -> str:
            return client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2).choices[0].finish_reason

        assert complete(alice) and complete(alice)
        t0 = time.perf_counter()
        with pytest.raises(openai.RateLimitError) as err:
            complete(alice)
        refused_s = time.perf_counter() - t0
        e = err.value
        # one token every 2 s: 2 s to wait if the first two requests took no time, less by however long they took
        assert e.status_code == 429 and 1 <= int(e.response.headers["retry-after"]) <= 2
        assert e.body["code"] == "rate_limit_exceeded" and set(e.body) == {"message", "type", "param", "code"}
        assert complete(bob) and complete(bob)  # another key: its own budget
        r = httpx.post(f"{base}/v1/completions", headers={"Authorization": "Bearer sk-wrong"}, timeout=60,
                       json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401  # a bad key is refused before any rate limit
        time.sleep(2.1)
        assert complete(alice)  # a token is back
        snap = serve.get_deployment_handle("router", app_name="conflux").snapshot.remote().result()
        assert snap.rate_limited == 1
        print(f"\n429 for the third request of a key in {1000 * refused_s:.0f} ms")
    finally:
        serve.shutdown()


@pytest.mark.slow
def test_http_slo_rejection_at_arrival(shared_ray):
    """scheduler.reject_unattainable with TTFT SLO 3.9 s and TBT SLO 2 s: one step (B_0 = 2 ranks x 256 tokens)
    fits before the deadline, so a 1,000-token prompt (two steps) is refused at once and a short one is
    served. The scheduler counts the steps from when the request reaches it, so the ingress-to-engine hop
    may take up to 1.9 s (a loaded CI machine took over 0.5 s) before the short one misses its one step."""
    from ray import serve

    from conflux_cluster.config import ServeConfig
    from conflux_cluster.serve.app import run

    try:
        cfg = run(ServeConfig(model="tiny-llama", port=0, instances=1, ranks=2, num_kv_blocks=256,
                              scheduler={"policy": "slo", "estimator_profile": "budget", "ttft_slo": 3.9,
                                         "tbt_slo": 2.0, "reject_unattainable": True}))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.port}/v1", api_key="none", max_retries=0,
                               timeout=120)
        ok = client.completions.create(model="tiny-llama", prompt=[65] * 10, max_tokens=2)
        assert ok.choices[0].finish_reason in ("length", "stop")
        t0 = time.perf_counter()
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="tiny-llama", prompt=[65] * 1000, max_tokens=2)
        refused_s = time.perf_counter() - t0
        e = err.value
        assert e.status_code == 503 and e.body["code"] == "slo_unattainable", e.body
        assert int(e.response.headers["retry-after"]) >= 1 and "3.9 s" in e.body["message"]
        chunks = []
        with pytest.raises(openai.APIStatusError) as err:  # a stream too: refused before its status line
            for chunk in client.completions.create(model="tiny-llama", prompt=[65] * 1000, max_tokens=2,
                                                   stream=True):
                chunks.append(chunk)
        e = err.value
        assert not chunks and e.status_code == 503 and e.body["code"] == "slo_unattainable", e.body
        assert int(e.response.headers["retry-after"]) >= 1
        held = serve.get_deployment_handle("xp-0", app_name="conflux").kv_blocks_held.remote().result()
        assert held == [0, 0]
        print(f"\nSLO rejection answered in {1000 * refused_s:.0f} ms")
    finally:
        serve.shutdown()
