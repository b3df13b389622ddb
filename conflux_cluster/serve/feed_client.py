"""The ingress side of an instance's delta feed (actors/feeds.py): one Serve stream per (this ingress
replica, instance) carrying every request's token deltas, one batch per engine step, split here into
per-request streams.

    submit(request):  register a queue ─▶ instance.submit(request, feed id) ─▶ deltas from the feed
    consumer gone:    instance.abort(request id) (its KV is freed)
    feed broken:      every open request ends with InstanceUnavailable (in flight); the next request
                      opens a new feed (the instance aborts what the old one still had)

An abort is a Serve call made outside the HTTP request's context: in an ingress, Serve cancels a
request's child calls when that request is cancelled (its client went away), and an abort sent while
its request was being cancelled was cancelled with it before reaching the instance (1 to 4 of 20
disconnected streams kept generating, holding their KV).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from typing import TYPE_CHECKING, AsyncIterator

from conflux_cluster.engine.contracts.stream import InstanceUnavailable, TokenDelta, merge_deltas
from conflux_cluster.engine.contracts.request import GenerateRequest

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # a broken feed's requests: when to retry (the router knows better once the instance reports)


class FeedClient:
    """This process's feed from one XP instance (``handle``: its Serve deployment handle)."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle
        self._feed_id = ""
        self._reader: asyncio.Task | None = None
        self._gen: DeploymentResponseGenerator | None = None  # the open feed's streaming call
        self._queues: dict[str, asyncio.Queue] = {}  # the open feed's requests
        self._background: set[asyncio.Task] = set()  # fire-and-forget aborts, kept referenced

    async def submit(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Submit ``request`` with this feed (what the instance refuses raises here) and return its deltas.
        Closing the returned iterator before the request finished aborts it on the instance."""
        feed_id, queues = self.open()
        rid = request.request_id
        queue: asyncio.Queue = asyncio.Queue()
        queues[rid] = queue
        try:
            await self._handle.submit.remote(request, feed_id)
        except BaseException as e:
            queues.pop(rid, None)
            if isinstance(e, asyncio.CancelledError):  # the client left mid-submit: it may have been admitted
                self._abort(rid)
            raise
        return self._deltas(rid, queue, queues)

    async def _deltas(self, rid: str, queue: asyncio.Queue, queues: dict[str, asyncio.Queue]
                      ) -> AsyncIterator[TokenDelta]:
        finished, held = False, None
        try:
            while not finished:
                delta, held = (held, None) if held is not None else (await queue.get(), None)
                while isinstance(delta, TokenDelta) and not delta.finished and not queue.empty():
                    nxt = queue.get_nowait()  # the consumer fell behind: one delta (output before a failure
                    if not isinstance(nxt, TokenDelta) or nxt.finish_reason == "error":  # stays its own)
                        held = nxt
                        break
                    delta = merge_deltas(delta, nxt)
                if isinstance(delta, BaseException):
                    raise delta
                if delta.finish_reason == "error":  # the instance lost a rank under it
                    raise InstanceUnavailable(delta.retry_after_s or RETRY_AFTER_S, in_flight=True)
                finished = delta.finished
                yield delta
        finally:
            queues.pop(rid, None)
            if not finished:
                self._abort(rid)

    def cancel(self, rid: str) -> None:
        """Give up on a submitted request whose deltas were never read: forget it, abort it on the instance."""
        if self._queues.pop(rid, None) is not None:
            self._abort(rid)

    def open(self) -> tuple[str, dict[str, asyncio.Queue]]:
        """The open feed (id and its request queues), opened now if there is none or it broke."""
        if self._reader is None or self._reader.done():
            self._feed_id, self._queues = uuid.uuid4().hex, {}
            self._gen = self._handle.options(stream=True).feed.remote(self._feed_id)
            self._reader = asyncio.create_task(self._read(self._gen, self._queues), name=f"feed-{self._feed_id[:8]}")
        return self._feed_id, self._queues

    async def _read(self, gen: DeploymentResponseGenerator, queues: dict[str, asyncio.Queue]) -> None:
        """Hand each delta of the feed to its request's queue; when the feed ends, fail what is open."""
        try:
            async for batch in gen:
                for delta in batch:
                    queue = queues.pop(delta.request_id, None) if delta.finished else queues.get(delta.request_id)
                    if queue is not None:  # (its consumer keeps the queue; a finished one is forgotten here)
                        queue.put_nowait(delta)
        except Exception:  # noqa: BLE001 - the instance's replica died or was replaced
            if gen is self._gen:
                log.warning("instance feed broke; its open requests fail over", exc_info=True)
            else:  # close() cancelled it: the ingress is shutting down
                log.debug("instance feed closed", exc_info=True)
        finally:
            for queue in queues.values():
                queue.put_nowait(InstanceUnavailable(RETRY_AFTER_S, in_flight=True))
            queues.clear()

    def _abort(self, rid: str) -> None:
        async def abort() -> None:
            try:
                await self._handle.abort.remote(rid)
            except Exception:  # noqa: BLE001 - instance gone: nothing left to free
                log.debug("abort of %s not delivered", rid, exc_info=True)
        # a fresh context: the abort is not a child call of the (cancelled) request it ends
        task = asyncio.get_running_loop().create_task(abort(), context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def close(self) -> None:
        """End the feed on both sides: the instance's stream ends (it aborts the feed's open requests) and
        does not hold that replica's shutdown until Serve's graceful timeout."""
        gen, self._gen = self._gen, None
        if gen is not None:  # the Serve streaming call (DeploymentResponseGenerator)
            gen.cancel()
        if self._reader is not None:
            self._reader.cancel()
