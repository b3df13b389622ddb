"""XP instances that follow the nodes of a Ray cluster as they join and leave (cluster mode).

In cluster mode (``address`` set, e.g. under KubeRay) the app is built once, possibly before any GPU
worker is up, but the nodes come and go afterwards. So instance ``i`` is a *slot*: the deployment
``xp-i`` scales between 0 and 1 replica under Serve's autoscaler with ``NodeFollowing`` as its policy,
which asks for the replica exactly while the cluster has room for more than ``i`` instances::

    capacity  = Σ over alive nodes  min over resources r of  floor(node_total[r] / instance_need[r])
    replicas  = 1 if slot < min(capacity, slots) else 0

    nodes joining:  capacity 0 -> 1 -> 2     xp-0 up, then xp-1 up (each a STRICT_PACK placement
    node leaving:   capacity 2 -> 1          group of [replica] + N rank bundles on a node with room)
                    xp-1 scaled to 0; xp-0, if its node left, restarts on the node xp-1 released

The router only routes to instances whose load reports are fresh (``RouterState(stale_after_s)``), so a
slot at 0 replicas, or one whose node just died, gets no requests; with none up the ingress answers
503 + Retry-After. The policy runs in the Serve controller and reads ``ray.nodes()`` at most once a second.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping, Sequence

REFRESH_S = 1.0  # how often the policy re-reads the cluster's nodes


def instance_need(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Resources one instance takes on its node: the sum of its placement-group bundles."""
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + float(v)
    return {k: v for k, v in need.items() if v > 0}


def node_capacity(nodes: Sequence[Mapping[str, Any]], need: Mapping[str, float]) -> int:
    """How many instances the alive ``nodes`` (``ray.nodes()`` entries) can host, one node each at most
    as many as fit its *total* resources (instances already running there count as fitting)."""
    total = 0
    for node in nodes:
        if not node.get("Alive"):
            continue
        res = node.get("Resources") or {}
        total += min((math.floor(res.get(k, 0.0) / v + 1e-9) for k, v in need.items()), default=0)
    return total


class NodeFollowing:
    """Serve autoscaling policy (class form: built once per deployment with ``policy_kwargs``) of slot
    ``slot`` out of ``slots``: one replica while the cluster can host more than ``slot`` instances."""

    def __init__(self, slot: int, slots: int, need: dict[str, float]) -> None:
        self.slot, self.slots, self.need = slot, slots, dict(need)
        self._checked = -math.inf
        self._capacity = 0

    def capacity(self) -> int:
        now = time.monotonic()
        if now - self._checked >= REFRESH_S:
            import ray

            self._capacity = node_capacity(ray.nodes(), self.need)
            self._checked = now
        return self._capacity

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        wanted = 1 if self.slot < min(self.capacity(), self.slots) else 0
        return wanted, {}


def autoscaling_config(slot: int, slots: int, bundles: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """The ``autoscaling_config`` of slot ``slot``'s deployment: 0..1 replica, decided by ``NodeFollowing``
    at once (no up/down-scale delay: the decision follows node events, not load)."""
    return {"min_replicas": 0, "max_replicas": 1, "initial_replicas": 0, "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0, "downscale_to_zero_delay_s": 0.0,
            "policy": {"policy_function": f"{__name__}:NodeFollowing",
                       "policy_kwargs": {"slot": slot, "slots": slots, "need": instance_need(bundles)}}}
