"""The XP instance: one Ray Serve deployment replica = one scheduler + N rank actors on one node.

The replica's placement group (``STRICT_PACK``, built by ``conflux_cluster.serve.app``) holds a
small bundle for the replica itself and one bundle per rank; the rank actors are created inside it
by the ``RayExecutor`` (one actor per GPU, or per CPU rank), so the whole instance lives on one
node. The iteration loop runs on one dedicated engine thread::

    generate(req) ──add──▶ [single engine thread]  EngineCore.add_request / abort / step
         ▲                          │ step(): plan ─▶ all rank actors ─▶ results
         └──── TokenDelta queue ◀───┘ (posted to the event loop; text/finish as the engine gave them)

Every call into the ``EngineCore`` runs on that thread, in submission order, so adds and aborts
land between two iterations. While there is work, each step queues the next one on the thread
itself: the next iteration starts as soon as the previous one ends, not when the event loop (busy
streaming the previous step's tokens) gets round to it, and the event loop never blocks on an
iteration. A request
whose consumer goes away (client disconnect, cancelled handle call) is aborted: the next step's
plan lists it in ``finished`` and every rank frees its KV.

A rank's death (the iteration fails, or the watcher's probe finds a dead actor) ends every open
stream with ``InstanceUnavailable``, reports the instance unhealthy and rebuilds its engine in place
(``actors/failover.py``). Each engine gets its own thread and epoch: results of a dead engine's
iteration are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, AsyncIterator, Callable, Protocol

from conflux_cluster.engine.contracts.cluster import InstanceLoad, LoadReport
from conflux_cluster.engine.contracts.request import GenerateRequest, priority_bucket
from conflux_cluster.engine.contracts.stream import InstanceUnavailable, TokenDelta, merge_deltas
from conflux_cluster.engine.scheduler.admission import DeadlineUnattainable
from conflux_cluster.tally import Tally

from .failover import EngineHost, Failover, FailoverStats
from .feeds import Feed, FeedTable
from .stats_log import StatsLine, Totals

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from conflux_cluster.engine.contracts.step import StepPlan
    from conflux_cluster.engine.contracts.stream import StepOutput
    from conflux_cluster.engine.core import EngineStats
    from conflux_cluster.metrics import InstanceMetrics

    from .ray_executor import ControlPlaneStats

log = logging.getLogger(__name__)
REPORT_HEARTBEAT_S = 1.0  # report at least this often, changed or not (the router writes off lost sends on reports)
EARLY_ABORT_TTL_S = 300.0  # how long an abort waits for a submit that has not arrived (far beyond any delivery)
EARLY_ABORTS_MAX = 10_000  # and how many such aborts are kept at most (the oldest go first)


class EngineCoreLike(Protocol):
    """The part of ``conflux_cluster.engine.core.EngineCore`` the instance drives."""

    def add_request(self, request: GenerateRequest) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list: ...

    def has_unfinished(self) -> bool: ...

    def load(self) -> InstanceLoad: ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...

    max_model_len: int  # longest prompt + output accepted
    last_plan: StepPlan | None  # latest executed plan (None before the first)


@dataclass
class _Stream:
    """One request's open delta stream."""

    queue: asyncio.Queue | None  # per-request stream (``generate``); None: its deltas go to ``feed``
    done: bool = False
    feed: Feed | None = None  # the ingress feed it was submitted with (``submit``)
    last_delta: float | None = None  # when its previous token delta was emitted (monotonic)


