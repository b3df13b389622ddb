"""Routing policies by name (``--routing-policy``): one entry per ``RoutingPolicy``, so adding a policy is
its class and one line here."""

from __future__ import annotations

from typing import Callable

from .policies import LowestLoadPolicy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy, Router, RoutingPolicy
from .prefix_aware import PrefixAwarePolicy, PrefixRouting

_POLICIES: dict[RoutingPolicy, Callable[[int | None, PrefixRouting | None], Router]] = {
    RoutingPolicy.LOWEST_LOAD: lambda seed, prefix: LowestLoadPolicy(),
    RoutingPolicy.ROUND_ROBIN: lambda seed, prefix: RoundRobinPolicy(),
    RoutingPolicy.POWER_OF_TWO: lambda seed, prefix: PowerOfTwoPolicy(seed),
    RoutingPolicy.RANDOM: lambda seed, prefix: RandomPolicy(seed),
    RoutingPolicy.PREFIX_AWARE: lambda seed, prefix: PrefixAwarePolicy(prefix or PrefixRouting()),
}


def make_policy(policy: RoutingPolicy | str, seed: int | None = None, prefix: PrefixRouting | None = None) -> Router:
    """Build a policy by name: ``lowest_load`` | ``round_robin`` | ``power_of_two`` | ``random`` |
    ``prefix_aware`` (configured by ``prefix``, defaults otherwise)."""
    try:
        kind = RoutingPolicy(policy)
    except ValueError:
        names = ", ".join(p.value for p in RoutingPolicy)
        raise ValueError(f"unknown routing policy {policy!r}; choose one of: {names}") from None
    return _POLICIES[kind](seed, prefix)
