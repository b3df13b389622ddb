"""Send a workload to an OpenAI-compatible server and time every streamed token.

Each request is ``POST /v1/completions`` with a token-id prompt of the exact length, ``max_tokens``
= its output length, ``ignore_eos`` (so outputs have exactly that length), ``stream`` and
``stream_options.include_usage``. A token's time is when its SSE chunk arrived (as in
``vllm bench serve``); the final usage chunk gives the exact output token count.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from .workload import BenchRequest, prompt_ids


@dataclass
class RequestResult:
    """What one request measured (times in seconds, relative to the benchmark start)."""

    input_len: int
    output_len: int  # requested
    arrival_s: float = 0.0  # when it was sent
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    output_tokens: int = 0  # from usage (falls back to content chunks)
    end_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.arrival_s

    @property
    def e2e(self) -> float:
        return self.end_s - self.arrival_s

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000
    model: str
    api_key: str | None = None
    vocab_size: int = 30000  # synthetic prompt ids are drawn below this
    seed: int = 0
    timeout_s: float = 3600.0
    max_concurrency: int | None = None  # cap on requests in flight (None: open loop)


async def _one(client: httpx.AsyncClient, cfg: ClientConfig, req: BenchRequest, ids: list[int],
               t0: float) -> RequestResult:
    res = RequestResult(req.input_len, req.output_len)
    body = {"model": cfg.model, "prompt": ids, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    res.arrival_s = time.perf_counter() - t0
    try:
        async with client.stream("POST", f"{cfg.base_url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter() - t0
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    break
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    res.chunk_times.append(now)
                if chunk.get("usage"):
                    res.output_tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    res.end_s = time.perf_counter() - t0
    res.output_tokens = res.output_tokens or len(res.chunk_times)
    return res


async def run_workload(cfg: ClientConfig, requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time; returns the results and the benchmark duration."""
    rng = random.Random(cfg.seed)
    prompts = [prompt_ids(r.input_len, cfg.vocab_size, rng) for r in requests]
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def fire(req: BenchRequest, ids: list[int]) -> RequestResult:
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                return await _one(client, cfg, req, ids, t0)
            async with limit:
                return await _one(client, cfg, req, ids, t0)

        results = await asyncio.gather(*[fire(r, p) for r, p in zip(requests, prompts)])
        duration = time.perf_counter() - t0
    return list(results), duration