@dataclass
class InstanceStats:
    """Counters for tests and reports (control-plane share = control_s / step_s)."""

    iterations: int = 0  # non-empty steps
    step_s: float = 0.0  # wall time inside EngineCore.step (schedule + execute + update)
    control_s: float = 0.0  # part of it spent moving plans/results between scheduler and ranks
    requests: int = 0  # requests received (total; the router's in-flight accounting)
    aborted: int = 0  # aborted before finishing (disconnect, cancel)
    received_prompt_tokens: int = 0  # prompt tokens received in total (router in-flight accounting)
    output_tokens: int = 0  # tokens delivered to streams
    open_feeds: int = 0  # ingress delta feeds open now (one per ingress replica once it is ready)
    requests_by_priority: dict[str, int] = field(default_factory=dict)  # requests received, per priority_bucket
    executor: dict = field(default_factory=dict)  # executor's own description (control plane kind)
    step_tally: Tally = field(default_factory=Tally)  # wall time of non-empty steps
    itl_tally: Tally = field(default_factory=Tally)  # gaps between a request's token deltas, as emitted here

    @property
    def control_share(self) -> float:
        return self.control_s / self.step_s if self.step_s > 0 else 0.0


class XPInstanceServer:
    """The instance's serving logic over an ``EngineCoreLike``; wrapped as a Serve deployment."""

    def __init__(self, index: int, core: EngineCoreLike, router: DeploymentHandle | None = None,
                 report_interval_s: float = 0.02, metrics: InstanceMetrics | None = None,
                 executor_stats: Callable[[], ControlPlaneStats] | None = None, host: EngineHost | None = None,
                 watch_interval_s: float = 0.5, log_stats_interval_s: float = 0.0) -> None:
        self.index = index  # the router's index of this instance
        self.core = core
        self._router = router  # router deployment handle (None: nobody to report to)
        self._report_interval_s = report_interval_s
        self._metrics = metrics  # conflux_cluster.metrics.InstanceMetrics or None
        # () -> the executor's cumulative ControlPlaneStats (control_s, compute_s, wall_s)
        self._executor_stats = executor_stats
        self._log_stats_interval_s = log_stats_interval_s  # 0: no throughput line in the log
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix=f"xp{index}-engine")
        self._epoch = 0  # engine generation: a rebuild starts a new one (and a new engine thread)
        self._stepping = False  # a step is queued or running on the engine thread (engine thread only)
        self._loop: asyncio.AbstractEventLoop | None = None  # where steps post their outputs
        self._failover = Failover(index, host)
        self._watch_interval_s = watch_interval_s  # how often the ranks are probed (with a host)
        self._streams: dict[str, _Stream] = {}
        # aborts of ids this instance has no stream for, with when they came: an abort that overtook its
        # submit (the client left mid-submit; two handle calls need not arrive in order) ends that submit
        self._early_aborts: dict[str, float] = {}
        self._feeds = FeedTable()  # ingress feeds (actors/feeds.py)
        self._tasks: list[asyncio.Task] = []
        self._adding_requests = 0  # received, not yet added to the engine (queued on its thread)
        self._adding_tokens = 0  # their prompt tokens
        self._incarnation = uuid.uuid4().hex  # this replica in load reports: a replacement restarts the totals
        self._load = core.load()
        self.stats = InstanceStats()
        self._metrics_step = -1  # last plan step recorded in metrics
        self._metrics_control_s = 0.0  # cumulative control-plane seconds at that step

    # ---- public API (called through Serve handles) ---------------------------------------------

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Run one request; yield its deltas until it finishes. Cancelling the consumer aborts it."""
        stream = _Stream(asyncio.Queue())
        await self._add_stream(req, stream)
        try:
            while True:
                delta = await stream.queue.get()
                while not delta.finished and not stream.queue.empty():  # the consumer fell behind: one message
                    delta = merge_deltas(delta, stream.queue.get_nowait())
                if delta.finish_reason == "error":  # a rank died under it (or the iteration failed)
                    raise InstanceUnavailable(delta.retry_after_s or self._failover.retry_after_s(), in_flight=True)
                yield delta
                if delta.finished:
                    return
        finally:
            self._close_stream(req.request_id, stream)

    async def feed(self, feed_id: str) -> AsyncIterator[list[TokenDelta]]:
        """The deltas of every request ``submit``-ted with ``feed_id``, one batch per step (actors/feeds.py).
        Closing it aborts the feed's unfinished requests."""
        self._ensure_tasks()
        feed = self._feeds.get(feed_id)
        try:
            while True:
                yield await feed.next_batch()
        finally:
            for rid in self._feeds.close(feed_id):
                s = self._streams.get(rid)
                if s is not None:
                    self._close_stream(rid, s)

    async def submit(self, req: GenerateRequest, feed_id: str) -> None:
        """Add one request whose deltas go to feed ``feed_id``; returns once the engine took it (what the
        engine refuses raises here, as from ``generate``)."""
        if self._early_aborts.pop(req.request_id, None) is not None:  # its client already left
            self.stats.aborted += 1
            return
        feed = self._feeds.get(feed_id)
        feed.requests.add(req.request_id)
        try:
            await self._add_stream(req, _Stream(None, feed=feed))
        except BaseException:
            feed.requests.discard(req.request_id)
            raise

    async def abort(self, request_id: str) -> None:
        """The ingress gave up on a submitted request (client gone): abort it, free its KV."""
        s = self._streams.get(request_id)
        if s is not None and s.feed is not None:
            s.feed.requests.discard(request_id)
            self._close_stream(request_id, s)
        elif s is None:
            self._remember_early_abort(request_id)

    def _remember_early_abort(self, request_id: str) -> None:
        """Keep ``request_id`` so its submit, if it is still on its way, adds nothing (an abort of a request
        that already finished is kept as well, harmlessly, until it ages out)."""
        now = time.monotonic()
        early = self._early_aborts
        while early and (len(early) >= EARLY_ABORTS_MAX or now - next(iter(early.values())) > EARLY_ABORT_TTL_S):
            del early[next(iter(early))]  # oldest first (insertion order)
        early[request_id] = now

    async def _add_stream(self, req: GenerateRequest, stream: _Stream) -> None:
        """Register ``stream`` and add its request to the engine (raises what the engine refuses)."""
        self._ensure_tasks()
        rid = req.request_id
        self.stats.requests += 1
        by_priority = self.stats.requests_by_priority
        bucket = priority_bucket(req.priority)
        by_priority[bucket] = by_priority.get(bucket, 0) + 1
        self.stats.received_prompt_tokens += len(req.prompt_token_ids)
        if not self._failover.serving:  # routed here before the router saw the failure
            raise InstanceUnavailable(self._failover.retry_after_s(), in_flight=False)
        self._streams[rid] = stream
        self._adding_requests += 1
        self._adding_tokens += len(req.prompt_token_ids)
        epoch = self._epoch
        try:
            await self._on_engine(self._add, req)
        except (ValueError, DeadlineUnattainable):  # refused by the engine (bad request, SLO): nothing to abort
            stream.done = True
            self._forget(rid, stream)
            raise
        except asyncio.CancelledError:
            if epoch == self._epoch:  # the caller went away while the add was queued: abort it
                self._close_stream(rid, stream)
                raise
            stream.done = True  # the add was queued on a discarded engine's thread
            self._forget(rid, stream)
            raise InstanceUnavailable(self._failover.retry_after_s(), in_flight=True) from None
        finally:
            self._adding_requests -= 1
            self._adding_tokens -= len(req.prompt_token_ids)
        if self._metrics is not None:  # TTFT/E2E from the ingress arrival, as vLLM counts them
            self._metrics.on_request_arrival(rid, len(req.prompt_token_ids), arrival=req.monotonic_arrival())

    def _forget(self, rid: str, stream: _Stream) -> None:
        if self._streams.get(rid) is stream:
            del self._streams[rid]

    def _close_stream(self, rid: str, stream: _Stream) -> None:
        """The consumer is done with ``rid``: forget it and, if it had not finished, abort it on every rank."""
        self._forget(rid, stream)
        if not stream.done:
            stream.done = True
            self.stats.aborted += 1
            self._abort_soon(rid, "abort")

    def load(self) -> InstanceLoad:
        return self._load

    def get_stats(self) -> InstanceStats:
        if self._executor_stats is not None:
            self.stats.control_s = self._executor_stats().control_s
        self.stats.open_feeds = len(self._feeds)
        return self.stats

    def failover_stats(self) -> FailoverStats:
        """Phase, failures and rebuild timings."""
        return self._failover.stats

    def num_open_streams(self) -> int:
        return len(self._streams)

    def max_model_len(self) -> int:
        """The longest prompt + output this instance accepts (the engine's, capped by its KV pool)."""
        return self.core.max_model_len

    async def drain(self, timeout_s: float = 60.0) -> None:
        """Wait until queued aborts reached the ranks and nothing runs (tests, graceful stop)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self._loop = loop
        while await self._on_engine(lambda: self.core.has_unfinished()):
            if loop.time() > deadline:
                raise TimeoutError(f"XP instance {self.index} still busy after {timeout_s}s")
            await asyncio.sleep(0.01)

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._engine_thread.shutdown(wait=True, cancel_futures=True)
        self.core.close()

    # ---- engine thread -------------------------------------------------------------------------

    async def _on_engine(self, fn, *args):
        """Run ``fn(*args)`` on the engine thread between two iterations; steps follow if there is work."""
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, self._command, fn, *args)

    def _command(self, fn, *args):  # engine thread
        try:
            return fn(*args)
        finally:
            self._schedule_steps()

    def _schedule_steps(self) -> None:  # engine thread
        if not self._stepping and self._failover.serving:  # while rebuilt, ``_install`` schedules them
            self._stepping = True
            self._submit_step(self.core, self._epoch)

    def _submit_step(self, core: EngineCoreLike, epoch: int) -> None:  # engine thread
        try:
            self._engine_thread.submit(self._step_and_post, core, epoch)
        except RuntimeError:  # shut down, or replaced by a rebuild
            self._stepping = False

    def _step_and_post(self, core: EngineCoreLike, epoch: int) -> None:
        """Engine thread: one iteration, its outputs posted to the event loop, then the next one while
        busy. A discarded engine's iteration (``epoch`` behind) ends here and touches nothing."""
        try:
            outputs, busy = self._step(core, epoch)
        except Exception:  # a dead rank (or a bug): end every open stream, rebuild the engine
            if epoch == self._epoch:
                log.exception("XP instance %d: iteration failed", self.index)
                self._post(self._failed, epoch)
                if self._failover.host is None:
                    time.sleep(0.1)  # no rebuild: the aborts of the failed streams queue the next attempt
                self._stepping = False
            return
        if epoch != self._epoch:
            return
        if outputs:
            self._post(self._deliver, outputs, epoch)
        if busy:
            self._submit_step(core, epoch)
        else:
            self._stepping = False

    def _post(self, fn, *args) -> None:  # engine thread -> event loop
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    def _add(self, req: GenerateRequest) -> None:
        self.core.add_request(req)
        self._load = self.core.load()

    def _abort(self, rid: str) -> None:
        self.core.abort(rid)
        self._load = self.core.load()

    def _abort_soon(self, rid: str, reason: str) -> None:
        """Queue an abort on the engine thread without awaiting (safe inside ``finally``)."""
        if self._metrics is not None:
            self._metrics.on_request_finished(rid, reason)
        try:
            self._engine_thread.submit(self._command, self._abort, rid)  # a step then frees its KV on the ranks
        except RuntimeError:  # shut down
            pass

    def _step(self, core: EngineCoreLike, epoch: int) -> tuple[list, bool]:
        t0 = time.perf_counter()
        outputs = core.step()
        dt = time.perf_counter() - t0
        if epoch != self._epoch:  # this engine was discarded while it stepped
            return [], False
        if outputs:
            self.stats.iterations += 1
            self.stats.step_s += dt
            self.stats.step_tally.add(dt)
        self._load = core.load()
        if self._metrics is not None:
            self._record_step_metrics(dt)
        return outputs, core.has_unfinished()

    def _record_step_metrics(self, dt: float) -> None:
        """Iteration metrics of a step that ran a new plan, and the load gauges (never raises)."""
        try:
            from conflux_cluster.metrics import sample_from_engine

            plan = self.core.last_plan
            if plan is not None and plan.step != self._metrics_step:
                self._metrics_step = plan.step
                control = None
                if self._executor_stats is not None:
                    total = self._executor_stats().control_s
                    since = self._metrics_control_s if total >= self._metrics_control_s else 0.0  # rebuilt
                    control, self._metrics_control_s = total - since, total
                sample = sample_from_engine(self.core, dt, control)
                if sample is not None:
                    self._metrics.record_iteration(sample)
            self._metrics.record_load(self._load)
        except Exception:  # noqa: BLE001 - metrics must never fail an iteration
            log.warning("XP instance %d: recording step metrics failed", self.index, exc_info=True)

    # ---- loop ----------------------------------------------------------------------------------

    def _ensure_tasks(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._tasks:
            return
        if self._router is not None:
            self._tasks.append(asyncio.create_task(self._report(), name=f"xp{self.index}-report"))
        if self._failover.host is not None:
            self._tasks.append(asyncio.create_task(self._failover.watch(self._watch_interval_s, self.fail),
                                                   name=f"xp{self.index}-watch"))
        if self._log_stats_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._log_stats(), name=f"xp{self.index}-stats"))
        if self._metrics is not None:
            self._tasks.append(asyncio.create_task(self._refresh_gauges(), name=f"xp{self.index}-gauges"))

    def _totals(self) -> Totals:
        ex = self._executor_stats() if self._executor_stats is not None else None
        engine = self.core.stats()
        return Totals(self.stats.output_tokens, self.stats.iterations, self.stats.step_s,
                      ex.compute_s if ex else 0.0, ex.control_s if ex else 0.0, ex.wall_s if ex else 0.0,
                      engine.prefix_queries, engine.prefix_hits)

    async def _log_stats(self) -> None:
        line = StatsLine(self.index, self._totals, lambda: self._load,
                         lambda: self.core.stats().step_scale)
        while True:
            await asyncio.sleep(self._log_stats_interval_s)
            try:
                line.tick()
            except Exception:  # noqa: BLE001 - a log line must never stop serving
                log.debug("XP instance %d: stats line failed", self.index, exc_info=True)

    async def _refresh_gauges(self) -> None:
        """Keep the gauges exported while no step sets them (an idle instance; see GAUGE_REFRESH_S)."""
        from conflux_cluster.metrics import GAUGE_REFRESH_S

        while True:
            await asyncio.sleep(GAUGE_REFRESH_S)
            try:
                self._metrics.refresh_gauges()
            except Exception:  # noqa: BLE001 - metrics must never stop serving
                log.debug("XP instance %d: refreshing gauges failed", self.index, exc_info=True)

    def _deliver(self, outputs: list, epoch: int) -> None:  # event loop
        if epoch != self._epoch:  # the engine was replaced after this step
            return
        now = time.monotonic()
        for out in outputs:
            self._dispatch(out, now)
        self._feeds.flush()

    def _failed(self, epoch: int) -> None:  # event loop: an iteration of engine ``epoch`` raised
        if epoch == self._epoch:
            self.fail("iteration")

    def _dispatch(self, out: StepOutput, now: float) -> None:
        """StepOutput -> TokenDelta on the request's queue (the engine already cut stop strings)."""
        s = self._streams.get(out.request_id)
        if s is None or s.done:
            return
        text, finished, reason = out.new_text or "", out.finished, out.finish_reason
        s.done = finished
        self.stats.output_tokens += len(out.new_token_ids)
        if out.new_token_ids:
            if s.last_delta is not None:
                self.stats.itl_tally.add(now - s.last_delta)
            s.last_delta = now
        if self._metrics is not None:
            self._metrics.on_tokens(out.request_id, len(out.new_token_ids), now)
            if out.finished:
                self._metrics.on_request_finished(out.request_id, reason or "stop", now)
        self._emit(s, TokenDelta(
            request_id=out.request_id, text=text, token_ids=tuple(out.new_token_ids),
            logprobs=tuple(out.new_logprobs or ()),
            top_logprobs=tuple(tuple(map(tuple, t)) for t in out.new_top_logprobs or ()),
            finished=finished, finish_reason=reason,
            num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
            num_cached_tokens=out.num_cached_tokens,
            prompt_logprobs=tuple(out.prompt_logprobs) if out.prompt_logprobs is not None else None))

    def _emit(self, s: _Stream, delta: TokenDelta) -> None:
        """To the request's own stream, or (submitted) into its feed's batch for this step."""
        if s.feed is None:
            s.queue.put_nowait(delta)
            return
        self._feeds.add(s.feed, delta)
        if delta.finished and self._streams.get(delta.request_id) is s:
            del self._streams[delta.request_id]

    def fail(self, cause: str) -> None:
        """A rank died or an iteration failed (seen by ``cause``): end every open stream and, with a host,
        stop admitting and rebuild the engine (``actors/failover.py``); without one, keep serving."""
        rebuild = self._failover.begin(cause)
        if rebuild:
            log.error("XP instance %d: rank failure seen by the %s; rebuilding its ranks", self.index, cause)
            self._epoch += 1  # results of the dead engine's iteration in flight are dropped
            stuck, self._engine_thread = self._engine_thread, ThreadPoolExecutor(
                1, thread_name_prefix=f"xp{self.index}-engine")
            self._stepping = False  # the new thread has no step queued
            stuck.shutdown(wait=False, cancel_futures=True)  # its iteration ends once the ranks are killed
        retry = self._failover.retry_after_s()
        for rid, s in list(self._streams.items()):
            if not s.done:
                s.done = True
                self._emit(s, TokenDelta(rid, "", (), finished=True, finish_reason="error", retry_after_s=retry))
                if rebuild and self._metrics is not None:
                    self._metrics.on_request_finished(rid, "error")
                elif not rebuild:
                    self._abort_soon(rid, "error")
        self._feeds.flush()
        if rebuild:
            self._tasks.append(asyncio.create_task(self._failover.rebuild(self._install),
                                                   name=f"xp{self.index}-rebuild"))

    def _install(self, core: EngineCoreLike) -> None:
        """A rebuilt engine takes over (on the event loop, between the old engine's last step and any new one)."""
        self.core.close()  # the dead engine's refit process
        self.core = core
        self._load = core.load()
        try:
            self._engine_thread.submit(self._command, lambda: None)  # steps for what is already queued
        except RuntimeError:  # shut down
            pass

    def _reported_load(self) -> InstanceLoad:
        """The engine's load with the requests received but not yet added to it counted as waiting
        (adds queue behind a running step on the engine thread), so received ones are never missed."""
        if not self._failover.serving:
            return replace(self._load, healthy=False)
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
            report = (load, self.stats.received_prompt_tokens, self.stats.requests, self._failover.retry_after_s())
            if report == last and time.monotonic() - sent_at < REPORT_HEARTBEAT_S:
                continue
            try:
                await self._router.report.remote(LoadReport(self.index, load, report[1], time.time(),
                                                            received_requests=report[2],
                                                            incarnation=self._incarnation,
                                                            available_in_s=0 if load.healthy else report[3]))
                last, sent_at = report, time.monotonic()
            except Exception:  # router restarting: keep serving, retry next tick
                log.warning("XP instance %d: load report failed", self.index, exc_info=True)
