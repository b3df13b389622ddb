"""What benchmarks/faults.py drives a server with: start/stop it, send and drop requests, read its state.

``Server`` is the app of ``conflux serve`` started in this process (local Ray) plus an aiohttp session
(one connection per request) and the Serve handles the checks read: KV blocks held per rank (after the
queued aborts reached the ranks), open streams, rank pids, the last build's timing.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp


@dataclass
class StreamEnd:
    """How a stream ended, as the client saw it."""

    status: int
    finish: str | None = None  # the last finish_reason ("length", "stop", "abort")
    error: str | None = None  # an in-band error event's code
    token_ids: list[int] = field(default_factory=list)  # every token id the events carried, in order

    def clean(self) -> bool:
        """Finished, or aborted with an in-band error and [DONE] (not cut off, not a 5xx status)."""
        return self.status == 200 and (self.finish in ("length", "stop") or (self.finish == "abort" and bool(self.error)))


@dataclass
class MemorySample:
    t: float  # time.monotonic()
    rss_mb: float  # resident memory of every instance's replica and rank actors, summed
    cuda_allocated_mb: float | None  # torch.cuda.memory_allocated over the ranks, summed (None on CPU)
    cuda_reserved_mb: float | None  # torch.cuda.memory_reserved over the ranks, summed (None on CPU)
    gpu_used_mb: float | None  # nvidia-smi's memory.used over all GPUs (None without one)


def p50(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


READY_TIMEOUT_S = 300.0  # s: /v1/models answers 200 by then (CPU, two busy cores)


async def _model_card(s: aiohttp.ClientSession, base: str, timeout_s: float) -> dict:
    """The served model's card, once ``/v1/models`` answers 200. Right after ``serve.run`` returned, the
    ingress can still answer 503 ``server_starting``: its readiness probe gives the instances 0.5 s, which a
    loaded 2-core machine can exceed (as ``conflux_cluster.bench.server.ServerProcess`` waits too)."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with s.get(f"{base}/v1/models") as r:
            if r.status == 200:
                return (await r.json())["data"][0]
            body = await r.text()
        if r.status != 503 or time.monotonic() > deadline:
            raise RuntimeError(f"GET {base}/v1/models answered {r.status}: {body[:300]}")
        await asyncio.sleep(0.5)


