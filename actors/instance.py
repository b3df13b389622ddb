"""The XP instance: one Ray Serve deployment replica = one scheduler + N rank actors on one node.

The replica's placement group (``STRICT_PACK``, built by ``conflux_cluster.serve.app``) holds a
small bundle for the replica itself and one bundle per rank; the rank actors are created inside it
by the ``RayExecutor`` (one actor per GPU, or per CPU rank), so the whole instance lives on one
node. The scheduler's iteration loop runs as an asyncio task::

    generate(req) ──add──▶ [single engine thread]  EngineCore.add_request / abort / step
         ▲                          │ step(): plan ─▶ all rank actors ─▶ results
         └──── TokenDelta queue ◀───┘ (dispatch on the event loop; text/finish as the engine gave them)

Every call into the ``EngineCore`` runs on one dedicated thread, in submission order, so adds and
aborts land between two iterations and the event loop never blocks on an iteration. A request
whose consumer goes away (client disconnect, cancelled handle call) is aborted: the next step's
plan lists it in ``finished`` and every rank frees its KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Protocol

from conflux_cluster.router.policies import InstanceLoad
from conflux_cluster.router.state import LoadReport

from .streams import GenerateRequest, TokenDelta

log = logging.getLogger(__name__)
REPORT_HEARTBEAT_S = 1.0  # report at least this often, changed or not (the router writes off lost sends on reports)


class EngineCoreLike(Protocol):
    """The part of ``conflux_cluster.engine.core.EngineCore`` the instance drives."""

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any,
                    arrival: float | None = None) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list: ...

    def has_unfinished(self) -> bool: ...

    def load(self) -> InstanceLoad: ...

    max_model_len: int  # longest prompt + output accepted


@dataclass
class _Stream:
    """One request's open delta stream."""

    queue: asyncio.Queue
    done: bool = False


@dataclass
class InstanceStats:
    """Counters for tests and reports (control-plane share = control_s / step_s)."""

    iterations: int = 0  # non-empty steps
    step_s: float = 0.0  # wall time inside EngineCore.step (schedule + execute + update)
    control_s: float = 0.0  # part of it spent moving plans/results between scheduler and ranks
    requests: int = 0  # requests received (total; the router's in-flight accounting)
    aborted: int = 0  # aborted before finishing (disconnect, cancel)
    received_prompt_tokens: int = 0  # prompt tokens received in total (router in-flight accounting)
    executor: dict = field(default_factory=dict)  # executor's own description (control plane kind)

    @property
    def control_share(self) -> float:
        return self.control_s / self.step_s if self.step_s > 0 else 0.0


