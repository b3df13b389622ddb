"""The XP instance's serving loop over a real EngineCore (tiny random-weight model, in-process rank),
without Ray: streams, concurrent requests, stop strings, and aborts that free KV."""

from __future__ import annotations

import asyncio

import pytest

from conflux_cluster.actors.instance import XPInstanceServer
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.sampling_params import SamplingParams


def _server() -> tuple[XPInstanceServer, LocalExecutor]:
    cfg = EngineConfig(model="tiny-llama", num_threads=1, load_progress=False, num_kv_blocks=64)
    src = resolve_model(cfg.model)
    ex = LocalExecutor(cfg, src)
    return XPInstanceServer(0, EngineCore(cfg, ex, source=src)), ex


def _req(rid: str, prompt: list[int], max_tokens: int, stop: tuple[str, ...] = ()) -> GenerateRequest:
    # the engine gets the stop strings and matches them
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                       stop=list(stop)))


async def _collect(server: XPInstanceServer, rid: str, prompt: list[int], n: int, stop=()) -> tuple[str, list]:
    text, deltas = "", []
    async for d in server.generate(_req(rid, prompt, n, stop)):
        text += d.text
        deltas.append(d)
    return text, deltas


def test_concurrent_streams_match_sequential_and_free_kv():
    async def main():
        server, ex = _server()
        prompts = [[65 + i, 66, 67, 68 + i] for i in range(3)]
        together = await asyncio.gather(*[_collect(server, f"a{i}", p, 8) for i, p in enumerate(prompts)])
        alone = [await _collect(server, f"b{i}", p, 8) for i, p in enumerate(prompts)]
        await server.drain()
        await server.shutdown()
        return together, alone, ex

    together, alone, ex = asyncio.run(main())
    assert [t for t, _ in together] == [t for t, _ in alone]
    for _, deltas in together:
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert deltas[-1].num_output_tokens == 8 and sum(len(d.token_ids) for d in deltas) == 8
    assert ex.worker.kv.num_free_blocks == ex.worker.kv.num_blocks


def test_consumer_leaving_early_aborts_and_frees_kv():
    async def main():
        server, ex = _server()
        gen = server.generate(_req("x", [70, 71, 72], 500))
        first = await gen.__anext__()
        held = ex.worker.kv.num_blocks - ex.worker.kv.num_free_blocks
        await gen.aclose()  # the client went away
        await server.drain()
        stats = server.get_stats()
        free = ex.worker.kv.num_free_blocks == ex.worker.kv.num_blocks
        await server.shutdown()
        return first, held, free, stats

    first, held, free, stats = asyncio.run(main())
    assert not first.finished and held > 0
    assert free and stats.aborted == 1 and stats.requests == 1


def test_stop_string_cuts_text_and_ends_request():
    async def main():
        server, ex = _server()
        full, _ = await _collect(server, "f", [80, 81, 82], 12)
        # a stop string taken from the middle of the greedy text (ignore leading chars)
        stop = full[4:6]
        cut, deltas = await _collect(server, "s", [80, 81, 82], 12, stop=(stop,))
        await server.drain()
        free = ex.worker.kv.num_free_blocks == ex.worker.kv.num_blocks
        await server.shutdown()
        return full, stop, cut, deltas, free

    full, stop, cut, deltas, free = asyncio.run(main())
    if not stop:
        pytest.skip("tiny model produced too little text for a stop string")
    assert cut == full[:full.find(stop)] and deltas[-1].finish_reason == "stop" and free
