"""Global routing across XP instances. Installed as ``conflux_cluster.router``. Knows no tensors."""

from .policies import (InstanceLoad, LowestLoadPolicy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy,
                       RoutingPolicy, make_policy, normalized_queued_workload)

__all__ = ["InstanceLoad", "LowestLoadPolicy", "PowerOfTwoPolicy", "RandomPolicy", "RoundRobinPolicy",
           "RoutingPolicy", "make_policy", "normalized_queued_workload"]
