"""Instance -> ingress delta feeds: one stream per (ingress replica, instance) carrying every request's
token deltas, one batch per engine step.

A per-request Serve stream costs the instance's process one Ray object per token (≈ 0.26 ms of CPU
on the CI machine: docs/results/LOG.md); with 64 requests decoding that is the
event loop's whole step, taken from the engine thread through the GIL. A feed sends one object per
step for all of an ingress replica's requests, as vLLM's engine core sends one message per step to
its API server::

    ingress replica                               XP instance replica
      open:    feed(feed_id) ──── stream ───────▶ Feed: batches of TokenDelta, one per step
      request: submit(req, params, feed_id) ────▶ engine (its deltas join that feed)
      gone:    abort(request_id) ───────────────▶ engine abort (KV freed)

The instance creates a feed on the first call that names it (``feed`` or ``submit``: they may
arrive in either order). When the ingress side closes the feed stream, every unfinished request of
the feed is aborted.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from conflux_cluster.engine.contracts.stream import TokenDelta


@dataclass
class Feed:
    """The deltas of one ingress replica's requests on this instance."""

    feed_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # batches (lists of TokenDelta)
    pending: list[TokenDelta] = field(default_factory=list)  # this step's deltas, not yet queued
    requests: set[str] = field(default_factory=set)  # unfinished requests submitted with this feed

    def add(self, delta: TokenDelta) -> None:
        self.pending.append(delta)
        if delta.finished:
            self.requests.discard(delta.request_id)

    def flush(self) -> None:
        """Queue this step's deltas as one batch."""
        if self.pending:
            self.queue.put_nowait(self.pending)
            self.pending = []

    async def next_batch(self) -> list[TokenDelta]:
        """The next batch; everything queued since, if the consumer fell behind, in the same one."""
        batch = await self.queue.get()
        while not self.queue.empty():
            batch = batch + self.queue.get_nowait()
        return batch


class FeedTable:
    """The instance's open feeds by id."""

    def __init__(self) -> None:
        self._feeds: dict[str, Feed] = {}
        self._dirty: set[str] = set()

    def __len__(self) -> int:
        return len(self._feeds)

    def get(self, feed_id: str) -> Feed:
        """The feed named ``feed_id``, created on first use."""
        feed = self._feeds.get(feed_id)
        if feed is None:
            feed = self._feeds[feed_id] = Feed(feed_id)
        return feed

    def add(self, feed: Feed, delta: TokenDelta) -> None:
        feed.add(delta)
        self._dirty.add(feed.feed_id)

    def flush(self) -> None:
        """End of a step's deliveries: every feed that got deltas queues them as one batch."""
        for fid in self._dirty:
            feed = self._feeds.get(fid)
            if feed is not None:
                feed.flush()
        self._dirty.clear()

    def close(self, feed_id: str) -> set[str]:
        """Forget the feed; returns its unfinished requests (to abort)."""
        feed = self._feeds.pop(feed_id, None)
        self._dirty.discard(feed_id)
        return set(feed.requests) if feed is not None else set()
