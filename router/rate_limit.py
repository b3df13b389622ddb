"""Per-client request rate limit: one token bucket per API key. Pure Python, clock injected.

A client (an API key, by an id of it; every request without keys shares the id ``""``) may send
``burst`` requests at once and ``requests_per_minute`` on average::

    tokens(t) = min(burst, tokens(t0) + (t − t0) · requests_per_minute / 60)

A request takes one token; with none left the router refuses it (HTTP 429 with ``Retry-After``: the
time until a token is back). It lives in the router actor, beside the admission bound, so every
ingress replica draws on the same buckets. Buckets exist only for ids that reached the router, i.e.
for keys that passed the ingress's check: their number is bounded by the configured keys.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class RateLimit:
    """The limit every client gets."""

    requests_per_minute: float  # average rate (> 0)
    burst: int  # requests a client may send at once (>= 1)

    def __post_init__(self) -> None:
        if self.requests_per_minute <= 0 or self.burst < 1:
            raise ValueError(f"rate limit needs requests_per_minute > 0 and burst >= 1, got {self}")


@dataclass
class _Bucket:
    tokens: float
    at: float  # clock() of the last refill


class KeyRateLimiter:
    """Token buckets keyed by client id."""

    def __init__(self, limit: RateLimit, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def _bucket(self, client: str) -> _Bucket:
        now = self._clock()
        b = self._buckets.get(client)
        if b is None:
            b = self._buckets[client] = _Bucket(float(self.limit.burst), now)
        b.tokens = min(float(self.limit.burst), b.tokens + (now - b.at) * self.limit.requests_per_minute / 60.0)
        b.at = now
        return b

    def take(self, client: str) -> int:
        """Take a token for one request of ``client``: 0 when allowed, else the whole seconds (>= 1)
        until a token is back (nothing taken)."""
        b = self._bucket(client)
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return 0
        return max(1, math.ceil((1.0 - b.tokens) * 60.0 / self.limit.requests_per_minute))

    def give_back(self, client: str) -> None:
        """Return the token of a request that was refused for another reason (every instance full)."""
        b = self._bucket(client)
        b.tokens = min(float(self.limit.burst), b.tokens + 1.0)
