"""What the router tells an ingress about room, so the ingress can refuse before any per-request work.

The router is the one authority on admission (``RouterState.admit``), but asking it costs a
handle round trip per request, and the ingress would ask only after parsing, templating and
tokenizing the body. Under a burst that work queues up in front of every refusal. The router
therefore also publishes a small ``QueueView``: how many more requests the healthy instances can
queue, whether any instance is up, whether the server is draining, and how long a refused client
should wait. The ingress's gate (``conflux_cluster/serve/gate.py``) refuses from the latest view
before it reads the body's JSON; what it lets through is still decided by ``admit``.

``Retry-After`` comes from the measured drain rate (``DrainRate``): requests leaving the
instances' queues per second (their prefill done, or ended), over the last ``window_s``::

    retry_after = queued_requests / drain_rate      (whole seconds, within [1, 30])

i.e. how long the queue in front of a refused client takes to empty at the pace it empties now.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class QueueView:
    """The router's admission state as one ingress may cache it (a few tens of ms old at most)."""

    free_slots: int | None  # requests the healthy instances can still queue; None: no bound
    queued_requests: int  # requests waiting for prefill over the healthy instances (reported + in flight)
    retry_after_s: int  # what a refusal should say now (whole seconds, >= 1)
    any_healthy: bool = True  # False: every instance is down or being rebuilt (503 no_healthy_instance)
    draining: bool = False  # the server is shutting down: admit nothing (503 server_draining)
    drain_rate_rps: float | None = None  # measured requests leaving the queues per second (None: none seen yet)


@dataclass
class DrainRate:
    """Requests leaving the instances' queues per second, from their load reports.

    Each report gives an instance's monotone ``received_requests`` and its ``num_waiting``; their
    difference is how many requests have left its queue (prefilled or ended) in this incarnation.
    Increases are summed into one total; the rate is its increase over the last ``window_s``.
    """

    window_s: float = 10.0  # how far back the rate looks
    _left: dict = field(default_factory=dict)  # instance -> (incarnation, requests that left its queue)
    _total: int = 0  # requests that left any queue (sum of increases)
    _samples: deque = field(default_factory=deque)  # (time, _total), oldest first

    def observe(self, instance: int, incarnation: str, received_requests: int, num_waiting: int,
                now: float) -> None:
        left = max(0, received_requests - num_waiting)
        before = self._left.get(instance)
        if before is not None and before[0] == incarnation:  # a new replica's totals restart: counted from here
            self._total += max(0, left - before[1])
            left = max(left, before[1])
        self._left[instance] = (incarnation, left)
        self._samples.append((now, self._total))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def rate(self, now: float) -> float | None:
        """Requests per second over the window; None before two samples or when nothing left the queues."""
        if len(self._samples) < 2:
            return None
        t0, n0 = self._samples[0]
        span = max(now - t0, 1e-3)
        gone = self._total - n0
        return gone / span if gone > 0 else None