class XPInstanceServer:
    """The instance's serving logic over an ``EngineCoreLike``; wrapped as a Serve deployment."""

    def __init__(self, index: int, core: EngineCoreLike, router: Any | None = None,
                 report_interval_s: float = 0.02, metrics: Any | None = None,
                 control_seconds: Any | None = None) -> None:
        self.index = index  # the router's index of this instance
        self.core = core
        self._router = router  # router deployment handle (None: nobody to report to)
        self._report_interval_s = report_interval_s
        self._metrics = metrics  # conflux_cluster.metrics.InstanceMetrics or None
        self._control_seconds = control_seconds  # () -> cumulative control-plane seconds
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix=f"xp{index}-engine")
        self._streams: dict[str, _Stream] = {}
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._adds = 0  # count of completed adds/aborts (lost-wakeup guard)
        self._adding_requests = 0  # received, not yet added to the engine (queued on its thread)
        self._adding_tokens = 0  # their prompt tokens
        self._incarnation = uuid.uuid4().hex  # this replica in load reports: a replacement restarts the totals
        self._load = core.load()
        self.stats = InstanceStats()
        self._metrics_step = -1  # last plan step recorded in metrics
        self._metrics_control_s = 0.0  # cumulative control-plane seconds at that step

    # ---- public API (called through Serve handles) ---------------------------------------------

    async def generate(self, req: GenerateRequest, params: Any) -> AsyncIterator[TokenDelta]:
        """Run one request; yield its deltas until it finishes. Cancelling the consumer aborts it."""
        self._ensure_tasks()
        rid = req.request_id
        stream = _Stream(asyncio.Queue())
        self._streams[rid] = stream
        self.stats.requests += 1
        self.stats.received_prompt_tokens += len(req.prompt_token_ids)
        self._adding_requests += 1
        self._adding_tokens += len(req.prompt_token_ids)
        try:
            try:
                await self._on_engine(self._add, rid, req.prompt_token_ids, params, req.arrival)
            except ValueError:  # rejected by the engine (bad params, context): nothing to abort
                stream.done = True
                raise
            finally:
                self._adding_requests -= 1
                self._adding_tokens -= len(req.prompt_token_ids)
            if self._metrics is not None:  # TTFT/E2E from the ingress arrival, as vLLM counts them
                self._metrics.on_request_arrival(rid, len(req.prompt_token_ids), arrival=_monotonic(req.arrival))
            while True:
                delta = await stream.queue.get()
                if delta.finish_reason == "error":
                    raise RuntimeError(f"XP instance {self.index}: the iteration failed; see the replica log")
                yield delta
                if delta.finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not stream.done:  # consumer left early: free its KV on every rank
                stream.done = True
                self.stats.aborted += 1
                self._abort_soon(rid, "abort")

    def load(self) -> InstanceLoad:
        return self._load

    def get_stats(self) -> InstanceStats:
        if self._control_seconds is not None:
            self.stats.control_s = self._control_seconds()
        return self.stats

    def num_open_streams(self) -> int:
        return len(self._streams)

    def max_model_len(self) -> int:
        """The longest prompt + output this instance accepts (the engine's, capped by its KV pool)."""
        return self.core.max_model_len

    async def drain(self, timeout_s: float = 60.0) -> None:
        """Wait until queued aborts reached the ranks and nothing runs (tests, graceful stop)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while await loop.run_in_executor(self._engine_thread, self.core.has_unfinished):
            if loop.time() > deadline:
                raise TimeoutError(f"XP instance {self.index} still busy after {timeout_s}s")
            if self._wake is not None:
                self._wake.set()
            await asyncio.sleep(0.01)

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._engine_thread.shutdown(wait=True, cancel_futures=True)

    # ---- engine thread -------------------------------------------------------------------------

    async def _on_engine(self, fn, *args):
        result = await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)
        self._adds += 1
        self._wake.set()
        return result

    def _add(self, rid: str, prompt: list[int], params: Any, arrival: float | None) -> None:
        """``arrival``: wall-clock time (time.time()) at the ingress; the engine's clock is monotonic."""
        self.core.add_request(rid, prompt, params, arrival=_monotonic(arrival))
        self._load = self.core.load()

    def _abort(self, rid: str) -> None:
        self.core.abort(rid)
        self._load = self.core.load()

    def _abort_soon(self, rid: str, reason: str) -> None:
        """Queue an abort on the engine thread without awaiting (safe inside ``finally``)."""
        if self._metrics is not None:
            self._metrics.on_request_finished(rid, reason)
        self._engine_thread.submit(self._abort, rid)
        self._adds += 1
        if self._wake is not None:
            self._wake.set()  # run a step so the abort's KV frees reach the ranks

    def _step(self) -> tuple[list, bool]:
        t0 = time.perf_counter()
        outputs = self.core.step()
        dt = time.perf_counter() - t0
        if outputs:
            self.stats.iterations += 1
            self.stats.step_s += dt
        self._load = self.core.load()
        if self._metrics is not None:
            self._record_step_metrics(dt)
        return outputs, self.core.has_unfinished()

    def _record_step_metrics(self, dt: float) -> None:
        """Iteration metrics of a step that ran a new plan, and the load gauges (never raises)."""
        try:
            from conflux_cluster.metrics import sample_from_engine

            plan = getattr(self.core, "last_plan", None)
            if plan is not None and plan.step != self._metrics_step:
                self._metrics_step = plan.step
                control = None
                if self._control_seconds is not None:
                    total = self._control_seconds()
                    control, self._metrics_control_s = total - self._metrics_control_s, total
                sample = sample_from_engine(self.core, dt, control)
                if sample is not None:
                    self._metrics.record_iteration(sample)
            self._metrics.record_load(self._load)
        except Exception:  # noqa: BLE001 - metrics must never fail an iteration
            log.warning("XP instance %d: recording step metrics failed", self.index, exc_info=True)

    # ---- loop ----------------------------------------------------------------------------------

    def _ensure_tasks(self) -> None:
        if self._tasks:
            return
        self._wake = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._run(), name=f"xp{self.index}-loop"))
        if self._router is not None:
            self._tasks.append(asyncio.create_task(self._report(), name=f"xp{self.index}-report"))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            adds_before = self._adds
            try:
                outputs, busy = await loop.run_in_executor(self._engine_thread, self._step)
            except Exception:  # a bug or a dead rank: fail every open stream loudly
                log.exception("XP instance %d: iteration failed", self.index)
                self._fail_all("internal error in the XP instance iteration; see the replica log")
                await asyncio.sleep(0.1)
                continue
            now = time.monotonic()
            for out in outputs:
                self._dispatch(out, now)
            if not busy and self._adds == adds_before:
                self._wake.clear()

    def _dispatch(self, out: Any, now: float) -> None:
        """StepOutput -> TokenDelta on the request's queue (the engine already cut stop strings)."""
        s = self._streams.get(out.request_id)
        if s is None or s.done:
            return
        text, finished, reason = out.new_text or "", out.finished, out.finish_reason
        s.done = finished
        if self._metrics is not None:
            self._metrics.on_tokens(out.request_id, len(out.new_token_ids), now)
            if out.finished:
                self._metrics.on_request_finished(out.request_id, reason or "stop", now)
        s.queue.put_nowait(TokenDelta(
            request_id=out.request_id, text=text, token_ids=tuple(out.new_token_ids),
            logprobs=tuple(out.new_logprobs or ()), finished=finished, finish_reason=reason,
            num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
            num_cached_tokens=out.num_cached_tokens))

    def _fail_all(self, message: str) -> None:
        for rid, s in list(self._streams.items()):
            if not s.done:
                s.done = True
                s.queue.put_nowait(TokenDelta(rid, "", (), finished=True, finish_reason="error"))
                self._abort_soon(rid, "error")

    def _reported_load(self) -> InstanceLoad:
        """The engine's load with the requests received but not yet added to it counted as waiting
        (adds queue behind a running step on the engine thread), so received ones are never missed."""
        if not self._adding_requests:
            return self._load
        return replace(self._load, num_waiting=self._load.num_waiting + self._adding_requests,
                       queued_prefill_tokens=self._load.queued_prefill_tokens + self._adding_tokens)

    async def _report(self) -> None:
        """Push the load and received totals to the router whenever they changed (at most every report
        interval), and at least every ``REPORT_HEARTBEAT_S``."""
        last, sent_at = None, 0.0
        while True:
            await asyncio.sleep(self._report_interval_s)
            load = self._reported_load()
            report = (load, self.stats.received_prompt_tokens, self.stats.requests)
            if report == last and time.monotonic() - sent_at < REPORT_HEARTBEAT_S:
                continue
            try:
                await self._router.report.remote(LoadReport(self.index, load, report[1], time.time(),
                                                            received_requests=report[2],
                                                            incarnation=self._incarnation))
                last, sent_at = report, time.monotonic()
            except Exception:  # router restarting: keep serving, retry next tick
                log.warning("XP instance %d: load report failed", self.index, exc_info=True)


def _monotonic(wall: float | None) -> float | None:
    """A ``time.time()`` instant (the ingress's arrival stamp) on this process's monotonic clock."""
    return None if wall is None else time.monotonic() - max(0.0, time.time() - wall)
