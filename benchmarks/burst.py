"""Refusals under a burst: N concurrent chat requests at once; how fast the refused ones hear it, and
whether the served ones' TTFT pays for them.

Phase 1 sends ``--concurrency`` streamed chat completions together and prints the p50/p99 of the
refusals (503 + Retry-After, client side: send -> status line) and of the served requests' TTFT.
Phase 2 (unless ``--no-reference``) sends, once the server is idle again, a burst of exactly as many
requests as phase 1 served: nothing is refused there, so its TTFT is the served requests' TTFT
without the refused ones. The client is aiohttp (one connection per request): at 1,000
concurrent requests httpx's connection pool alone adds seconds of client-side time, which would be
measured as server latency. Prints numbers; asserts nothing.

    # start the embedded default (conflux serve: local Ray, SmolLM2, 2 CPU ranks) and drive it
    python -m benchmarks.burst --serve --concurrency 1000
    # against a running server
    python -m benchmarks.burst --base-url http://127.0.0.1:8000 --concurrency 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass

from conflux_cluster.bench.report import nearest_rank


@dataclass
class Outcome:
    """One request as the client saw it."""

    status: int
    answer_s: float  # send -> status line (a refusal's whole cost to the client)
    ttft_s: float | None = None  # send -> first content token (served streams)
    end_s: float | None = None  # send -> [DONE]
    retry_after: str | None = None
    code: str | None = None  # the error's code (refusals)


def pct(xs: list[float], q: float) -> float:
    return nearest_rank(sorted(xs), q) if xs else float("nan")


def _has_content(event: bytes) -> bool:
    """Whether a chat chunk carries generated text (the first chunk only announces the role)."""
    choices = json.loads(event).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


async def floor(base_url: str, n: int, headers: dict) -> list[float]:
    """Seconds for each of ``n`` concurrent ``GET /v1/models`` answered 200: the HTTP path alone (proxy,
    ingress), no generation work; what a refusal cannot beat on this machine."""
    import aiohttp

    async def get(s) -> float:
        t0 = time.perf_counter()
        async with s.get(f"{base_url}/v1/models", headers=headers) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"the floor's GET /v1/models got {r.status}")
        return time.perf_counter() - t0

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as s:
        return list(await asyncio.gather(*[get(s) for _ in range(n)]))


async def one(session, url: str, body: dict, headers: dict) -> Outcome:
    t0 = time.perf_counter()
    async with session.post(url, json=body, headers=headers) as r:
        answered = time.perf_counter() - t0
        if r.status != 200:
            data = await r.read()
            try:
                code = json.loads(data)["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = None
            return Outcome(r.status, answered, retry_after=r.headers.get("retry-after"), code=code)
        out = Outcome(200, answered)
        async for line in r.content:
            if out.ttft_s is None and line.startswith(b"data: {") and _has_content(line[6:]):
                out.ttft_s = time.perf_counter() - t0
        out.end_s = time.perf_counter() - t0
        return out


async def burst(base_url: str, model: str, n: int, max_tokens: int, api_key: str | None) -> list[Outcome]:
    """``n`` streamed chat completions sent together; their outcomes."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "Name three primary colors."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as s:
        return list(await asyncio.gather(*[one(s, f"{base_url}/v1/chat/completions", body, headers)
                                           for _ in range(n)]))


def summary(name: str, outs: list[Outcome], wall_s: float) -> dict:
    """Prints one block and returns its figures."""
    served = [o for o in outs if o.status == 200]
    refused = [o for o in outs if o.status == 503]
    ttft = [o.ttft_s for o in served if o.ttft_s is not None]
    fig = {"requests": len(outs), "served": len(served), "refused": len(refused),
           "other": dict(Counter(o.status for o in outs if o.status not in (200, 503))),
           "refusal_p50_s": pct([o.answer_s for o in refused], .5),
           "refusal_p99_s": pct([o.answer_s for o in refused], .99),
           "ttft_p50_s": pct(ttft, .5), "ttft_p99_s": pct(ttft, .99), "wall_s": wall_s,
           "retry_after": dict(Counter(o.retry_after for o in refused)),
           "codes": dict(Counter(o.code for o in refused)),
           # by the error's code: where the refusal came from (None: not the OpenAI error shape, e.g. Serve's own)
           "refusal_p50_p99_by_code": {str(c): [pct(xs, .5), pct(xs, .99)] for c in {o.code for o in refused}
                                       if (xs := [o.answer_s for o in refused if o.code == c])}}
    print(f"{name}: {fig['requests']} requests in {wall_s:.1f} s: served {fig['served']}, 503 {fig['refused']}, "
          f"other {fig['other'] or 0}")
    if refused:
        print(f"  refusals: p50 {fig['refusal_p50_s']:.2f} s  p99 {fig['refusal_p99_s']:.2f} s  "
              f"Retry-After {fig['retry_after']}  codes {fig['codes']}")
        for code, (q50, q99) in fig["refusal_p50_p99_by_code"].items():
            print(f"    {code}: p50 {q50:.2f} s  p99 {q99:.2f} s")
    if served:
        print(f"  served TTFT: p50 {fig['ttft_p50_s']:.2f} s  p99 {fig['ttft_p99_s']:.2f} s")
    return fig


def start_embedded() -> str:
    """The embedded default (``conflux serve`` with no flags) on a free port; its base URL."""
    from conflux_cluster.config import ServeConfig
    from conflux_cluster.serve.app import run

    return f"http://127.0.0.1:{run(ServeConfig(port=0)).port}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server")
    p.add_argument("--serve", action="store_true", help="start the embedded default in this process first")
    p.add_argument("--concurrency", type=int, default=1000, help="requests sent at once")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip phase 2 (the served count again, alone)")
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    a = p.parse_args()
    if a.serve == (a.base_url is not None):
        p.error("give exactly one of --base-url and --serve")
    import httpx

    base = start_embedded() if a.serve else a.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    model = a.model or httpx.get(f"{base}/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]
    secs = asyncio.run(floor(base, a.concurrency, headers))
    figures: dict = {"floor": {"p50_s": pct(secs, .5), "p99_s": pct(secs, .99)}}
    print(f"floor: {a.concurrency} concurrent GET /v1/models (no generation): p50 {pct(secs, .5):.2f} s  "
          f"p99 {pct(secs, .99):.2f} s")
    time.sleep(1.0)
    t0 = time.perf_counter()
    outs = asyncio.run(burst(base, model, a.concurrency, a.max_tokens, a.api_key))
    figures["burst"] = summary("burst", outs, time.perf_counter() - t0)
    if a.reference and figures["burst"]["served"]:
        time.sleep(2.0)  # every stream of phase 1 has ended; the instances' load reports catch up
        t0 = time.perf_counter()
        ref = asyncio.run(burst(base, model, figures["burst"]["served"], a.max_tokens, a.api_key))
        figures["reference"] = summary("reference (served count alone)", ref, time.perf_counter() - t0)
        b, r = figures["burst"], figures["reference"]
        print(f"served TTFT with the refused ones / without: p50 x{b['ttft_p50_s'] / r['ttft_p50_s']:.2f}  "
              f"p99 x{b['ttft_p99_s'] / r['ttft_p99_s']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
