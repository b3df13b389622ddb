"""Fast failover of one XP instance when a rank dies (issue 12, item 3). No Serve, no engine here.

The instance sees a rank's death itself, without waiting for Serve's health checks:

* the iteration in flight fails (a compiled graph closes its channels when an actor dies; plain
  actor calls raise ``RayActorError``);
* a watcher asks every rank for its node id every ``watch_interval_s`` (an idle instance has no
  iteration to fail), and a dead actor answers with ``RayActorError`` at once.

Then::

    SERVING ──rank death──▶ REBUILDING ──rebuilt──▶ SERVING
                                 └──rebuild failed──▶ BROKEN  (Serve's health check replaces the replica)

While REBUILDING the instance reports itself unhealthy to the router (next report tick), so new
requests go to the other instances, or get 503 + ``Retry-After`` when none is left; its open streams
end with ``InstanceUnavailable``; the engine is rebuilt in place (``EngineHost.rebuild``: the old rank
actors are killed, new ones start in the same placement-group bundles, load the weights and warm up),
so the replica, its routes and its placement group stay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Protocol

from conflux_cluster.router.state import MAX_RETRY_AFTER_S, clamp_retry_after

log = logging.getLogger(__name__)


class Phase(str, Enum):
    SERVING = "serving"
    REBUILDING = "rebuilding"  # a rank died; new ranks are starting
    BROKEN = "broken"  # the rebuild failed; only replacing the replica helps


class EngineHost(Protocol):
    """What probes and rebuilds an instance's engine (the Serve deployment, over rank actors)."""

    async def probe(self) -> None:
        """Return when every rank answers; raise ``RankDied`` when one is gone."""
        ...

    def rebuild(self) -> Any:
        """Blocking: discard the current ranks (kill them), start new ones and return a fresh engine core."""
        ...

    @property
    def expected_build_s(self) -> float:
        """Seconds the last (re)build took: what a rebuild is expected to take."""
        ...


class RankDied(RuntimeError):
    """A rank actor of this instance is dead (raised by ``EngineHost.probe``)."""


@dataclass
class FailoverStats:
    """What happened so far (``/v1/conflux/stats``, tests, the failover benchmark)."""

    phase: Phase = Phase.SERVING
    failures: int = 0  # rank failures detected
    rebuilds: int = 0  # in-place rebuilds that succeeded
    last_cause: str = ""  # how the last failure was seen: "iteration" or "watcher"
    last_detected: float = 0.0  # time.time() of the last detection
    last_rebuild_s: float = 0.0  # seconds the last successful rebuild took


class Failover:
    """Phase, timings and the rebuild of one instance; the instance supplies what to do on each edge."""

    def __init__(self, index: int, host: EngineHost | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self.host = host  # None: nothing can rebuild the engine (in-process tests)
        self.stats = FailoverStats()
        self._clock = clock
        self._since = 0.0  # clock() when the current REBUILDING phase began

    @property
    def serving(self) -> bool:
        return self.stats.phase is Phase.SERVING

    def retry_after_s(self) -> int:
        """Whole seconds until the instance expects to serve again (>= 1)."""
        if self.stats.phase is not Phase.REBUILDING or self.host is None:
            return 1 if self.serving else MAX_RETRY_AFTER_S
        left = self.host.expected_build_s - (self._clock() - self._since)
        return clamp_retry_after(left)

    def rebuilding_for_s(self) -> float:
        return self._clock() - self._since if self.stats.phase is Phase.REBUILDING else 0.0

    def begin(self, cause: str) -> bool:
        """A failure was seen: True if it starts a rebuild (False: one is already under way or failed)."""
        if not self.serving or self.host is None:
            return False
        s = self.stats
        s.phase, s.failures, s.last_cause, s.last_detected = Phase.REBUILDING, s.failures + 1, cause, time.time()
        self._since = self._clock()
        return True

    async def rebuild(self, install: Callable[[Any], None]) -> None:
        """Rebuild the engine off the event loop, then ``install`` it (on the loop) and serve again."""
        assert self.host is not None and self.stats.phase is Phase.REBUILDING
        try:
            core = await asyncio.to_thread(self.host.rebuild)
        except Exception:  # noqa: BLE001 - nothing more to try in place; Serve replaces the replica
            log.exception("XP instance %d: rebuilding after a rank failure failed", self.index)
            self.stats.phase = Phase.BROKEN
            return
        install(core)
        s = self.stats
        s.phase, s.rebuilds, s.last_rebuild_s = Phase.SERVING, s.rebuilds + 1, self._clock() - self._since
        log.warning("XP instance %d: rebuilt in %.1f s after a rank failure (%s)", self.index,
                    s.last_rebuild_s, s.last_cause)

    async def watch(self, interval_s: float, on_failure: Callable[[str], None]) -> None:
        """Probe the ranks every ``interval_s`` while serving; a dead rank calls ``on_failure``."""
        assert self.host is not None
        while True:
            await asyncio.sleep(interval_s)
            if not self.serving:
                continue
            try:
                await self.host.probe()
            except RankDied:
                if self.serving:  # the iteration may have seen it first
                    on_failure("watcher")
            except Exception:  # noqa: BLE001 - a slow or odd answer is not a death; the health check still runs
                log.warning("XP instance %d: rank probe failed", self.index, exc_info=True)
