"""Overload: N concurrent requests at once against a ConfluxServe (or any OpenAI-compatible) server.

Sends all N completions together (streamed by default), waits for every answer and prints how many
were accepted and how many were refused (503 + Retry-After: every instance's queue was full), the
p50/p99 latency of accepted requests (first token and end) and of the refusals, and any other
status. With ``--probe-every``, once the burst's quick answers are in (none for 0.5 s) and while
its accepted requests still run, one more request is sent at that interval: single arrivals at a
busy (often full) server, reported apart from the burst, whose answers queue up behind each other
in the HTTP proxy and ingress. Prints numbers; asserts nothing.

    # against a running server
    .venv/bin/python -m benchmarks.overload --base-url http://127.0.0.1:8000 --concurrency 200
    # start the embedded default in-process (local Ray, SmolLM2, 2 CPU ranks) and drive it
    .venv/bin/python -m benchmarks.overload --serve --concurrency 200 [--max-queued 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

from conflux_cluster.bench.report import nearest_rank


@dataclass
class Answer:
    """One request's outcome as the client saw it."""

    status: int
    seconds: float  # send -> last byte (accepted) or -> the refusal
    ttft_s: float | None = None  # send -> first token event (accepted streams)
    output_tokens: int = 0
    retry_after: str | None = None
    in_band_errors: list = field(default_factory=list)


def pct(xs: list[float], q: float) -> float:
    """q-quantile by nearest rank (q in [0, 1]); nan for no data."""
    return nearest_rank(sorted(xs), q) if xs else float("nan")


async def one(client, url: str, body: dict, headers: dict) -> Answer:
    t0 = time.perf_counter()
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return Answer(r.status_code, time.perf_counter() - t0, retry_after=r.headers.get("retry-after"))
        ans, buf = Answer(200, 0.0), ""
        async for chunk in r.aiter_text():
            buf += chunk
            while "\n\n" in buf:
                event, buf = buf.split("\n\n", 1)
                if not event.startswith("data: {"):
                    continue
                data = json.loads(event[6:])
                if "error" in data:
                    ans.in_band_errors.append(data["error"])
                elif data.get("choices"):
                    ans.ttft_s = ans.ttft_s or time.perf_counter() - t0
                    ans.output_tokens += len(data["choices"][0].get("token_ids") or [])
        if not body["stream"]:
            data = json.loads(buf)
            ans.output_tokens = data["usage"]["completion_tokens"]
        ans.seconds = time.perf_counter() - t0
        return ans


async def drive(base_url: str, model: str, n: int, prompt: str, max_tokens: int, stream: bool,
                api_key: str | None, probe_every: float | None) -> tuple[list[Answer], list[Answer], float]:
    """The burst's answers, the probes' answers, the burst's wall time."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": stream, "return_token_ids": True}
    url = f"{base_url}/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=60), limits=limits) as client:
        t0 = time.perf_counter()
        last_answer = [t0]
        tasks = [asyncio.create_task(one(client, url, body, headers)) for _ in range(n)]
        for t in tasks:
            t.add_done_callback(lambda _: last_answer.__setitem__(0, time.perf_counter()))
        probes = []
        if probe_every:
            while not all(t.done() for t in tasks) and (
                    not any(t.done() for t in tasks) or time.perf_counter() - last_answer[0] < 0.5):
                await asyncio.sleep(0.05)
            while not all(t.done() for t in tasks):
                probes.append(asyncio.create_task(one(client, url, body, headers)))
                await asyncio.sleep(probe_every)
        answers = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        return list(answers), list(await asyncio.gather(*probes)), wall


def report(name: str, answers: list[Answer], wall_s: float | None, max_tokens: int) -> None:
    ok = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status == 503]
    statuses = Counter(a.status for a in answers)
    short = [a for a in ok if a.output_tokens != max_tokens or a.in_band_errors]
    took = f" in {wall_s:.1f} s" if wall_s is not None else ""
    print(f"{name}: {len(answers)} requests{took}: accepted {len(ok)}, 503 {len(refused)}, "
          f"other {dict((s, c) for s, c in statuses.items() if s not in (200, 503)) or 0}")
    if ok:
        ends, ttfts = [a.seconds for a in ok], [a.ttft_s for a in ok if a.ttft_s is not None]
        print(f"accepted: latency p50 {pct(ends, .5):.2f} s  p99 {pct(ends, .99):.2f} s  max {max(ends):.2f} s; "
              f"TTFT p50 {pct(ttfts, .5):.2f} s  p99 {pct(ttfts, .99):.2f} s; "
              f"{len(short)} without all {max_tokens} tokens or with an in-band error")
        errors = Counter(str(e.get("message"))[:160] for a in ok for e in a.in_band_errors)
        for message, count in errors.most_common(3):
            print(f"  in-band error x{count}: {message}")
    if refused:
        secs = [a.seconds for a in refused]
        print(f"503: answered in p50 {1000 * pct(secs, .5):.0f} ms  p99 {1000 * pct(secs, .99):.0f} ms  "
              f"max {1000 * max(secs):.0f} ms; "
              f"Retry-After {dict(Counter(a.retry_after for a in refused))}")


def start_embedded(max_queued: int | None) -> str:
    """The embedded default (``conflux serve`` with no flags) on a free port; returns its base URL."""
    from conflux_cluster.config import ServeConfig
    from conflux_cluster.serve.app import run

    cfg = run(ServeConfig(port=0, max_queued_requests_per_instance=max_queued))
    return f"http://127.0.0.1:{cfg.port}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (default with --serve: the one started)")
    p.add_argument("--serve", action="store_true", help="start the embedded default in this process first")
    p.add_argument("--max-queued", type=int, default=None,
                   help="with --serve: max_queued_requests_per_instance (default: the server's rule)")
    p.add_argument("--concurrency", type=int, default=200, help="requests sent at once")
    p.add_argument("--prompt", default="The three primary colors are")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--probe-every", type=float, default=None, metavar="S",
                   help="after the burst's quick answers, send one request every S seconds while it runs")
    p.add_argument("--no-stream", dest="stream", action="store_false")
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--api-key", default=None)
    a = p.parse_args()
    if a.serve == (a.base_url is not None):
        p.error("give exactly one of --base-url and --serve")
    import httpx

    base = start_embedded(a.max_queued) if a.serve else a.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    model = a.model or httpx.get(f"{base}/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]
    answers, probes, wall = asyncio.run(drive(base, model, a.concurrency, a.prompt, a.max_tokens, a.stream,
                                              a.api_key, a.probe_every))
    report("burst", answers, wall, a.max_tokens)
    if probes:
        report("probes", probes, None, a.max_tokens)
    stats = httpx.get(f"{base}/v1/conflux/stats", headers=headers, timeout=60)
    if stats.status_code == 200:
        r = stats.json()["router"]
        print(f"router: refused {r.get('refused')}, bound {r.get('max_queued_requests')} per instance, "
              f"routed {r.get('counts')}")


if __name__ == "__main__":
    main()
