"""``RayExecutor``: the engine's ``Executor`` over N rank actors, with a measured control plane.

Per iteration the scheduler's ``StepInput`` goes to every rank and every rank's ``StepResult``
comes back; that transport is the control plane. Two kinds:

    compiled_graph  Ray Compiled Graph (``ray.dag``): one compiled fan-out/fan-in, shared-memory
                    channels, no per-call task submission
    actor_calls     ``ray.get([rank.execute.remote(step_input) for rank in ranks])``

``auto`` tries the compiled graph and falls back to actor calls if it cannot be built here. The
control-plane time of one iteration is ``wall − max_r compute_r`` (what the slowest rank did not
spend computing); ``control_s / wall_s`` is its share. ``wall`` runs from the submit (or, pipelined,
from the previous step's result, whichever is later) to this step's result.

Only the compiled graph ``overlaps``: ``submit`` queues a step on the ranks' channels and returns,
so the engine plans the next step while this one runs (each rank executes its steps in channel
order). Over the graph a GPU rank answers each call with the reply of the call before it
(``RankActorImpl.execute_ahead``): it launches step k+1 before it waits for step k's tokens, so its
device does not idle while the rank's host prepares the next step. The reply to the latest call
comes with the next one, or with an empty call when the engine has nothing more to run. A CPU rank
computes inside ``launch``, so it answers each call itself (``execute``): running the next step
first would only hold this one's tokens back. Actor
calls run each step to completion (a rank actor runs probes concurrently with a step, so it cannot
be trusted to keep two steps in order).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.contracts.step import RankReply, RankSetup, StepInput, StepResult, step_device_s
from conflux_cluster.engine.prompt_logprobs import merge_prompt_logprobs
from conflux_cluster.engine.xp.phases import iterations

from .rank_actor import RankActor

if TYPE_CHECKING:
    from ray.dag.compiled_dag_node import CompiledDAG
    from ray.util.placement_group import PlacementGroup

log = logging.getLogger(__name__)

# Longest wait for one iteration's results. A compiled graph's default is 10 s
# (RAY_CGRAPH_get_timeout), which a legitimate step can exceed (a long prompt's chunk on a slow
# device, a CPU shared with other work) and which then breaks the instance. A dead rank is
# detected by the channel closing and by the health check, not by this timeout.
STEP_TIMEOUT_S = 3600.0


@dataclass
class ControlPlaneStats:
    """Cumulative timings of ``execute`` calls."""

    kind: str = "actor_calls"  # the control plane in use
    calls: int = 0
    wall_s: float = 0.0  # total wall time of the steps (module docstring)
    control_s: float = 0.0  # total wall − slowest rank's compute
    compute_s: float = 0.0  # total slowest rank's compute (the ranks' busy time)

    @property
    def share(self) -> float:
        return self.control_s / self.wall_s if self.wall_s > 0 else 0.0


class RayExecutor:
    """N rank actors of one XP instance, in bundles ``bundle_offset..bundle_offset+N-1`` of ``pg``.

    ``config`` is after ``xp_topology``: N = num_ranks x tp_size devices, one actor each (``uniform-tp``
    is one logical rank of TP over every device)."""

    def __init__(self, config: EngineConfig, blocks_per_rank: int | None = None, placement_group: PlacementGroup | None = None,
                 bundle_offset: int = 1, cpus_per_rank: float = 1.0, control_plane: str = "auto",
                 launch_ahead: bool | None = None) -> None:
        """``launch_ahead`` (compiled graph only): ranks launch each step before they read the previous one's
        tokens (module docstring); None: on CUDA ranks."""
        self.config = config
        n = config.num_ranks * config.tp_size  # one actor per device (uniform-tp: 1 logical rank x TP over all)
        gpus = 1 if config.on_cuda else 0
        pg = placement_group if placement_group is not None else ray.util.get_current_placement_group()
        self.ranks = []
        for r in range(n):
            strategy = (PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_offset + r,
                                                         placement_group_capture_child_tasks=True)
                        if pg is not None else None)
            self.ranks.append(RankActor.options(num_cpus=cpus_per_rank, num_gpus=gpus, max_concurrency=2,
                                                scheduling_strategy=strategy).remote(r, n, config.num_threads or 1))
        rdv = None
        if n > 1:
            backend = config.device.collective_backend
            rdv = ray.get(self.ranks[0].host_rendezvous.remote(backend))
        # blocks_per_rank None: each rank sizes its pool after loading weights; they agree on the minimum
        setups: list[RankSetup] = ray.get([a.setup.remote(config, rdv, blocks_per_rank) for a in self.ranks])
        self.node_ids: list[str] = [s.node_id for s in setups]
        if len({s.blocks_per_rank for s in setups}) != 1:
            raise RuntimeError(f"rank actors allocated different KV pools: {[s.blocks_per_rank for s in setups]}")
        self.blocks_per_rank: int = setups[0].blocks_per_rank
        self.setups = setups  # per rank: how long its worker took to build (rebuild timing)
        self.stats = ControlPlaneStats()
        self._dag: CompiledDAG | None = None
        # compiled graph: ranks answer each call with the reply to the one before (execute_ahead)
        self._ahead = config.on_cuda if launch_ahead is None else launch_ahead
        if control_plane in ("auto", "compiled_graph"):
            self._dag = self._compile(required=control_plane == "compiled_graph")
        self.stats.kind = "compiled_graph" if self._dag is not None else "actor_calls"
        self.overlaps = self._dag is not None
        self.launches_ahead = self.overlaps and self._ahead
        self._last_result_at = 0.0  # perf_counter when the latest step's result came back
        self._calls = 0  # compiled graph: calls made (each step's iterations, empty calls)
        self._unread: list = []  # their refs not read yet, oldest first (the call number of the first: _read)
        self._read = 0
        self._replies: dict[int, list[RankReply]] = {}  # call number -> the ranks' replies to it

    def _compile(self, required: bool) -> CompiledDAG | None:
        try:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as inp:
                dag = MultiOutputNode([(a.execute_ahead if self._ahead else a.execute).bind(inp)
                                       for a in self.ranks])
            return dag.experimental_compile()
        except Exception as e:  # noqa: BLE001 - fall back to plain actor calls, say why
            if required:
                raise
            log.warning("Ray Compiled Graph unavailable (%s: %s); using plain actor calls", type(e).__name__, e)
            return None

    def execute(self, step_input: StepInput) -> StepResult:
        """One scheduler step: one iteration on every rank (no-cobatch: a prefill, then a decode one)."""
        return self.submit(step_input).result()

    def submit(self, step_input: StepInput) -> "_Submitted":
        """Queue one scheduler step (compiled graph) or run it (actor calls); ``result()`` gives its tokens."""
        t0 = time.perf_counter()
        its = iterations(step_input, self.config.xp_mode)
        if self._dag is not None:
            refs = [self._call(it) for it in its]  # call numbers
        else:
            refs = [ray.get([a.execute.remote(it) for a in self.ranks]) for it in its]
        return _Submitted(self, step_input.plan.step, refs, t0, queued=self._dag is not None)

    def _call(self, step_input: StepInput | None) -> int:
        """One compiled-graph call (None: an empty one); returns its number."""
        self._unread.append(self._dag.execute(step_input))
        self._calls += 1
        return self._calls - 1

    def _replies_to(self, call: int) -> list[RankReply]:
        """The ranks' replies to ``call``: running ahead they come with the call after it (an empty call if
        none was made), else with the call itself. Refs are read in call order."""
        lag = 1 if self._ahead else 0
        if call + lag >= self._calls:
            self._call(None)
        while call not in self._replies:
            out = ray.get(self._unread.pop(0), timeout=STEP_TIMEOUT_S)
            self._read += 1
            if out[0] is not None:  # the replies to the call ``lag`` calls before the one just read
                self._replies[self._read - 1 - lag] = out
        return self._replies.pop(call)

    def _record(self, submitted_at: float, replies: list[list[RankReply]]) -> float:
        """Add one step to ``stats``; returns its compute time (the slowest rank's, per iteration, summed)."""
        now = time.perf_counter()
        wall = now - max(submitted_at, self._last_result_at)
        self._last_result_at = now
        compute = sum(max(r.compute_s for r in it) for it in replies)
        s = self.stats
        s.calls += len(replies)
        s.wall_s += wall
        s.compute_s += compute
        s.control_s += max(0.0, wall - compute)
        return compute

    def kv_blocks_held(self) -> list[int]:
        """Per rank: physical KV blocks still held (all zero when nothing runs)."""
        return ray.get([a.kv_blocks_held.remote() for a in self.ranks])

    def freeze_heap(self) -> list[int]:
        """Per rank: freeze its process's start-up heap (engine/util/gc_heap.py); objects frozen."""
        return ray.get([a.freeze_heap.remote() for a in self.ranks])

    def abandon(self) -> None:
        """After a rank died: kill every rank actor now (a survivor may be blocked in a collective with the
        dead one, which no cancellation reaches) and tear the compiled graph down in the background (it
        waits for the actors' loops, which the kills end). Their bundles are free for new ranks."""
        ranks, dag = self.ranks, self._dag
        self.ranks, self._dag = [], None
        self._unread, self._replies = [], {}
        for a in ranks:
            ray.kill(a, no_restart=True)
        if dag is not None:
            threading.Thread(target=_teardown, args=(dag,), name="cgraph-teardown", daemon=True).start()

    def shutdown(self) -> None:
        if self._dag is not None:
            try:
                self._dag.teardown()
            except Exception:  # noqa: BLE001 - best effort at exit
                log.debug("compiled graph teardown failed", exc_info=True)
            self._dag = None
        for a in self.ranks:
            ray.kill(a, no_restart=True)
        self.ranks = []


def _teardown(dag: CompiledDAG) -> None:
    try:
        dag.teardown(kill_actors=True)
    except Exception:  # noqa: BLE001 - its actors are dead already
        log.debug("compiled graph teardown after a rank failure", exc_info=True)


class _Submitted:
    """One submitted step (``RayExecutor.submit``): compiled-graph refs, or the replies already in."""

    def __init__(self, executor: RayExecutor, step: int, refs: list, submitted_at: float, queued: bool) -> None:
        self._executor, self._step, self._refs, self._at = executor, step, refs, submitted_at
        self._queued = queued  # refs are compiled-graph call numbers (else: the replies)

    def result(self) -> StepResult:
        replies: list[list[RankReply]] = [self._executor._replies_to(r) if self._queued else r
                                          for r in self._refs]
        compute_s = self._executor._record(self._at, replies)
        launches = [[r.launch_s for r in it if r.launch_s is not None] for it in replies]
        launch_s = sum(max(it) for it in launches if it) if any(launches) else None
        device_s = step_device_s([[r.result for r in it] for it in replies])
        return _merge(self._step, [r.result for it in replies for r in it], compute_s, launch_s, device_s)


def _merge(step: int, results: list[StepResult], compute_s: float | None = None,
           launch_s: float | None = None, device_s: float | None = None) -> StepResult:
    """Each rank reports the tokens it sampled; together they are the step's result."""
    sampled: dict[str, int] = {}
    logprobs: dict[str, float] = {}
    top: dict[str, list] = {}
    for res in results:
        sampled.update(res.sampled)
        logprobs.update(res.logprobs)
        top.update(getattr(res, "top_logprobs", {}) or {})
    prompt = merge_prompt_logprobs([res.prompt_logprobs for res in results])
    return StepResult(step, sampled, logprobs, top, prompt, compute_s, launch_s, device_s)
