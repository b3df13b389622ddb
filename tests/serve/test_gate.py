"""Admission before work (serve/gate.py) over a real ``RouterState``, the router's queue view and its
measured drain rate (router/queue_view.py), and the drain state. Pure Python: no Ray, no HTTP (the
real server's burst and drain are in tests/serve/test_drain.py and benchmarks/burst.py)."""

from __future__ import annotations

import asyncio

from conflux_cluster.engine.contracts.cluster import InstanceLoad
from conflux_cluster.router.queue_view import DrainRate
from conflux_cluster.router.state import RouterState
from conflux_cluster.engine.contracts.cluster import Draining, LoadReport, Overloaded, Routed
from conflux_cluster.serve.gate import AdmissionGate


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _report(received: int, waiting: int, incarnation: str = "a") -> LoadReport:
    load = InstanceLoad(num_waiting=waiting, prefill_capacity=1000.0)
    return LoadReport(0, load, 10 * received, received_requests=received, incarnation=incarnation)


def test_drain_rate_counts_requests_leaving_the_queues_and_restarts_with_a_new_replica():
    rate = DrainRate(window_s=10.0)
    assert rate.rate(0.0) is None
    rate.observe(0, "a", received_requests=10, num_waiting=10, now=0.0)
    rate.observe(0, "a", received_requests=12, num_waiting=8, now=2.0)  # 4 left the queue in 2 s
    assert rate.rate(2.0) == 2.0
    rate.observe(0, "b", received_requests=1, num_waiting=1, now=3.0)  # replaced: totals restart, nothing left
    rate.observe(0, "b", received_requests=3, num_waiting=1, now=4.0)  # 2 more left
    assert rate.rate(4.0) == 6 / 4
    rate.observe(0, "b", received_requests=3, num_waiting=1, now=30.0)  # nothing left in the last 10 s
    assert rate.rate(30.0) is None


def test_queue_view_free_slots_retry_after_from_the_drain_rate_and_draining():
    clock = _Clock()
    st = RouterState(2, max_queued_requests=4, clock=clock)
    view = st.queue_view()
    assert (view.free_slots, view.queued_requests, view.any_healthy, view.draining) == (8, 0, True, False)
    for _ in range(8):
        assert isinstance(st.admit(10), Routed)
    assert st.queue_view().free_slots == 0
    clock.t = 1.0
    st.report(LoadReport(1, InstanceLoad(num_waiting=4, prefill_capacity=1e6), 40, received_requests=4,
                         incarnation="x"))
    st.report(_report(received=4, waiting=4))
    clock.t = 5.0
    st.report(_report(received=4, waiting=0))  # instance 0: 4 left its queue in 4 s: 1 request/s
    view = st.queue_view()
    assert (view.free_slots, view.queued_requests, view.drain_rate_rps) == (4, 4, 1.0)
    assert view.retry_after_s == 4  # 4 queued at 1 request/s
    st.draining = True
    assert st.admit(10) == Draining() and st.queue_view().draining


def test_gate_refuses_past_the_free_slots_before_the_router_is_asked():
    async def scenario() -> None:
        clock = _Clock()
        st = RouterState(1, max_queued_requests=3, clock=clock)

        async def fetch():
            return st.queue_view()

        gate = AdmissionGate(fetch, clock=clock)
        await gate.refresh_now()
        verdicts = [gate.enter(f"r{i}") for i in range(5)]
        assert verdicts[:3] == [None] * 3
        assert [v.info.code for v in verdicts[3:]] == ["server_overloaded"] * 2 and gate.refused == 2
        assert all(v.headers["Retry-After"] == "1" for v in verdicts[3:])
        for i in range(3):  # the three that passed reach the router: routed, counted there from now on
            assert isinstance(st.admit(10), Routed)
            gate.routed(f"r{i}")
        assert gate.enter("r5").info.code == "server_overloaded"  # still full, by the gate's own count
        assert isinstance(st.admit(10), Overloaded)  # and by the router's
        st.report(_report(received=3, waiting=0))  # all three prefilled: room again
        clock.t = 0.1
        await gate.refresh_now()
        assert gate.enter("r6") is None
        gate.leave("r6")  # failed before routing (a 4xx): its slot is free again at once
        assert [gate.enter(f"r{i}") for i in range(7, 10)] == [None] * 3
        assert gate.enter("r10").info.code == "server_overloaded"

    asyncio.run(scenario())


def test_gate_trusts_no_stale_full_view_and_drains_when_told_or_when_the_router_drains():
    async def scenario() -> None:
        clock = _Clock()
        st = RouterState(1, max_queued_requests=1, clock=clock)

        async def fetch():
            return st.queue_view()

        gate = AdmissionGate(fetch, clock=clock, stale_s=1.0)
        await gate.refresh_now()
        st.admit(10)
        await gate.refresh_now()
        assert gate.enter("a").info.code == "server_overloaded"
        clock.t = 5.0  # the view says full, but from 5 s ago: up to the most free slots seen pass
        assert gate.enter("b") is None and gate.enter("c").info.code == "server_overloaded"
        st.draining = True
        await gate.refresh_now()
        refusal = gate.enter("d")
        assert refusal.status == 503 and refusal.info.code == "server_draining"
        assert refusal.headers["Retry-After"] == "1" and gate.is_draining()
        local = AdmissionGate(None)  # no router (an injected backend): refuses only when draining
        assert local.enter("x") is None
        local.draining = True
        assert local.enter("y").info.code == "server_draining"

    asyncio.run(scenario())


