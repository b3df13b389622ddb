"""Global routing policies across XP instances (paper §5, step ①). Pure Python: no tensors, no Ray.

An instance reports an ``InstanceLoad``; a policy picks one instance for the next request::

    policy = make_policy("lowest_load")          # or RoutingPolicy.LOWEST_LOAD
    i = policy.choose([load_0, load_1, ...])      # index into the list, O(K)

``lowest_load`` (the paper's router) sends a request to the instance with the lowest *normalized
queued workload*: prefill work waiting or in flight on the instance, divided by how fast the
instance processes prefill::

    w_i = (queued_prefill_tokens_i + inflight_prefill_tokens_i) / prefill_capacity_i   # seconds

Ties (e.g. all idle) break on KV use, then on resident decode context, then by rotation so that
a burst onto idle instances alternates instead of piling on instance 0. ``round_robin``,
``power_of_two`` (two random candidates, the lower ``w`` wins) and ``random`` are the baselines.
``prefix_aware`` (``prefix_aware.py``) adds the prefill a request's cached prefix would save on
each instance to ``w`` (it reads the request's prefix hashes, ``RouteRequest``).

Stale loads: between two load reports a router must count the work it has itself sent. The
``RouterState`` in ``conflux_cluster.router.state`` does that (``inflight_prefill_tokens``); the
policies here only read the loads they are given. The simulator imports this module directly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Protocol, Sequence

from conflux_cluster.engine.contracts.cluster import InstanceLoad

def normalized_queued_workload(load: InstanceLoad) -> float:
    """w = (queued + in-flight prefill tokens) / prefill capacity: seconds of prefill backlog."""
    return load.queued_work / load.prefill_capacity


class RoutingPolicy(str, Enum):
    LOWEST_LOAD = "lowest_load"  # paper §5 ①: lowest normalized queued workload
    ROUND_ROBIN = "round_robin"
    POWER_OF_TWO = "power_of_two"  # two random candidates, lower normalized workload wins
    RANDOM = "random"
    PREFIX_AWARE = "prefix_aware"  # lowest workload minus the prefill a cached prefix saves (prefix_aware.py)


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about the request it routes."""

    prompt_tokens: int = 0
    prefix_hashes: tuple[int, ...] = ()  # chained hashes of the prompt's full prefix blocks (prefix_aware)


class Router(Protocol):
    """Anything with ``choose(loads, request) -> index``."""

    def choose(self, loads: Sequence[InstanceLoad], request: RouteRequest | None = None) -> int: ...


def healthy_indices(loads: Sequence[InstanceLoad]) -> list[int]:
    if not loads:
        raise ValueError("no instances to route to")
    ok = [i for i, load in enumerate(loads) if load.healthy]
    if not ok:
        raise RuntimeError(f"all {len(loads)} instances are unhealthy")
    return ok


class LowestLoadPolicy:
    """Paper §5 ①. Deterministic; rotating tie-break so equal instances take turns."""

    def __init__(self) -> None:
        self._turn = 0  # rotation offset for tie-breaking

    def choose(self, loads: Sequence[InstanceLoad], request: RouteRequest | None = None) -> int:
        return self.lowest(loads, lambda i: normalized_queued_workload(loads[i]))

    def lowest(self, loads: Sequence[InstanceLoad], cost: Callable[[int], float]) -> int:
        """The healthy instance of least ``cost(i)``; ties on KV use, then resident decode context, then
        by rotation."""
        ok = healthy_indices(loads)
        k = len(loads)
        start = self._turn % k
        self._turn += 1

        def key(i: int) -> tuple[float, float, int, int]:
            load = loads[i]
            return (cost(i), load.kv_utilization, load.decode_context_tokens, (i - start) % k)

        return min(ok, key=key)


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, loads: Sequence[InstanceLoad], request: RouteRequest | None = None) -> int:
        ok = set(healthy_indices(loads))
        k = len(loads)
        for step in range(k):
            i = (self._next + step) % k
            if i in ok:
                self._next = i + 1
                return i
        raise AssertionError("unreachable: _healthy guarantees one instance")


class PowerOfTwoPolicy:
    """Sample two distinct healthy instances; send to the one with lower normalized workload."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, loads: Sequence[InstanceLoad], request: RouteRequest | None = None) -> int:
        ok = healthy_indices(loads)
        if len(ok) == 1:
            return ok[0]
        a, b = self._rng.sample(ok, 2)
        wa, wb = normalized_queued_workload(loads[a]), normalized_queued_workload(loads[b])
        return a if wa <= wb else b


class RandomPolicy:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, loads: Sequence[InstanceLoad], request: RouteRequest | None = None) -> int:
        return self._rng.choice(healthy_indices(loads))
