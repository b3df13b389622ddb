"""Instance -> ingress delta feeds (actors/feeds.py, serve/feed_client.py) over a real EngineCore (tiny
random-weight model, in-process rank), without Ray: one feed carries several requests' deltas in
per-step batches, the tokens equal the per-request stream's, and an abort or a closed feed frees KV."""

from __future__ import annotations

import asyncio

from conflux_cluster.actors.instance import XPInstanceServer
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.serve.feed_client import FeedClient

PROMPTS = [[65 + i, 66, 67, 68 + i] for i in range(4)]


def _server() -> tuple[XPInstanceServer, LocalExecutor]:
    cfg = EngineConfig(model="tiny-llama", num_threads=1, load_progress=False, num_kv_blocks=64)
    src = resolve_model(cfg.model)
    ex = LocalExecutor(cfg, src)
    return XPInstanceServer(0, EngineCore(cfg, ex, source=src)), ex


def _req(rid: str, prompt: list[int], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


class _Local:
    """A Serve handle's call shape over the in-process server (``handle.method.remote(...)``)."""

    def __init__(self, server: XPInstanceServer) -> None:
        self.server = server
        self.batches: list[list] = []  # every batch the feed carried
        self.cancelled = 0  # feed calls cancelled by the caller (a Serve streaming call's cancel())

    def options(self, **_):
        return self

    def __getattr__(self, name: str):
        method = getattr(self.server, name)
        outer = self

        class _M:
            @staticmethod
            def remote(*args):
                if name != "feed":
                    return method(*args)

                async def recording():
                    async for batch in method(*args):
                        outer.batches.append(batch)
                        yield batch
                return _Call(recording(), outer)
        return _M()


class _Call:
    """A streaming call's shape: async iteration and ``cancel()``."""

    def __init__(self, gen, handle: _Local) -> None:
        self.gen, self.handle = gen, handle

    def __aiter__(self):
        return self.gen.__aiter__()

    def cancel(self) -> None:
        self.handle.cancelled += 1


async def _settled(server: XPInstanceServer, ex: LocalExecutor) -> tuple:
    """Once queued aborts reached the rank and nothing runs: (stats, every KV block free, open streams)."""
    await server.drain()
    stats = server.get_stats()
    free = ex.worker.kv.num_free_blocks == ex.worker.kv.num_blocks
    await server.shutdown()
    return stats, free, server.num_open_streams()


async def _text(deltas) -> tuple[str, list[int]]:
    text, ids = "", []
    async for d in deltas:
        text, ids = text + d.text, ids + list(d.token_ids)
    return text, ids


def test_one_feed_carries_all_requests_in_step_batches_and_matches_streams():
    async def main():
        server, ex = _server()
        handle = _Local(server)
        client = FeedClient(handle)
        streams = [await client.submit(_req(f"f{i}", p, 12)) for i, p in enumerate(PROMPTS)]
        fed = await asyncio.gather(*[_text(s) for s in streams])
        alone = [await _text(server.generate(_req(f"g{i}", p, 12))) for i, p in enumerate(PROMPTS)]
        await server.drain()
        client.close()
        await server.shutdown()
        return fed, alone, handle.batches, ex, server.get_stats()

    fed, alone, batches, ex, stats = asyncio.run(main())
    assert fed == alone and all(len(ids) == 12 for _, ids in fed)
    # the instance's tallies: one per non-empty step; one gap per token delta after a request's first
    # (8 requests of 12 tokens, one delta per token here: the engine emits each step's token at once)
    assert sum(stats.step_tally.snapshot()) == stats.iterations > 0
    assert sum(stats.itl_tally.snapshot()) == 8 * 11
    assert len(batches) < sum(len(b) for b in batches)  # deltas of several requests share a batch
    assert max(len({d.request_id for d in b}) for b in batches) == len(PROMPTS)
    assert ex.worker.kv.num_free_blocks == ex.worker.kv.num_blocks


def test_closing_a_submitted_stream_or_the_feed_aborts_and_frees_kv():
    async def main():
        server, ex = _server()
        handle = _Local(server)
        client = FeedClient(handle)
        a = await client.submit(_req("a", PROMPTS[0], 500))
        b = await client.submit(_req("b", PROMPTS[1], 500))
        assert not (await a.__anext__()).finished and not (await b.__anext__()).finished
        await a.aclose()  # this client went away: the instance aborts it
        for _ in range(500):
            if server.get_stats().aborted:
                break
            await asyncio.sleep(0.001)
        assert server.get_stats().aborted == 1
        client.close()  # the ingress replica's feed ends: what it still had is aborted
        assert handle.cancelled == 1  # and the call itself: the instance's replica is not left draining it
        return await _settled(server, ex)

    stats, free, open_streams = asyncio.run(main())
    assert stats.aborted == 2 and stats.requests == 2
    assert free and open_streams == 0


def test_a_refused_choice_aborts_the_choices_already_submitted():
    import pytest

    from conflux_cluster.engine.contracts.cluster import Routed
    from conflux_cluster.serve.backend import ServeBackend

    class _Router:
        class admit:  # noqa: N801 - handle.method.remote(...) shape
            @staticmethod
            async def remote(*_):
                return Routed(0)

    async def main():
        server, ex = _server()
        backend = ServeBackend(_Router(), [_Local(server)])
        bad = GenerateRequest("n-1", [10**9], SamplingParams(max_tokens=4))  # outside the vocabulary
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await backend.generate([_req("n-0", PROMPTS[0], 500), bad])
        return await _settled(server, ex)

    stats, free, open_streams = asyncio.run(main())
    assert stats.requests == 2 and stats.aborted == 1  # n-0 ran, then was aborted; n-1 was refused
    assert free and open_streams == 0


def test_a_feed_broken_under_the_ingress_warns_but_one_it_closed_does_not(caplog):
    """Serve turns the reader's cancellation inside a stream into RequestCancelledError (an Exception):
    after close() that is the ingress shutting down, not an instance failure to warn about (it was
    logged as one at every shutdown)."""
    import logging

    class _Failing:
        def __init__(self, handle) -> None:
            self.handle, self.fail = handle, asyncio.Event()

        def __aiter__(self):
            return self

        async def __anext__(self):
            try:
                await self.fail.wait()
            except asyncio.CancelledError:
                raise RuntimeError("request cancelled") from None  # as Serve's DeploymentResponseGenerator
            raise RuntimeError("stream ended under the reader")

        def cancel(self) -> None:
            pass

    class _Handle:
        def __init__(self) -> None:
            self.calls: list[_Failing] = []
            self.feed = self

        def options(self, **_):
            return self

        def remote(self, *_):
            self.calls.append(_Failing(self))
            return self.calls[-1]

    async def main(close: bool) -> None:
        client = FeedClient(_Handle())
        client.open()
        reader = client._reader
        await asyncio.sleep(0)  # the reader waits on the stream
        if close:
            client.close()
        else:
            client._handle.calls[-1].fail.set()  # the replica died
        await asyncio.gather(reader, return_exceptions=True)

    caplog.set_level(logging.DEBUG, logger="conflux_cluster.serve.feed_client")
    asyncio.run(main(close=True))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    asyncio.run(main(close=False))
    assert [r for r in caplog.records if r.levelno == logging.WARNING and "feed broke" in r.message]


def test_an_abort_that_overtakes_its_submit_ends_it_before_it_runs():
    """A client that leaves mid-submit gets its request aborted (``FeedClient._abort``); the abort and the submit
    are two handle calls, so the abort can reach the instance first. The instance keeps that id and the submit
    that follows adds nothing: no request runs to its end for nobody, holding KV."""
    async def main():
        server, ex = _server()
        handle = _Local(server)
        client = FeedClient(handle)
        feed_id, _ = client.open()
        await server.abort("late")  # nothing to abort yet
        await server.submit(_req("late", PROMPTS[0], 500), feed_id)
        other = await client.submit(_req("other", PROMPTS[1], 4))  # the instance keeps serving
        _, ids = await _text(other)
        assert len(ids) == 4
        client.close()
        return await _settled(server, ex)

    stats, free, open_streams = asyncio.run(main())
    assert stats.requests == 1 and stats.aborted == 1  # "late" never reached the engine
    assert free and open_streams == 0
