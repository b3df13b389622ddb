"""The XP instance as a Ray Serve deployment replica: builds the engine over rank actors.

The replica sits in bundle 0 of its placement group; its ranks take bundles 1..N (see
``conflux_cluster.serve.app.instance_bundles``). Everything request-related is in
``XPInstanceServer``; this class only assembles the parts, answers introspection calls and is the
``EngineHost`` of failover (``actors/failover.py``): it probes its ranks and rebuilds them in the same
bundles when one dies.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import ray

from conflux_cluster.config import ServeConfig, engine_config
from conflux_cluster.engine.config import Device, xp_topology
from conflux_cluster.engine.contracts.request import PRIORITY_BUCKETS
from conflux_cluster.engine.contracts.step import RankMemory
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.profiling.store import local_hardware_name, resolve_estimator_profile
from conflux_cluster.engine.runtime.warmup import warm_up
from conflux_cluster.engine.scheduler.fitting.step_log import StepLog, instance_path
from conflux_cluster.engine.util.gc_heap import freeze_heap

from .failover import Phase, RankDied
from .instance import XPInstanceServer
from .ray_executor import ControlPlaneStats, RayExecutor

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

log = logging.getLogger(__name__)
startup_log = logging.getLogger("ray.serve")  # the replica's configured logger: lands in its log at INFO

GIL_SWITCH_INTERVAL_S = 0.001  # the replica process's (see XPInstanceDeployment.__init__)
REBUILD_LIMIT_FACTOR = 5  # a rebuild taking longer than this × the first build (+ 60 s): replace the replica


@dataclass(frozen=True)
class Placement:
    """Where an instance's replica and rank actors run (node ids)."""

    replica_node: str
    rank_nodes: list[str]
    rank_pids: list[int]  # process ids of the rank actors (for operators and fault tests)


@dataclass(frozen=True)
class BuildTiming:
    """Where the last (re)build of an instance's engine went, in seconds (``/v1/conflux/stats``
    ``instances[i].last_build``; benchmarks/faults.py reads it after a rank kill)."""

    total_s: float  # ranks down -> the instance serves again (the rebuild; the first build incl. profiling)
    rank_actors_s: float  # new rank actors up and built (processes, process group, the workers below)
    rank_setup_s: float  # the slowest rank's worker build: weights, KV pool, CUDA graphs
    graphs_s: float  # of which the CUDA graph capture (slowest rank; 0 on CPU)
    warmup_s: float  # the engine's warm-up (engine/runtime/warmup.py)

    @property
    def weights_and_kv_s(self) -> float:
        """Loading the weights and allocating the KV pool (the worker build less the graph capture)."""
        return self.rank_setup_s - self.graphs_s


@dataclass(frozen=True)
class InstanceMemory:
    """An instance's processes' memory now."""

    replica_rss_mb: float  # the instance replica (scheduler loop, no model)
    ranks: list[RankMemory]  # each rank actor's RSS and CUDA allocator figures


