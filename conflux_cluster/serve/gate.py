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
from a burst long gone); requests then pass up to the most free slots any view has shown, counting only
those in flight at the gate (the first arrivals after a quiet spell come before the next view does: the
burst before it, routed and long served, must not refuse them).

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
        else:  # only what is in flight here: what was routed since has been counted by the router, or has left
            free, taken = self._most_free, len(self._unrouted)
        if free is not None and taken >= free:
            return overloaded(view.retry_after_s if view is not None else 1)
        return None

    def is_draining(self) -> bool:
        """Whether this replica is draining (``/health``); refreshes the view so that a drain the router
        started is seen here within ``refresh_s`` of the next probe."""
        self._maybe_refresh()
        return self.draining

    def routed(self, rid: str) -> None:
        """The router has answered for ``rid`` (routed or refused): from now on its views count it."""
        if rid in self._unrouted:
            self._unrouted.discard(rid)
            self._routed_since_view += 1

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
    raised: the router has answered)."""

    def __init__(self, inner: Backend, gate: AdmissionGate) -> None:
        self.inner, self.gate = inner, gate

    async def generate(self, requests: Sequence[GenerateRequest]) -> Sequence[AsyncIterator[TokenDelta]]:
        try:
            return await self.inner.generate(requests)
        finally:
            if requests:
                self.gate.routed(response_id(list(requests)))
