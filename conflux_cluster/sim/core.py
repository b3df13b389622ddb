"""Discrete-event core: a heap of typed events, the instance interface, and the run loop.

Time only moves by popping the next event. Events::

    ARRIVAL    a request reaches the router (or the single instance); the next arrival is queued lazily
    STEP_DONE  an iteration of one stream of one instance ends: tokens are emitted at this time
    READY      an instance timer fires (e.g. DistServe's KV transfer to the decode pool ends)

An instance runs one or more *streams* (XP and chunked prefill: one; MuxWise: a prefill and a
decode stream on partitioned SMs; DistServe: one per GPU group). A stream is either busy with
exactly one step or idle; after every event the loop offers each idle stream the chance to start
a step (``start_step`` returns its duration, or None when it has nothing to do).
"""

from __future__ import annotations

import heapq
import time as wallclock
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from conflux_cluster.engine.contracts.cluster import InstanceLoad
from conflux_cluster.router.policies import RouteRequest, Router
from conflux_cluster.slo import SLO

from .metrics import RequestRecord
from .prefix import router_hashes
from .workloads import SimRequest, Workload


class EventKind(str, Enum):
    ARRIVAL = "arrival"
    STEP_DONE = "step_done"
    READY = "ready"


@dataclass(order=True, frozen=True)
class Event:
    time: float  # simulated seconds
    seq: int  # tie-break: insertion order (deterministic)
    kind: EventKind = field(compare=False)
    instance: int = field(compare=False, default=-1)  # target instance (-1: the router)
    stream: str = field(compare=False, default="")  # STEP_DONE: which stream finished
    payload: object = field(compare=False, default=None)  # step plan, request, ... (instance-specific)


class EventQueue:
    def __init__(self) -> None:
        self._heap: list[Event] = []
        self._seq = 0

    def push(self, time: float, kind: EventKind, instance: int = -1, stream: str = "", payload: object = None) -> None:
        heapq.heappush(self._heap, Event(time, self._seq, kind, instance, stream, payload))
        self._seq += 1

    def pop(self) -> Event:
        return heapq.heappop(self._heap)

    def __len__(self) -> int:
        return len(self._heap)


class Recorder:
    """Token emission times per request, shared by all instances of a run."""

    def __init__(self) -> None:
        self.records: dict[str, RequestRecord] = {}

    def arrive(self, req: SimRequest) -> None:
        self.records[req.request_id] = RequestRecord(req.request_id, req.arrival, req.prompt_len, req.output_len)

    def emit(self, request_id: str, now: float) -> bool:
        """Record one output token; True when the request has produced all its tokens."""
        rec = self.records[request_id]
        rec.token_times.append(now)
        return rec.finished


class SimInstance(ABC):
    """One serving instance (a group of GPUs) in the simulation."""

    streams: tuple[str, ...] = ("main",)

    def __init__(self, recorder: Recorder) -> None:
        self.rec = recorder
        self.busy: dict[str, bool] = {s: False for s in self.streams}
        self.timers: list[tuple[float, object]] = []  # (time, payload) → READY events, drained by the loop

    @abstractmethod
    def admit(self, req: SimRequest, now: float) -> None:
        """A request is routed here."""

    @abstractmethod
    def start_step(self, stream: str, now: float) -> tuple[float, object] | None:
        """Plan the next step of an idle stream: (duration s, payload) or None when idle."""

    @abstractmethod
    def finish_step(self, stream: str, payload: object, now: float) -> None:
        """The step started with ``payload`` ends at ``now``: emit tokens, advance state."""

    def on_ready(self, payload: object, now: float) -> None:
        raise RuntimeError(f"{type(self).__name__} set a timer but does not handle READY")

    @abstractmethod
    def load(self) -> InstanceLoad:
        """Load report for the global router."""


@dataclass
class RunResult:
    records: list[RequestRecord]
    sim_time: float  # simulated seconds at the end
    events: int
    stopped_early: bool  # stopped once attainment could no longer reach the target
    router_decisions: int = 0
    router_seconds: float = 0.0  # wall time spent in router.choose (the policy's decision only)
    wall_seconds: float = 0.0