class XPInstanceDeployment(XPInstanceServer):
    """Serve deployment body for XP instance ``index`` of ``num_ranks`` ranks on ``device``."""

    def __init__(self, index: int, config: ServeConfig, num_ranks: int, device: Device, router: DeploymentHandle) -> None:
        # this replica process runs two busy threads: the engine's (scheduling between GPU steps) and
        # the event loop's (streaming every request's tokens); a 1 ms GIL switch interval (Python's
        # default is 5 ms) bounds how long a finished step waits for the GIL before the next one
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        t0 = time.monotonic()
        self._config, self._source, self._tokenizer = config, None, None
        self._frozen: dict = {}  # gc-frozen objects per process after the last warm-up (freeze_gc)
        self._warmup_s = 0.0  # the last warm-up's seconds
        self._ecfg = xp_topology(engine_config(config, num_ranks, device))  # uniform-tp: 1 logical rank, TP over all
        self._pg = ray.util.get_current_placement_group()  # the ranks' bundles, kept for rebuilds
        self.executor = self._start_ranks()
        ranks_s = time.monotonic() - t0
        # estimator_profile 'auto': a cached/shipped profile, else (CUDA) profile now; the replica holds no GPU
        hardware = "cpu" if not device.has_gpus else ray.get(self.executor.ranks[0].__ray_call__.remote(
            lambda _rank: local_hardware_name(device)))
        profile = resolve_estimator_profile(self._ecfg, self.executor, hardware, logger=startup_log,
                                            rank_kv_blocks_held=self.executor.kv_blocks_held)
        sched = self._ecfg.scheduler.model_copy(update={"estimator_profile": profile})
        self._ecfg = self._ecfg.model_copy(update={"scheduler": sched})  # what a rebuild reuses
        core = self._start_engine(index)
        self._build_s = time.monotonic() - t0  # what a rebuild is expected to take (Retry-After)
        self.last_build = self._timing(self._build_s, ranks_s)
        metrics = None
        try:
            from conflux_cluster.metrics import InstanceMetrics
            from conflux_cluster.slo import SLO

            slo = SLO(ttft_s=config.scheduler.ttft_slo, tbt_s=config.scheduler.tbt_slo)
            metrics = InstanceMetrics(config.model_name, f"xp-{index}", num_ranks, slo=slo, engine=str(index))
        except Exception:  # noqa: BLE001 - metrics are optional; serving is not
            log.warning("XP instance %d: metrics disabled", index, exc_info=True)
        super().__init__(index, core, router, config.load_report_interval_s, metrics,
                         executor_stats=lambda: self.executor.stats, host=self,
                         watch_interval_s=config.rank_watch_interval_s,
                         log_stats_interval_s=config.log_stats_interval_s)
        self.stats.executor = {"control_plane": self.executor.stats.kind, "num_ranks": num_ranks,
                               "device": device}

    # ---- building the engine (at start and after a rank death) ----------------------------------

    def _start_ranks(self) -> RayExecutor:
        return RayExecutor(self._ecfg, None, placement_group=self._pg,  # None: the ranks size their KV pools
                           cpus_per_rank=1.0 if self._ecfg.on_cuda else self._config.cpus_per_rank,
                           control_plane=self._config.control_plane)

    def _start_engine(self, index: int) -> EngineCore:
        """The engine core over ``self.executor``'s ranks, warmed up when configured."""
        if self._source is None:
            self._source = resolve_model(self._ecfg.model)
        cfg = self._ecfg.model_copy(update={"step_log": None})  # the log starts after the warm-up's steps
        core = EngineCore(cfg, self.executor, source=self._source, tokenizer=self._tokenizer)
        self._tokenizer = core.tokenizer  # a rebuild reuses it
        startup_log.info("XP instance %d engine (effective):\n%s\n  control plane  %s", index,
                         self._ecfg.describe(self._source.config, core.blocks_per_rank, core.max_model_len),
                         self.executor.stats.kind)
        if self._config.warmup:  # Serve routes to this replica only after __init__ returns: ready means warmed up
            t0 = time.monotonic()
            warm_up(core, rank_kv_blocks_held=self.executor.kv_blocks_held, logger=startup_log)
            core.scheduler.begin_serving()  # the warm-up's late first tokens judge no admission prediction
            self._warmup_s = time.monotonic() - t0
            self.executor.stats = ControlPlaneStats(kind=self.executor.stats.kind)  # count serving steps only
        if self._config.freeze_gc:  # warmed up: what is alive now stays; full collections skip it
            self._frozen = {"replica": freeze_heap(), "ranks": self.executor.freeze_heap()}
            startup_log.info("XP instance %d: froze the start-up heaps for the garbage collector (objects: "
                             "replica %d, ranks %s)", index, self._frozen["replica"], self._frozen["ranks"])
        if self._ecfg.step_log:
            try:
                core.step_log = StepLog(instance_path(self._ecfg.step_log, index))
            except OSError:  # e.g. not writable on this node: serve without the diagnostics
                startup_log.warning("XP instance %d: cannot write its step log; serving without it", index,
                                    exc_info=True)
        return core

    # ---- EngineHost (actors/failover.py) -------------------------------------------------------

    @property
    def expected_build_s(self) -> float:
        return self._build_s

    async def probe(self) -> None:
        """Every rank answers, or ``RankDied`` (a dead actor answers a call with ``RayActorError`` at once)."""
        try:
            await asyncio.gather(*[a.node_id.remote() for a in self.executor.ranks])
        except ray.exceptions.RayActorError as e:
            raise RankDied(f"XP instance {self.index}: a rank actor died") from e

    def rebuild(self) -> EngineCore:
        """Kill the old ranks (a survivor may be blocked in a collective with the dead one), start new ones in
        the same bundles and build a fresh engine over them (blocking; runs in a worker thread)."""
        t0 = time.monotonic()
        self.executor.abandon()
        self.executor = self._start_ranks()
        t1 = time.monotonic()
        core = self._start_engine(self.index)
        self._build_s = time.monotonic() - t0
        self.last_build = self._timing(self._build_s, t1 - t0)
        startup_log.info("XP instance %d rebuild: %s (weights and KV pool %.1f s)", self.index, self.last_build,
                         self.last_build.weights_and_kv_s)
        startup_log.info("XP instance %d rebuilt in %.1f s: rank actors %.1f s (processes, weights, KV pools, "
                         "control plane), engine and warm-up %.1f s", self.index, self._build_s, t1 - t0,
                         self._build_s - (t1 - t0))
        return core

    def _timing(self, total_s: float, ranks_s: float) -> BuildTiming:
        setups = self.executor.setups
        return BuildTiming(round(total_s, 3), round(ranks_s, 3), round(max(s.setup_s for s in setups), 3),
                           round(max(s.graphs_s for s in setups), 3), round(self._warmup_s, 3))

    # ---- introspection ---------------------------------------------------------------------------

    async def kv_blocks_held(self, drain: bool = True) -> list[int]:
        """Per rank: KV blocks held now; with ``drain``, first wait until queued aborts reached the ranks
        and nothing runs."""
        if drain:
            await self.drain()
        return list(await asyncio.gather(*[a.kv_blocks_held.remote() for a in self.executor.ranks]))

    async def memory(self) -> InstanceMemory:
        """This replica's RSS and each rank's memory now (``benchmarks/faults.py soak``)."""
        import psutil

        ranks = await asyncio.gather(*[a.memory.remote() for a in self.executor.ranks])
        return InstanceMemory(round(psutil.Process().memory_info().rss / 2**20, 1), list(ranks))

    async def check_health(self) -> None:
        """Serve's periodic health check. A dead rank starts the in-place rebuild (if the watcher has not
        already); raising makes Serve replace this replica (a new placement group and new rank actors): that
        happens only when the rebuild failed, takes far longer than the first build, or a rank hangs.
        The first check (right after start) also starts the loops, so the instance reports its load
        to the router before any request: in cluster mode the router routes only to reporting ones."""
        self._ensure_tasks()
        phase = self._failover.stats.phase
        if phase is Phase.BROKEN:
            raise RuntimeError(f"XP instance {self.index}: rebuilding its ranks failed; see the replica log")
        if phase is Phase.REBUILDING:
            if self._failover.rebuilding_for_s() > REBUILD_LIMIT_FACTOR * self._build_s + 60:
                raise RuntimeError(f"XP instance {self.index}: rebuilding its ranks takes too long")
            return
        try:
            await asyncio.wait_for(self.probe(), 60)
        except RankDied:
            self.fail("health check")
        except Exception as e:
            raise RuntimeError(f"XP instance {self.index}: a rank actor is not responding ({e!r})") from e

    async def placement(self) -> Placement:
        pids = await asyncio.gather(*[a.pid.remote() for a in self.executor.ranks])
        return Placement(ray.get_runtime_context().get_node_id(), list(self.executor.node_ids), list(pids))

    def control_plane(self) -> dict:
        s = self.executor.stats
        f = self._failover.stats
        engine = self.core.stats()
        return {"kind": s.kind, "calls": s.calls, "wall_s": s.wall_s, "control_s": s.control_s,
                "share_of_execute": s.share, "step_s": self.stats.step_s,
                "share_of_iteration": s.control_s / self.stats.step_s if self.stats.step_s else 0.0,
                "phase": f.phase.value, "rank_failures": f.failures, "rebuilds": f.rebuilds,
                "last_rebuild_s": f.last_rebuild_s,
                "last_build": {**asdict(self.last_build), "weights_and_kv_s": round(self.last_build.weights_and_kv_s, 3)},
                "step_scale": engine.step_scale,  # measured / estimated step time (calibrate_steps)
                "num_preemptions": engine.num_preemptions,  # requests preempted for KV so far
                "kv_blocks_per_rank": self.executor.blocks_per_rank, "block_size": self._ecfg.block_size,
                # policy slo: admission's predictions judged at first tokens, and the FCFS fallback (outcomes.py)
                "admission": self._admission(),
                # cumulative counts per bucket of conflux_cluster.tally.EDGES_MS: a benchmark's window of them
                # gives the server-side step-time and token-gap quantiles of one rate point
                "step_ms_counts": self.stats.step_tally.snapshot(), "itl_ms_counts": self.stats.itl_tally.snapshot(),
                "requests_by_priority": {b: self.stats.requests_by_priority[b] for b in PRIORITY_BUCKETS
                                         if b in self.stats.requests_by_priority},  # priority_bucket's labels
                "gc_frozen_objects": self._frozen,  # per process, at the last warm-up (ServeConfig.freeze_gc)
                **self._prefix_counters()}

    def _admission(self) -> dict | None:
        outcomes = self.core.scheduler.outcomes
        return None if outcomes is None else asdict(outcomes.stats())

    def _prefix_counters(self) -> dict:
        """vLLM's prefix_cache_queries / prefix_cache_hits so far (prompt tokens; none without the cache)."""
        index = self.core.scheduler.prefix
        return {} if index is None else {"prefix_cache_queries": index.queries, "prefix_cache_hits": index.hits}

    def __del__(self) -> None:
        try:
            self.executor.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
