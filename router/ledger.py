"""What one router has sent to one instance that the instance has not yet reported. Pure Python.

The router counts what it sends; the instance reports what it has received, as monotone totals::

    inflight = sent − offset − received        (requests and prompt tokens alike)

Totals make the difference exact whatever order sends and reports arrive in. ``offset`` covers
the sends a report can never account for:

* a new incarnation (the instance's replica was replaced): its totals restart, so everything sent
  before it is written off (``offset = sent − received``: nothing in flight at that report);
* a send that never arrived (the ingress was cancelled between the routing decision and the
  instance call, or Serve dropped the call): a send older than ``lost_after_s`` that a fresh
  report still does not count is written off. Only a report does this, so sends to an instance
  that stopped reporting (dead, being rebuilt) stay in flight and keep it looking busy;
* never below nothing in flight: ``offset ≤ sent − received`` after every report (a written-off
  send that arrived after all; a restarted router meeting an instance that has a history).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Totals:
    """A pair of monotone counters."""

    requests: int = 0
    tokens: int = 0  # prompt tokens

    def minus(self, other: "Totals") -> "Totals":
        return Totals(self.requests - other.requests, self.tokens - other.tokens)


@dataclass
class InflightLedger:
    """Router-side in-flight accounting for one instance."""

    lost_after_s: float = 5.0  # a send not counted by a report this long after it is written off
    sent: Totals = field(default_factory=Totals)  # everything this router sent (total)
    received: Totals = field(default_factory=Totals)  # the instance's reported totals (current incarnation)
    offset: Totals = field(default_factory=Totals)  # sends no report will count (see module docstring)
    incarnation: str | None = None  # the reporting replica's id; None: no report yet
    _sends: deque = field(default_factory=deque)  # (time, sent totals after that send), oldest first

    @property
    def requests(self) -> int:
        """Requests in flight: sent, not yet counted by a report."""
        return max(0, self.sent.requests - self.offset.requests - self.received.requests)

    @property
    def tokens(self) -> int:
        """Prompt tokens in flight."""
        return max(0, self.sent.tokens - self.offset.tokens - self.received.tokens)

    def send(self, requests: int, tokens: int, now: float) -> None:
        self.sent = Totals(self.sent.requests + requests, self.sent.tokens + max(0, tokens))
        self._sends.append((now, self.sent))
        while len(self._sends) > 1 and self._sends[1][0] <= now - self.lost_after_s:
            self._sends.popleft()  # only the newest send past the horizon matters

    def receive(self, requests: int, tokens: int, incarnation: str, now: float) -> None:
        """Take an instance's totals (``now``: the router's clock when the report arrived)."""
        got = Totals(requests, tokens)
        if incarnation == self.incarnation:
            self.received = Totals(max(self.received.requests, requests), max(self.received.tokens, tokens))
        else:
            replaced = self.incarnation is not None
            self.incarnation, self.received = incarnation, got
            if replaced:  # its totals restart: nothing sent to the old replica is coming
                self.offset = self.sent.minus(got)
        old = None
        while self._sends and self._sends[0][0] <= now - self.lost_after_s:
            old = self._sends.popleft()[1]
        if old is not None:  # sent long ago and still not counted: lost
            lost = old.minus(self.offset).minus(self.received)
            self.offset = Totals(self.offset.requests + max(0, lost.requests),
                                 self.offset.tokens + max(0, lost.tokens))
        # never less than nothing in flight: a written-off send that arrived after all, or a router
        # that restarted and meets an instance with a history (its first report)
        ceiling = self.sent.minus(self.received)
        self.offset = Totals(min(self.offset.requests, ceiling.requests), min(self.offset.tokens, ceiling.tokens))
