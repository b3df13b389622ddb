"""Admission before work: an ingress replica refuses from the router's latest ``QueueView``.

The router decides admission (``RouterState.admit``), but only once the ingress has read, parsed,
templated and tokenized the body and made a handle call. Under a burst of a thousand requests that
work queues in front of every refusal (a refusal that takes seconds is of no use to a client). The
gate answers first, with no await and no per-request work::

    arrival ─▶ key check ─▶ gate.enter ──refuse──▶ 503 + Retry-After   (draining / no instance / full)
                                │ pass
                                ▼
                 body, parse, template, tokenize ─▶ router.admit (the authority) ─▶ gate.routed

It counts the requests it let through since the last view (``consumed``: not yet routed, or routed
after the view was taken) against the view's free slots, and refreshes the view from the router at
most every ``refresh_s`` while requests arrive (in the background: no arrival waits for it). What it
lets through is still decided by the router, so a view a few ms late costs a little tokenizing, never
a wrong admission; with several ingress replicas each may let the same free slots through, and the
router refuses the surplus. A view older than ``stale_s`` is not trusted to refuse (it may say "full"
from a burst long gone); requests then pass up to the most free slots any view has shown, counting those
this replica still has in the router's queues: let through and not yet routed, or routed and still waiting
for their first token (a queue slot is held until prefill; the first arrivals after a quiet spell come
before the next view does, and the burst before it, long served, must not refuse them). So a view that
goes stale during a burst (the router busy answering it, behind Serve's Python proxy) still bounds
admission, and the router is not left to refuse the surplus after it has been tokenized::

    enter ──▶ unrouted ──routed──▶ waiting ──first token, or its stream ends──▶ (no queue slot)

Draining (``serve/drain.py``) is local and immediate: once set, every arrival gets 503
``server_draining``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Awaitable, Callable, Sequence

from conflux_cluster.engine.contracts.stream import TokenDelta
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.router.queue_view import QueueView

from .errors import APIError, draining, overloaded, unavailable
from .handlers import Backend, response_id

log = logging.getLogger(__name__)

REFRESH_S = 0.05  # how often the view is refreshed while requests arrive
STALE_S = 1.0  # a view older than this does not refuse
FETCH_TIMEOUT_S = 2.0  # a router that does not answer this fast leaves the view as it was


class AdmissionGate:
    """One ingress replica's early admission check (see the module docstring)."""

    def __init__(self, fetch: Callable[[], Awaitable[QueueView]] | None, refresh_s: float = REFRESH_S,
                 stale_s: float = STALE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch  # asks the router for its view (None: no router, the gate refuses only when draining)
        self.refresh_s, self.stale_s, self._clock = refresh_s, stale_s, clock
        self._view: QueueView | None = None  # the latest view
        self._view_at = float("-inf")  # clock when it arrived
        self._most_free: int | None = None  # the most free slots any view showed (None: unbounded or none yet)
        self._unrouted: set[str] = set()  # response ids let through whose routing has not happened yet
        self._waiting: set[str] = set()  # let through and routed, no first token yet: in a router queue
        self._routed_since_view = 0  # let through, then routed after the view arrived
        self._refresh: asyncio.Task | None = None
        self.draining = False  # set by the drain: every arrival is refused
        self.refused = 0  # arrivals refused here (the router never saw them)

    def enter(self, rid: str) -> APIError | None:
        """The refusal for an arrival with response id ``rid``, or None: it may go on (then ``leave(rid)``
        once it is done, whatever happened). Synchronous: no arrival waits for the router here."""
        self._maybe_refresh()
        refusal = self._refusal()
        if refusal is not None:
            self.refused += 1
            return refusal
        self._unrouted.add(rid)
        return None

    def _refusal(self) -> APIError | None:
        view = self._view
        fresh = view is not None and self._clock() - self._view_at <= self.stale_s
        if self.draining or (fresh and view.draining):
            return draining()
        if fresh and not view.any_healthy:
            return unavailable(view.retry_after_s)
        if fresh:  # the view's free slots, less what passed since: in flight here, or routed after the view
            free, taken = view.free_slots, len(self._unrouted) + self._routed_since_view
        else:  # only what this replica holds in the queues now: what has been prefilled has left them;
            # no view has shown a free slot yet (taken before the instances reported): nothing to bound by
            free, taken = self._most_free or None, len(self._unrouted) + len(self._waiting)
        if free is not None and taken >= free:
            return overloaded(view.retry_after_s if view is not None else 1)
        return None

    def is_draining(self) -> bool:
        """Whether this replica is draining (``/health``); refreshes the view so that a drain the router
        started is seen here within ``refresh_s`` of the next probe."""
        self._maybe_refresh()
        return self.draining

    def routed(self, rid: str, queued: bool = True) -> None:
        """The router has answered for ``rid``: from now on its views count it. ``queued``: it was routed
        (it waits in an instance's queue until ``started``); False: refused or failed."""
        if rid in self._unrouted:
            self._unrouted.discard(rid)
            self._routed_since_view += 1
            if queued:
                self._waiting.add(rid)

    def started(self, rid: str) -> None:
        """``rid``'s first token came, or its streams ended without one: it holds no queue slot now."""
        self._waiting.discard(rid)

    def leave(self, rid: str) -> None:
        """``rid`` is done (answered, or failed before it was routed)."""
        self._unrouted.discard(rid)

    def _maybe_refresh(self) -> None:
        if self._fetch is None or (self._refresh is not None and not self._refresh.done()):
            return
        if self._clock() - self._view_at >= self.refresh_s:
            self._refresh = asyncio.get_running_loop().create_task(self._refreshed(), name="gate-refresh")

    async def _refreshed(self) -> None:
        if self._fetch is None:  # no router: nothing to fetch
            return
        try:
            view = await asyncio.wait_for(self._fetch(), FETCH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the router is slow or restarting: it still decides each request
            log.debug("the router's queue view did not come", exc_info=True)
            return
        self._view, self._view_at, self._routed_since_view = view, self._clock(), 0
        self.draining = self.draining or view.draining  # the router drains for every ingress replica
        if view.free_slots is not None:
            self._most_free = max(self._most_free or 0, view.free_slots)

    async def refresh_now(self) -> QueueView | None:
        """Fetch the view now (tests, and the drain's last look); the latest view."""
        await self._refreshed()
        return self._view


class GatedBackend:
    """A ``Backend`` that tells the gate when a request has been routed (its generate call returned or
    raised: the router has answered) and when it has left the queues (its first token)."""

    def __init__(self, inner: Backend, gate: AdmissionGate) -> None:
        self.inner, self.gate = inner, gate

    async def generate(self, requests: Sequence[GenerateRequest]) -> Sequence[AsyncIterator[TokenDelta]]:
        if not requests:
            return await self.inner.generate(requests)
        rid = response_id(list(requests))
        try:
            streams = await self.inner.generate(requests)
        except BaseException:
            self.gate.routed(rid, queued=False)
            raise
        self.gate.routed(rid)
        return [_FirstToken(s, self.gate, rid) for s in streams]


class _FirstToken:
    """One choice's delta stream that calls ``gate.started(rid)`` at its first delta, at its end, or when
    it is dropped unread (a request whose streams are never read must not hold a slot at the gate)."""

    def __init__(self, stream: AsyncIterator[TokenDelta], gate: AdmissionGate, rid: str) -> None:
        self._it, self._gate, self._rid = aiter(stream), gate, rid

    def __aiter__(self) -> "_FirstToken":
        return self

    async def __anext__(self) -> TokenDelta:
        try:
            delta = await anext(self._it)
        except BaseException:
            self._started()
            raise
        self._started()
        return delta

    async def aclose(self) -> None:
        self._started()
        close = getattr(self._it, "aclose", None)
        if close is not None:
            await close()

    def _started(self) -> None:
        if self._gate is not None:
            self._gate.started(self._rid)
            self._gate = None

    def __del__(self) -> None:
        self._started()