def test_gate_a_first_view_taken_before_the_instances_reported_refuses_nothing_once_stale():
    """A health probe right after deploy can make the gate's first view one where no instance has
    reported yet (no free slot, none healthy). Fresh, that view answers 503; stale, it must not: the
    first request after a quiet spell would be refused with nothing queued anywhere."""
    from conflux_cluster.router.queue_view import QueueView

    async def scenario() -> None:
        clock = _Clock()

        async def fetch():
            return QueueView(free_slots=0, queued_requests=0, retry_after_s=1, any_healthy=False)

        gate = AdmissionGate(fetch, clock=clock, stale_s=1.0, refresh_s=0.5)
        await gate.refresh_now()
        assert gate.enter("a").info.code == "no_healthy_instance"
        clock.t = 12.0  # the next arrival, long after: the view is stale
        assert gate.enter("b") is None

    asyncio.run(scenario())


def test_gate_after_a_burst_does_not_count_the_burst_against_a_stale_view():
    """A burst fills the view's free slots and is served; no view arrives in the quiet spell after it
    (views are fetched on arrivals). The next arrivals, judged before the refresh they start completes,
    pass: before the fix they were all refused (255 of 256 behind Ray Serve's HAProxy ingress)."""
    async def scenario() -> None:
        clock = _Clock()
        st = RouterState(1, max_queued_requests=3, clock=clock)

        async def fetch():
            return st.queue_view()

        gate = AdmissionGate(fetch, clock=clock, stale_s=1.0)
        await gate.refresh_now()
        for i in range(3):
            assert gate.enter(f"r{i}") is None
            assert isinstance(st.admit(10), Routed)
            gate.routed(f"r{i}")
            gate.leave(f"r{i}")
            gate.started(f"r{i}")  # its first token: prefilled, out of the queue
        assert gate.enter("r3").info.code == "server_overloaded"  # fresh view: full by the gate's own count
        clock.t = 10.0  # quiet spell: the burst was served, the view is stale
        assert [gate.enter(f"n{i}") for i in range(3)] == [None] * 3  # up to the most free slots seen
        assert gate.enter("n3").info.code == "server_overloaded"  # three in flight at the gate

    asyncio.run(scenario())


def test_gate_bounds_a_burst_by_the_queued_requests_when_the_view_goes_stale():
    """Behind Serve's Python proxy the router answers the gate slowly during a burst and the view goes
    stale. Requests routed but not yet prefilled still hold their queue slots: the gate keeps counting
    them (before the fix it counted only those not yet routed, let the next ones through, and the router
    refused them after they were tokenized). A first token frees the slot."""
    from conflux_cluster.engine.contracts.request import GenerateRequest, SamplingParams
    from conflux_cluster.serve.gate import GatedBackend

    async def scenario() -> None:
        clock = _Clock()
        st = RouterState(1, max_queued_requests=3, clock=clock)
        answering = True

        async def fetch():
            if not answering:  # the router is busy: no view comes in time
                raise TimeoutError
            return st.queue_view()

        tokens: dict[str, asyncio.Queue] = {}

        class Instances:  # routes through the real RouterState; each stream yields what the test puts
            async def generate(self, requests):
                assert isinstance(st.admit(10), Routed)
                q = tokens[requests[0].request_id] = asyncio.Queue()

                async def stream():
                    while (d := await q.get()) is not None:
                        yield d
                return [stream()]

        gate = AdmissionGate(fetch, clock=clock, stale_s=1.0)
        backend = GatedBackend(Instances(), gate)
        await gate.refresh_now()
        answering = False
        streams = {}
        for i in range(3):
            assert gate.enter(f"r{i}") is None
            req = GenerateRequest(request_id=f"r{i}-0", prompt_token_ids=[1] * 10, params=SamplingParams())
            streams[i] = (await backend.generate([req]))[0]
            gate.leave(f"r{i}")  # a stream: the handler has returned its response, the stream goes on
        clock.t = 2.0  # the view is stale now, and no new one comes
        assert gate.enter("x").info.code == "server_overloaded"  # three still queued for prefill
        assert isinstance(st.admit(10), Overloaded)  # as the router would have said, after tokenizing
        tokens["r0-0"].put_nowait("first token")
        assert await anext(streams[0]) == "first token"  # r0 prefilled: its slot is free
        assert gate.enter("y") is None and gate.enter("z").info.code == "server_overloaded"
        tokens["r1-0"].put_nowait(None)
        assert [d async for d in streams[1]] == []  # ended without a token (aborted): not queued either
        del streams[2]  # dropped unread: its slot is given back too
        assert gate.enter("z2") is None and gate.enter("z3") is None
        assert gate.enter("z4").info.code == "server_overloaded"

    asyncio.run(scenario())


class _Method:
    """``handle.method.remote(...)`` of a Serve handle, answered by a local function."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)

        return call()


def test_ingress_gate_has_a_view_before_the_first_burst():
    """A burst as the first traffic after start-up is refused at the gate: the ingress fetches the
    router's view once the instances are ready, so the gate has a bound before any request arrives."""
    from types import SimpleNamespace

    from conflux_cluster.config import ServeConfig
    from conflux_cluster.serve.ingress import OpenAIIngress

    async def scenario() -> None:
        st = RouterState(1, max_queued_requests=3)
        router = SimpleNamespace(queue_view=_Method(st.queue_view))
        instance = SimpleNamespace(max_model_len=_Method(lambda: 2048))
        ing = OpenAIIngress(ServeConfig(model="tiny-llama"), router=router, instances=[instance],
                            backend=SimpleNamespace())
        assert await ing.instances_ready()
        verdicts = [ing.gate.enter(f"r{i}") for i in range(5)]  # no await between: no view arrives meanwhile
        assert verdicts[:3] == [None] * 3
        assert [v.info.code for v in verdicts[3:]] == ["server_overloaded"] * 2

    asyncio.run(scenario())
