"""Instance <-> router <-> ingress: what an instance reports (``InstanceLoad`` inside a ``LoadReport``)
and what the router answers for one request (``RouteDecision``: routed, or refused and why)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union


@dataclass(frozen=True)
class InstanceLoad:
    """What one XP instance reports to the router (DESIGN §3: instance -> router)."""

    queued_prefill_tokens: int = 0  # prompt tokens not yet prefilled, over all admitted requests
    inflight_prefill_tokens: int = 0  # prompt tokens routed here but not yet seen in a report
    num_waiting: int = 0  # requests whose prefill is not finished
    num_decoding: int = 0  # requests resident in decode
    decode_context_tokens: int = 0  # Σ c_i over resident decodes (their KV in tokens)
    kv_utilization: float = 0.0  # used / total KV blocks over the instance's ranks, in [0, 1]
    prefill_capacity: float = 1.0  # prefill tokens per second the instance sustains (> 0)
    num_ranks: int = 1  # logical ranks N of the instance
    healthy: bool = True  # False: never route here
    inflight_requests: int = 0  # requests routed here but not yet seen in a report (router-side)

    def __post_init__(self) -> None:
        if self.prefill_capacity <= 0:
            raise ValueError(f"InstanceLoad.prefill_capacity must be > 0, got {self.prefill_capacity}")

    @property
    def queued_work(self) -> int:
        """Queued plus in-flight prefill tokens."""
        return self.queued_prefill_tokens + self.inflight_prefill_tokens

    @property
    def queued_requests(self) -> int:
        """Requests waiting for prefill: reported waiting plus routed-but-unreported (admission bound)."""
        return self.num_waiting + self.inflight_requests

    def with_inflight(self, tokens: int) -> "InstanceLoad":
        """A copy with ``tokens`` of router-side in-flight work added."""
        return replace(self, inflight_prefill_tokens=self.inflight_prefill_tokens + tokens)


@dataclass(frozen=True)
class LoadReport:
    """One instance's report: its load and how much it has received in total (monotone totals)."""

    instance: int  # index of the reporting instance
    load: InstanceLoad  # inflight_* fields are ignored here: the router knows its own
    received_prompt_tokens: int  # prompt tokens the instance has received (total, this incarnation)
    time: float = 0.0  # reporter's wall clock (seconds), for staleness only
    received_requests: int = 0  # requests the instance has received (total, this incarnation)
    incarnation: str = ""  # id of the reporting replica: a new one (replaced replica) restarts the totals
    available_in_s: int = 0  # unhealthy (a rank died, being rebuilt): seconds until it expects to serve again


@dataclass(frozen=True)
class Routed:
    """Admitted: send the request to ``instance``."""

    instance: int


@dataclass(frozen=True)
class Overloaded:
    """Refused: every healthy instance holds ``max_queued_requests`` queued requests (HTTP 503)."""

    retry_after_s: int  # whole seconds the client should wait before retrying (>= 1)
    max_queued_requests: int  # the bound L per instance
    queued_requests: tuple[int, ...]  # queued_i per instance, as the router saw them


@dataclass(frozen=True)
class Unavailable:
    """Refused: no instance is healthy (each lost a rank and is being rebuilt) (HTTP 503)."""

    retry_after_s: int  # the soonest an instance expects to serve again, whole seconds (>= 1)


@dataclass(frozen=True)
class RateLimited:
    """Refused: the client's rate limit is used up (HTTP 429)."""

    retry_after_s: int  # whole seconds until the client may send one more request (>= 1)
    requests_per_minute: float  # the limit


@dataclass(frozen=True)
class Draining:
    """Refused: the server is shutting down and finishes only what it holds (HTTP 503, ``serve/drain.py``)."""

    retry_after_s: int = 1  # another replica behind the load balancer can take it at once


RouteDecision = Union[Routed, Overloaded, Unavailable, RateLimited, Draining]
