"""XP instances that follow the nodes of a Ray cluster as they join and leave (cluster mode).

In cluster mode (``address`` set, e.g. under KubeRay) the app is built once, possibly before any GPU
worker is up, but nodes come and go afterwards. So instance ``i`` is a *slot*: the deployment ``xp-i``,
kept at 0 or 1 replica by Serve's autoscaler. A reconcile loop in the router decides which slots run
(it alone sees both the nodes and which instances report), publishes the decision in Ray's GCS key-value
store, and each slot's autoscaling policy (``NodeFollowing``, in the Serve controller) reads it::

    router, every second                                     Serve controller, per slot
    capacity = Σ_alive nodes min_r floor(total_r / need_r)   NodeFollowing(slot): 1 if slot in wanted
    live     = slots with fresh load reports                 else 0
    wanted   = SlotPlanner.plan(capacity, live)   --GCS KV-->

``SlotPlanner`` never takes a running (reporting) instance away; it fills the room left with the
lowest free slots and keeps asking for a started slot until it reports or the room is gone::

    nodes joining:   capacity 0 -> 1 -> 2      wanted {} -> {0} -> {0, 1}
    node 1 leaves:   capacity 2 -> 1           xp-0 (on node 1) stops reporting; wanted {1}: xp-1
                                               keeps serving, xp-0 goes to 0 replicas

The router routes only to instances with fresh reports, and the ingress calls only those, so no
request reaches a slot without a replica (Serve would start one for it: its cold-start path bypasses
the policy). With no instance up, requests get 503 + Retry-After.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

KV_NAMESPACE = "conflux"  # Ray GCS key-value namespace of the published decisions
REFRESH_S = 1.0  # how often the planner re-reads the nodes and a policy re-reads the decision


def wanted_key(app_name: str) -> str:
    """GCS key of the slots application ``app_name`` wants running."""
    return f"{app_name}/wanted_slots"


def instance_need(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Resources one instance takes on its node: the sum of its placement-group bundles."""
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + float(v)
    return {k: v for k, v in need.items() if v > 0}


def node_capacity(nodes: Sequence[Mapping[str, Any]], need: Mapping[str, float]) -> int:
    """How many instances the alive ``nodes`` (``ray.nodes()`` entries) can host: per node as many as fit
    its *total* resources (instances already running there count as fitting)."""
    total = 0
    for node in nodes:
        if not node.get("Alive"):
            continue
        res = node.get("Resources") or {}
        total += min((math.floor(res.get(k, 0.0) / v + 1e-9) for k, v in need.items()), default=0)
    return total


@dataclass
class SlotPlanner:
    """Which of ``slots`` instance slots should have a replica, given the room and the running ones."""

    slots: int
    starting: dict[int, float] = field(default_factory=dict)  # slot -> when it was first asked for

    def plan(self, capacity: int, live: set[int], now: float) -> list[int]:
        """Running slots stay; slots asked for earlier stay while there is room; the rest of the room goes
        to the lowest free slots (asked for from ``now``)."""
        wanted = sorted(s for s in live if 0 <= s < self.slots)
        for s in wanted:
            self.starting.pop(s, None)
        for s in sorted(self.starting):
            if len(wanted) < capacity:
                wanted.append(s)
            else:
                del self.starting[s]  # its room is gone (a node left before it came up)
        for s in range(self.slots):
            if len(wanted) >= capacity:
                break
            if s not in wanted:
                wanted.append(s)
                self.starting[s] = now
        return sorted(wanted)


class Reconciler:
    """The router's loop body: plan the slots of application ``app_name`` from the nodes and the live
    instances, and publish the plan for the slots' autoscaling policies. ``need``: one instance's
    resources (``instance_need`` of its bundles)."""

    def __init__(self, app_name: str, need: Mapping[str, float], slots: int) -> None:
        self.app_name, self.need = app_name, dict(need)
        self.planner = SlotPlanner(slots)
        self.wanted: list[int] = []

    def step(self, nodes: Sequence[Mapping[str, Any]], live: set[int], now: float) -> list[int]:
        self.wanted = self.planner.plan(node_capacity(nodes, self.need), live, now)
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(wanted_key(self.app_name), json.dumps(self.wanted), namespace=KV_NAMESPACE)
        return self.wanted


class NodeFollowing:
    """Serve autoscaling policy of slot ``slot`` (class form, built once per deployment from
    ``policy_kwargs``): one replica while the router's published plan lists the slot."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self._read_at = -math.inf
        self._wanted: list[int] = []

    def wanted(self, app_name: str) -> list[int]:
        now = time.monotonic()
        if now - self._read_at >= REFRESH_S:
            from ray.experimental.internal_kv import _internal_kv_get

            raw = _internal_kv_get(wanted_key(app_name), namespace=KV_NAMESPACE)
            self._wanted = json.loads(raw) if raw else []
            self._read_at = now
        return self._wanted

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict]:
        return (1 if self.slot in self.wanted(ctx.app_name) else 0), {}


def autoscaling_config(slot: int) -> dict[str, Any]:
    """The ``autoscaling_config`` of slot ``slot``'s deployment: 0..1 replica as ``NodeFollowing`` says, at
    once (no up/down-scale delay: the decision follows node events, not load)."""
    return {"min_replicas": 0, "max_replicas": 1, "initial_replicas": 0, "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0, "downscale_to_zero_delay_s": 0.0,
            "policy": {"policy_function": f"{__name__}:NodeFollowing", "policy_kwargs": {"slot": slot}}}
