"""Global routing across XP instances. Installed as ``conflux_cluster.router``. Knows no tensors."""

from .policies import (LowestLoadPolicy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy, RouteRequest, RoutingPolicy,
                       normalized_queued_workload)
from .prefix_aware import PrefixAwarePolicy, PrefixRouting
from .registry import make_policy

__all__ = ["LowestLoadPolicy", "PowerOfTwoPolicy", "PrefixAwarePolicy", "PrefixRouting", "RandomPolicy",
           "RoundRobinPolicy", "RouteRequest", "RoutingPolicy", "make_policy", "normalized_queued_workload"]
