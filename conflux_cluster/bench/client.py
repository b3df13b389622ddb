"""Send a workload to an OpenAI-compatible server and time every streamed *token*.

Each request is ``POST /v1/completions`` (a token-id prompt of the exact length, or a text prompt)
or ``POST /v1/chat/completions`` (the text as one user message), with ``max_tokens`` = its output
length, ``ignore_eos`` when asked (outputs then have exactly that length), ``stream``,
``stream_options.include_usage`` and ``return_token_ids`` (vLLM's extension: every chunk carries the
ids of the tokens it delivers). The usage's ``prompt_tokens`` is the request's input length (the
server's count: a text prompt's length is what the server's tokenizer made of it). Tokens are counted, not text: on a random-weight model most tokens
decode to nothing (or to half a UTF-8 character the detokenizer holds back), so a chunk may carry
tokens and no text, or text for several tokens at once::

    chunk:     c1 (t=0.50, 1 token)   c2 (t=0.60, 3 tokens)   c3 (t=0.70, 1 token, finish)
    tokens:    0.50                   0.60 0.60 0.60          0.70
    TTFT  = 0.50 − arrival                (first chunk with >= 1 token)
    ITLs  = 0.10, 0, 0, 0.10              (a k-token chunk: its gap and k−1 zeros, as vLLM counts)

A server that sends no ``token_ids`` is still measured: a chunk with text counts as one token,
and the final ``usage`` total fixes the count (missing tokens take the last token chunk's time).
A request is *completed* when a ``finish_reason`` arrived and no error did.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from ..slo import next_token_overdue, token_deadlines_met
from .endpoints import CHAT, COMPLETIONS, ENDPOINTS
from .workload import BenchRequest, request_prompts


@dataclass
class RequestResult:
    """What one request measured (times in seconds, relative to the benchmark start)."""

    input_len: int  # prompt tokens (the server's usage count once it reported one)
    output_len: int  # requested
    arrival_s: float = 0.0  # when it was sent
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each such chunk (empty: 1 each)
    output_tokens: int = 0  # usage's completion_tokens (else the tokens counted in chunks)
    cached_tokens: int = 0  # usage's prompt_tokens_details.cached_tokens (prefix-cache hits), if reported
    end_s: float = 0.0
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""  # the generated text (vLLM's generated_texts)
    cut: bool = False  # still running when the benchmark ended it (its SLO decided, or the deadline)

    @property
    def ok(self) -> bool:
        """Completed: a finish_reason arrived, no error, and at least one token."""
        return self.error is None and self.finish_reason is not None and bool(self.chunk_times)

    @property
    def token_times(self) -> list[float]:
        """Arrival time of each output token: a chunk's time once per token it carried; tokens the
        usage total reports beyond those came with the last chunk."""
        counts = self.chunk_tokens if self.chunk_tokens else [1] * len(self.chunk_times)
        times = [t for t, k in zip(self.chunk_times, counts) for _ in range(k)]
        if times and len(times) < self.output_tokens:
            times += [times[-1]] * (self.output_tokens - len(times))
        return times

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
        """Gaps between consecutive output tokens (zeros inside a multi-token chunk)."""
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]

    def late(self, now: float, ttft_s: float, tbt_s: float) -> bool:
        """Certain to miss the per-token SLO at ``now``: a token came after its deadline, or the next
        one (of the ``output_len`` asked for) is overdue. Unfinished, it can only stay a miss."""
        times = self.token_times
        if times and not token_deadlines_met(self.arrival_s, times, ttft_s, tbt_s).met:
            return True
        return next_token_overdue(self.arrival_s, len(times), self.output_len, now, ttft_s, tbt_s)

    def absorb(self, chunk: dict, now: float) -> None:
        """Take one parsed SSE chunk (``data: {...}``) that arrived at ``now``."""
        if "error" in chunk:
            err = chunk["error"]
            self.error = str(err.get("message") if isinstance(err, dict) else err)
            return
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids")
            text = choice.get("text")
            if text is None:  # chat form
                text = (choice.get("delta") or {}).get("content")
            self.text += text or ""
            k = len(ids) if ids is not None else (1 if text else 0)
            if k:
                self._add_chunk(now, k)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.output_tokens = int(usage["completion_tokens"])
        if usage and usage.get("prompt_tokens"):
            self.input_len = int(usage["prompt_tokens"])
        if usage and (usage.get("prompt_tokens_details") or {}).get("cached_tokens") is not None:
            self.cached_tokens = int(usage["prompt_tokens_details"]["cached_tokens"])

    def _add_chunk(self, now: float, k: int) -> None:
        if not self.chunk_tokens:
            self.chunk_tokens = [1] * len(self.chunk_times)
        self.chunk_times.append(now)
        self.chunk_tokens.append(k)

    def close(self, end_s: float) -> None:
        """The stream ended at ``end_s``: settle the token count."""
        self.end_s = end_s
        counted = sum(self.chunk_tokens) if self.chunk_tokens else len(self.chunk_times)
        if self.output_tokens > counted and not self.chunk_times and self.finish_reason is not None:
            self._add_chunk(end_s, self.output_tokens)  # no chunk said which tokens: all came at the end
        self.output_tokens = max(self.output_tokens, counted)


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000
    model: str
    api_key: str | None = None
    vocab_size: int = 30000  # synthetic prompt ids are drawn below this
    seed: int = 0
    timeout_s: float = 3600.0
    max_concurrency: int | None = None  # cap on requests in flight (None: open loop)
    return_token_ids: bool = True  # ask for per-chunk token ids (vLLM's extension; ConfluxServe has it)
    deadline_s: float | None = None  # give up on requests still running this long after the start
    # (TTFT, TBT) in s: once every request has been sent and each one still running is certain to miss
    # this per-token SLO (RequestResult.late), the run ends (its outcome is decided; None: run on)
    decided_slo: tuple[float, float] | None = None
    endpoint: str = COMPLETIONS  # COMPLETIONS or CHAT
    ignore_eos: bool = True  # generate exactly output_len tokens (vLLM's extension)
    progress: bool = False  # a tqdm bar of finished requests (on stderr)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")


def request_body(cfg: ClientConfig, req: BenchRequest, prompt: list[int] | str) -> dict:
    """The streamed request for ``cfg.endpoint``; chat takes a text prompt only."""
    body: dict = {"model": cfg.model, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if cfg.endpoint == CHAT:
        if not isinstance(prompt, str):
            raise ValueError("the chat endpoint takes text prompts (token ids only go to /v1/completions)")
        body.update(messages=[{"role": "user", "content": prompt}], max_completion_tokens=req.output_len)
    else:
        body.update(prompt=prompt, max_tokens=req.output_len)
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.return_token_ids:
        body["return_token_ids"] = True
    return body


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _stream(client: httpx.AsyncClient, cfg: ClientConfig, res: RequestResult, body: dict,
                  t0: float) -> None:
    async with client.stream("POST", f"{cfg.base_url}{cfg.endpoint}", json=body,
                             headers=auth_headers(cfg.api_key)) as r:
        if r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            res.absorb(json.loads(line[6:]), time.perf_counter() - t0)
            if res.error is not None:
                return


async def _one(client: httpx.AsyncClient, cfg: ClientConfig, req: BenchRequest, prompt: list[int] | str,
               t0: float, res: RequestResult, decided: asyncio.Event, sent: list[int]) -> RequestResult:
    res.arrival_s = time.perf_counter() - t0
    sent[0] += 1
    body = request_body(cfg, req, prompt)
    left = None if cfg.deadline_s is None else max(0.0, cfg.deadline_s - res.arrival_s)
    stream = asyncio.ensure_future(_stream(client, cfg, res, body, t0))
    stop = asyncio.ensure_future(decided.wait())
    try:
        await asyncio.wait({stream, stop}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        if stream.done():
            stream.result()
        elif stop.done():
            res.error, res.cut = "unfinished when the run ended: every request still running had missed its SLO", True
        else:
            res.error, res.cut = f"unfinished at the benchmark deadline ({cfg.deadline_s:g} s)", True
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        for t in (stream, stop):
            t.cancel()
        await asyncio.gather(stream, stop, return_exceptions=True)  # the stream is closed: the server aborts it
    res.close(time.perf_counter() - t0)
    return res


async def _decide(cfg: ClientConfig, results: list[RequestResult], t0: float, sent: list[int],
                  decided: asyncio.Event, poll_s: float = 0.05) -> None:
    """Set ``decided`` once every request was sent and each unfinished one is certain to miss the SLO."""
    ttft_s, tbt_s = cfg.decided_slo
    while True:
        await asyncio.sleep(poll_s)
        if sent[0] < len(results):
            continue
        now = time.perf_counter() - t0
        running = [r for r in results if r.finish_reason is None and r.error is None]
        if running and all(r.late(now, ttft_s, tbt_s) for r in running):
            decided.set()
            return


async def run_workload(cfg: ClientConfig, requests: list[BenchRequest],
                       prompts: list[list[int] | str] | None = None) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time; returns the results and the benchmark duration.

    ``prompts`` (token ids or text, one per request) default to ``workload.request_prompts`` drawn
    with ``cfg.seed``: built from the trace's blocks where a request has ``hash_ids`` (shared
    prefixes stay shared), else random ids of its length."""
    if prompts is None:
        rng = random.Random(cfg.seed)
        prompts = request_prompts(requests, cfg.vocab_size, rng)
    if len(prompts) != len(requests):
        raise ValueError(f"{len(prompts)} prompts for {len(requests)} requests")
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    for req, prompt in zip(requests, prompts):
        request_body(cfg, req, prompt)  # a prompt the endpoint cannot take fails before anything is sent
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    bar = tqdm(total=len(requests), disable=not cfg.progress, unit="req", desc="requests")
    results = [RequestResult(r.input_len, r.output_len) for r in requests]
    decided, sent = asyncio.Event(), [0]
    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        judge = asyncio.ensure_future(_decide(cfg, results, t0, sent, decided)) if cfg.decided_slo else None

        async def fire(req: BenchRequest, prompt: list[int] | str, res: RequestResult) -> RequestResult:
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                if limit is None:
                    return await _one(client, cfg, req, prompt, t0, res, decided, sent)
                async with limit:
                    return await _one(client, cfg, req, prompt, t0, res, decided, sent)
            finally:
                bar.update(1)

        try:
            await asyncio.gather(*[fire(*x) for x in zip(requests, prompts, results)])
        finally:
            bar.close()
            if judge is not None:
                judge.cancel()
        duration = time.perf_counter() - t0
    return list(results), duration