class Server:
    """A started app and what the checks read from it (use ``Server.start``)."""

    def __init__(self, base: str, app: str, model: str, max_model_len: int, startup_s: float,
                 vocab_size: int) -> None:
        self.base, self.app, self.model, self.vocab_size = base, app, model, vocab_size
        self.max_model_len, self.startup_s = max_model_len, startup_s
        self.session: aiohttp.ClientSession | None = None

    @classmethod
    @asynccontextmanager
    async def start(cls, model: str | None, device: str, extra: dict) -> AsyncIterator["Server"]:
        import ray
        from ray import serve

        from conflux_cluster.config import ServeConfig
        from conflux_cluster.engine.loader import resolve_model
        from conflux_cluster.serve.app import run

        t0 = time.monotonic()
        fields = {"port": 0, "device": device, "log_stats_interval_s": 0, **extra}
        if model:
            fields["model"] = model
        try:
            cfg = await asyncio.to_thread(run, ServeConfig(**fields))
            base = f"http://127.0.0.1:{cfg.port}"
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                             timeout=aiohttp.ClientTimeout(total=1800)) as s:
                card = await _model_card(s, base, READY_TIMEOUT_S)
                server = cls(base, cfg.app_name, card["id"], card["max_model_len"], round(time.monotonic() - t0, 1),
                             resolve_model(cfg.model).config.vocab_size)
                server.session = s
                yield server
        finally:
            # Also when the start-up failed. run() started Ray in a worker thread, and Ray ties its GCS and
            # raylet to that thread (PR_SET_PDEATHSIG): they are killed when asyncio.run() ends its executor.
            # A driver left connected to them is ended by Ray ~60 s later ("Failed to connect to GCS within
            # 60 seconds"), whatever this process (a pytest worker) is doing by then.
            if ray.is_initialized():
                try:
                    serve.shutdown()
                finally:
                    ray.shutdown()

    # ---- Serve handles -------------------------------------------------------------------------

    def _xp(self, i: int) -> Any:
        from ray import serve

        return serve.get_deployment_handle(f"xp-{i}", app_name=self.app)

    async def _instances(self) -> list[int]:
        from ray import serve

        return await serve.get_deployment_handle("router", app_name=self.app).live_instances.remote()

    async def kv_zero(self) -> bool:
        """Every rank of every instance holds no KV block (after the queued aborts reached the ranks)."""
        held = [await self._xp(i).kv_blocks_held.remote() for i in await self._instances()]
        return all(h == 0 for ranks in held for h in ranks)

    async def instance_stats(self, i: int) -> dict:
        return await self._xp(i).control_plane.remote()

    async def rank_pids(self, i: int) -> list[int]:
        return (await self._xp(i).placement.remote()).rank_pids

    async def rebuilds(self, i: int) -> int:
        return (await self._xp(i).failover_stats.remote()).rebuilds

    async def preemptions(self) -> int:
        return sum([(await self.instance_stats(i))["num_preemptions"] for i in await self._instances()])

    async def pool_tokens(self) -> int:
        """KV tokens all instances' ranks hold at once."""
        total = 0
        for i in await self._instances():
            s = await self.instance_stats(i)
            total += s["kv_blocks_per_rank"] * s["block_size"] * len(await self.rank_pids(i))
        return total

    async def wait_open_streams(self, n: int, timeout_s: float = 600) -> None:
        t0 = time.monotonic()
        while sum([await self._xp(i).num_open_streams.remote() for i in await self._instances()]) < n:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{n} streams did not open")
            await asyncio.sleep(0.1)

    def random_prompt(self, rng, n: int) -> list[int]:
        """``n`` random token ids of the model's vocabulary (past the special ones at its start)."""
        hi = min(self.vocab_size, 20000)
        return [rng.randrange(min(100, hi // 2), hi) for _ in range(n)]

    def fit(self, tokens: int, out: int) -> int:
        """``tokens`` capped so that the prompt and ``out`` tokens fit the context."""
        return max(16, min(tokens, self.max_model_len - out - 8))

    # ---- requests ------------------------------------------------------------------------------

    def _body(self, prompt: list[int], max_tokens: int, stream: bool) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": stream}

    async def timed_completion(self) -> float | None:
        """Seconds for a short request (32 prompt tokens, 16 out); None if it failed."""
        t0 = time.monotonic()
        status, _ = await completion(self, [11] * 32, 16)
        return time.monotonic() - t0 if status == 200 else None

    async def normal_latency(self) -> float | None:
        """p50 of three short requests one after another on the idle server."""
        return p50([await self.timed_completion() for _ in range(3)])


async def completion(server: Server, prompt: list[int], max_tokens: int) -> tuple[int, tuple[int, ...]]:
    """A greedy completion: (status, its token ids)."""
    async with server.session.post(f"{server.base}/v1/completions",
                                   json=server._body(prompt, max_tokens, False)) as r:
        data = await r.read()
        if r.status != 200:
            return r.status, ()
        return 200, tuple(json.loads(data)["choices"][0]["token_ids"])


async def chat_ok(server: Server, max_tokens: int) -> tuple[int]:
    body = {"model": server.model, "messages": [{"role": "user", "content": "Say something about the sea."}],
            "max_tokens": max_tokens, "temperature": 0.7}
    async with server.session.post(f"{server.base}/v1/chat/completions", json=body) as r:
        await r.read()
        return (r.status,)


async def _events(r: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    async for line in r.content:
        if line.startswith(b"data: {"):
            yield json.loads(line[6:])


async def stream_completion(server: Server, prompt: list[int], max_tokens: int) -> StreamEnd:
    """A streamed greedy completion, read to its end."""
    async with server.session.post(f"{server.base}/v1/completions",
                                   json=server._body(prompt, max_tokens, True)) as r:
        end = StreamEnd(r.status)
        if r.status != 200:
            await r.read()
            return end
        async for ev in _events(r):
            if "error" in ev:
                end.error = ev["error"].get("code") or "error"
            for c in ev.get("choices") or []:
                end.token_ids += c.get("token_ids") or []
                end.finish = c.get("finish_reason") or end.finish
        return end


async def drop_stream(server: Server, prompt: list[int], max_tokens: int, when: str, after_tokens: int = 1):
    """Start a stream and close the connection: ``when`` "prefill" once it is routed (status line, no
    token yet), "decode" after ``after_tokens`` tokens. Returns ``when``, "finished" if it ended first, or
    the status when it was not 200."""
    async with server.session.post(f"{server.base}/v1/completions",
                                   json=server._body(prompt, max_tokens, True)) as r:
        if r.status != 200:
            await r.read()
            return r.status
        if when == "prefill":
            r.close()
            return when
        seen = 0
        async for ev in _events(r):
            seen += sum(len(c.get("token_ids") or []) for c in ev.get("choices") or [])
            if seen >= after_tokens:
                r.close()
                return when
        return "finished"


async def sample_memory(server: Server) -> MemorySample:
    """Every instance's replica and rank processes (their own report: psutil, torch.cuda) and nvidia-smi."""
    rss, alloc, reserved = 0.0, None, None
    for i in await server._instances():
        mem = await server._xp(i).memory.remote()
        rss += mem.replica_rss_mb + sum(r.rss_mb for r in mem.ranks)
        for r in mem.ranks:
            if r.cuda_allocated_mb is not None:
                alloc = (alloc or 0.0) + r.cuda_allocated_mb
                reserved = (reserved or 0.0) + r.cuda_reserved_mb
    return MemorySample(round(time.monotonic(), 1), round(rss, 1), alloc, reserved, _nvidia_smi_used_mb())


def _nvidia_smi_used_mb() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        return float(sum(int(x) for x in out.stdout.split())) if out.returncode == 0 else None
    except ValueError:
        return None
