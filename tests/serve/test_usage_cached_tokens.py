"""OpenAI usage reports prefix-cache hits as OpenAI does (``usage.prompt_tokens_details.cached_tokens``):
the OpenAI layer over a real instance server (tiny model, one in-process rank, prefix cache on)."""

from __future__ import annotations

import asyncio
import json

from conflux_cluster.actors.instance import XPInstanceServer
from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.loader import load_tokenizer, resolve_model
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.serve.handlers import OpenAIServing
from conflux_cluster.serve.protocol import CompletionRequest

from .direct_backend import DirectBackend



def test_second_request_reports_its_cached_prompt_tokens():
    cfg = EngineConfig(model="tiny-llama", num_threads=1, load_progress=False, num_kv_blocks=128,
                       scheduler=SchedulerConfig(enable_prefix_caching=True))
    src = resolve_model(cfg.model)
    server = XPInstanceServer(0, EngineCore(cfg, LocalExecutor(cfg, src), source=src))
    serving = OpenAIServing("tiny", load_tokenizer(src), 2048, DirectBackend(server), vocab_size=src.config.vocab_size)
    prompt = list(range(100, 200))  # 100 tokens: 6 full blocks of 16, the last token always recomputed

    async def main():
        usages = []
        for stream in (False, False, True):
            req = CompletionRequest(model="tiny", prompt=prompt, max_tokens=3, temperature=0, stream=stream,
                                    stream_options={"include_usage": True} if stream else None)
            requests = serving.prepare(req)
            if stream:
                chunks = [c async for c in serving.completion_stream(req, requests)]
                last = [json.loads(c[6:]) for c in chunks if c.startswith("data: {")][-1]
                usages.append(last["usage"])
            else:
                usages.append((await serving.completion(req, requests)).usage.model_dump())
        await server.drain()
        await server.shutdown()
        return usages

    first, second, streamed = asyncio.run(main())
    assert first["prompt_tokens_details"] == {"cached_tokens": 0} and first["prompt_tokens"] == 100
    assert second["prompt_tokens_details"] == {"cached_tokens": 96}
    assert streamed["prompt_tokens_details"] == {"cached_tokens": 96}