class Simulation:
    """Runs a workload through ``instances`` (behind ``router`` when there are several)."""

    def __init__(self, factory: Callable[[Recorder], SimInstance], workload: Workload, slo: SLO,
                 num_instances: int = 1, router: Router | None = None) -> None:
        if num_instances > 1 and router is None:
            raise ValueError("several instances need a router policy")
        self.rec = Recorder()
        self.instances = [factory(self.rec) for _ in range(num_instances)]
        self.workload, self.slo, self.router = workload, slo, router
        self.q = EventQueue()

    def run(self, stop_below: float | None = None, horizon: float = 300.0, check_every: int = 64) -> RunResult:
        """Simulate until every request finished, or ``horizon`` s after the last arrival, or (when
        ``stop_below`` is given) as soon as attainment is certain to fall below it."""
        t0 = wallclock.perf_counter()
        reqs = self.workload.requests
        if not reqs:
            return RunResult([], 0.0, 0, False)
        end = reqs[-1].arrival + horizon
        self.q.push(reqs[0].arrival, EventKind.ARRIVAL, payload=0)
        events, stopped, now = 0, False, 0.0
        rsec, rdec = 0.0, 0
        violated: set[str] = set()
        while self.q:
            ev = self.q.pop()
            now = ev.time
            if now > end:
                break
            events += 1
            if ev.kind is EventKind.ARRIVAL:
                i = ev.payload
                if i + 1 < len(reqs):
                    self.q.push(reqs[i + 1].arrival, EventKind.ARRIVAL, payload=i + 1)
                idx, dt = self._route(reqs[i])
                if len(self.instances) > 1:
                    rsec, rdec = rsec + dt, rdec + 1
                self.rec.arrive(reqs[i])
                self.instances[idx].admit(reqs[i], now)
                self._kick(idx, now)
            else:
                inst = self.instances[ev.instance]
                if ev.kind is EventKind.STEP_DONE:
                    inst.busy[ev.stream] = False
                    inst.finish_step(ev.stream, ev.payload, now)
                else:
                    inst.on_ready(ev.payload, now)
                self._kick(ev.instance, now)
            if stop_below is not None and events % check_every == 0:
                if self._certainly_below(stop_below, now, violated):
                    stopped = True
                    break
        return RunResult(list(self.rec.records.values()) + self._never_arrived(), now, events, stopped,
                         rdec, rsec, wallclock.perf_counter() - t0)

    def _route(self, req: SimRequest) -> tuple[int, float]:
        if len(self.instances) == 1:
            return 0, 0.0
        loads = [inst.load() for inst in self.instances]  # fresh reports (not timed: instance side)
        request = RouteRequest(req.prompt_len, router_hashes(req.hash_ids))  # hashed by the ingress: not timed
        t = wallclock.perf_counter()
        idx = self.router.choose(loads, request)
        return idx, wallclock.perf_counter() - t

    def _kick(self, idx: int, now: float) -> None:
        inst = self.instances[idx]
        for s in inst.streams:
            if not inst.busy[s]:
                step = inst.start_step(s, now)
                if step is not None:
                    dur, payload = step
                    if dur <= 0:
                        raise RuntimeError(f"{type(inst).__name__}: non-positive step duration {dur}")
                    inst.busy[s] = True
                    self.q.push(now + dur, EventKind.STEP_DONE, idx, s, payload)
        for t, payload in inst.timers:
            self.q.push(t, EventKind.READY, idx, payload=payload)
        inst.timers.clear()

    def _certainly_below(self, target: float, now: float, violated: set[str]) -> bool:
        for rid, r in self.rec.records.items():
            if rid not in violated and r.late(self.slo, now):
                violated.add(rid)
        return len(violated) > (1.0 - target) * len(self.workload.requests) + 1e-9

    def _never_arrived(self) -> list[RequestRecord]:
        seen = self.rec.records
        return [RequestRecord(r.request_id, r.arrival, r.prompt_len, r.output_len)
                for r in self.workload.requests if r.request_id not in seen]
