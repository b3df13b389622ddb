"""Systems driven by the engine's own scheduler (``conflux_cluster.engine.scheduler.Scheduler``).

The simulator does exactly what the engine core does each iteration: ``schedule(now)`` →
execute the ``StepPlan`` (here: advance the clock by its modelled duration) → ``update(plan,
StepResult)`` → ``finish(id)`` for requests that produced all their tokens. Only the duration
model differs between the systems below.

* ``XPInstance`` — ConfluxServe: N logical ranks (each a TP-b group). Duration from the paper's
  latency estimator (``LatencyEstimator`` over an ``EstimatorProfile``, Eq. 2-12): shared linears
  on the most loaded rank, prefill attention (Ulysses SP over all N ranks, with its all-to-alls)
  overlapped with rank-local decode attention, ``max(β·T_P, α·T_D)``. KV moves of a finishing
  prefill to its decode rank are pipelined with compute (paper §7) and cost nothing here. With
  ``enable_prefix_caching`` the scheduler's prefix cache runs on the trace's ``hash_ids`` (a hit's
  tokens are never planned, so they cost nothing; the scatter of the cached prefix to the
  prefill layout is not modelled). With a separate planning profile (``Setting.plan_profile``:
  the engine's estimator where it is off from the steps' real times) the scheduler plans with that
  one and calibrates its budget on the timed steps, as the engine does (``calibrate_steps``).
* ``ChunkedTPInstance`` — Chunked Prefill (vLLM): the whole instance is ONE TP group (TP = all
  GPUs), prefill chunks and decodes co-batched under a fixed token budget
  (``max_num_batched_tokens``, swept). Linears pay TP all-reduces on every token; attention is a
  mixed kernel, given the same overlap as XP (``max(β·T_P, α·T_D)``: generous to the baseline).
* ``NoCobatchInstance`` — XP with prefill and decode in separate iterations (the engine's ``no-cobatch``).
* ``ChunkedSPInstance`` — Chunked Prefill under uniform Ulysses SP (= XP without phase-specific
  parallelism): decodes are also head-sharded, so every decode token joins the all-to-alls and
  each rank reads 1/N of every decode's KV; no overlap between the attention paths.
"""

from __future__ import annotations

from conflux_cluster.engine.kv.layout import KVLayout
from conflux_cluster.engine.contracts.step import StepPlan, StepResult
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.scheduler.estimator import (BatchLoad, EstimatorProfile, LatencyEstimator,
                                                        plan_batch_load, prefill_attn_work, prefill_kv_tokens)
from conflux_cluster.engine.scheduler.requests import SchedRequest
from conflux_cluster.engine.scheduler.scheduler import Scheduler
from conflux_cluster.engine.contracts.cluster import InstanceLoad

from conflux_cluster.slo import SLO

from ..core import Recorder, SimInstance
from ..costs import ComponentCosts, xp_profile
from ..hardware import kv_tokens_per_group
from ..prefix import engine_block_hashes
from ..step_noise import StepNoise
from ..workloads import SimRequest

BLOCK_SIZE = 16  # KV block size (tokens) of the scheduler's accounting


def make_scheduler(config: SchedulerConfig, layout: KVLayout, blocks_per_rank: int,
                   estimator: LatencyEstimator) -> Scheduler:
    """The engine's Scheduler, planning with ``estimator`` (the same object that times XP steps)."""
    return Scheduler(config, layout, blocks_per_rank, estimator=estimator)


class EngineSchedulerInstance(SimInstance):
    """Base: one instance whose batching decisions are the engine Scheduler's."""

    def __init__(self, recorder: Recorder, costs: ComponentCosts, num_ranks: int, config: SchedulerConfig,
                 slo: SLO, profile: EstimatorProfile | None = None,
                 plan_profile: EstimatorProfile | None = None, pipelined: bool = False,
                 noise: StepNoise | None = None) -> None:
        """``profile`` (and ``costs``) time the steps; the scheduler plans with ``plan_profile`` where one
        is given (an engine whose estimator is off: its step calibration then sees measured / estimated
        times as the engine's does), else with ``profile``. ``pipelined``: as the served engine, a
        request's first decode sits out the step after its transition when its first token was sampled
        on another rank (it is in flight through the host). ``noise``: each step's time is multiplied by
        a served step's measured / modelled ratio of its family (``step_noise.py``)."""
        super().__init__(recorder)
        self.costs, self.slo, self.num_ranks = costs, slo, num_ranks
        m = costs.model
        self.layout = KVLayout.build(BLOCK_SIZE, m.num_q_heads, m.num_kv_heads, num_ranks)
        # a fitted profile for exactly these ranks is used as is; otherwise composed from the components
        self.profile = profile if profile and profile.num_ranks == num_ranks else xp_profile(costs, num_ranks)
        self.estimator = LatencyEstimator(self.profile)
        planning = (LatencyEstimator(plan_profile) if plan_profile and plan_profile.num_ranks == num_ranks
                    else self.estimator)
        self._draw = noise.sampler() if noise is not None else None
        # the step calibration sees each step's time where it differs from the planned estimate
        self._observed: dict[int, tuple[list[int], float]] | None = (
            {} if planning is not self.estimator or noise is not None else None)
        blocks = kv_tokens_per_group(m, costs.hw, costs.tp) // BLOCK_SIZE
        self.sched = make_scheduler(config, self.layout, blocks, planning)
        self.sched.defer_first_decode = pipelined

    def admit(self, req: SimRequest, now: float) -> None:
        hashes = engine_block_hashes(req, BLOCK_SIZE) if self.sched.prefix is not None else []
        self.sched.add(SchedRequest(req.request_id, req.prompt_len, req.output_len, req.arrival,
                                    req.arrival + self.slo.ttft_s, block_hashes=hashes))

    def start_step(self, stream: str, now: float) -> tuple[float, StepPlan] | None:
        if not (self.sched.waiting or self.sched.decoding):
            return None
        plan = self.sched.schedule(now)
        if plan.is_empty() and self.sched.defer_first_decode and self.sched.decoding:
            # every decode sat out a first token in flight: the engine plans again once that step's
            # tokens are back, which here is now (without this a lone request stalled until an arrival)
            plan = self.sched.schedule(now)
        if plan.is_empty():
            return None
        sampled = sum(len(d) for d in plan.decode) + len(plan.transitions)
        load = self.batch_load(plan)
        duration = self.step_time(plan, load) + self.costs.step_overhead(sampled)
        if self._draw is not None:
            duration *= self._draw(load)
        if self._observed is not None:  # the engine's calibration sees the step's whole time
            self._observed[plan.step] = (list(load.decode_context), duration)
        return duration, plan

    def finish_step(self, stream: str, plan: StepPlan, now: float) -> None:
        if self._observed is not None and plan.step in self._observed:
            context, duration = self._observed.pop(plan.step)
            self.sched.observe_step(plan, context, duration)
        sampled = {rid: 0 for ids in plan.decode for rid in ids}
        sampled.update({t.request_id: 0 for t in plan.transitions})
        self.sched.update(plan, StepResult(plan.step, sampled))
        self.sched.first_tokens((t.request_id for t in plan.transitions), now)  # admission's outcomes
        for rid in sampled:
            if self.rec.emit(rid, now):
                self.sched.finish(rid)

    def batch_load(self, plan: StepPlan) -> BatchLoad:
        ctx = self.sched.decode_context_per_rank()  # Σ c_i of the decodes in this plan, per rank
        return plan_batch_load(plan, ctx, plan.num_ranks())

    def step_time(self, plan: StepPlan, load: BatchLoad) -> float:
        raise NotImplementedError

    def load(self) -> InstanceLoad:
        return self.sched.load()  # the engine's own load report (engine/scheduler/load.py)


class XPInstance(EngineSchedulerInstance):
    """ConfluxServe: iteration time = the engine's LatencyEstimator on the step's BatchLoad."""

    def step_time(self, plan: StepPlan, load: BatchLoad) -> float:
        return self.estimator.estimate(load).total


class ChunkedTPInstance(EngineSchedulerInstance):
    """Chunked Prefill, one TP group over all GPUs (``costs.tp`` = GPUs of the instance), 1 rank."""

    def step_time(self, plan: StepPlan, load: BatchLoad) -> float:
        c = self.costs
        n = load.prefill_tokens[0] + load.decode_tokens[0]
        ch = load.prefill_chunks
        t_p = c.prefill_time(prefill_attn_work(ch, c.query_tile), prefill_kv_tokens(ch), len(ch)) if ch else 0.0
        t_d = c.decode_attn(load.decode_context[0]) if load.decode_tokens[0] else 0.0
        mixed = c.cobatch if ch and load.decode_tokens[0] else 0.0
        return c.model.num_layers * (c.gemm(n) + max(c.beta * t_p, c.alpha * t_d) + mixed)


class ChunkedSPInstance(EngineSchedulerInstance):
    """Chunked Prefill under uniform Ulysses SP over N ranks: decodes sharded like prefill. The two
    attention paths run one after the other, each as the estimator times it alone (β·t_p, α·t_d: a
    fitted profile's f_P is only meaningful times its β)."""

    def step_time(self, plan: StepPlan, load: BatchLoad) -> float:
        c, n = self.costs, self.num_ranks
        per_rank = [a + b for a, b in zip(load.prefill_tokens, load.decode_tokens)]
        ch = load.prefill_chunks
        t_p = c.prefill_time(prefill_attn_work(ch, c.query_tile) / n, prefill_kv_tokens(ch) / n, len(ch)) if ch else 0.0
        ndec = sum(load.decode_tokens)
        t_d = c.decode_attn(sum(load.decode_context) / n) if ndec else 0.0
        mixed = c.cobatch if ch and ndec else 0.0
        return c.model.num_layers * (c.gemm(max(per_rank)) + c.a2a(n)(max(per_rank)) + c.beta * t_p + c.alpha * t_d
                                     + mixed)


class NoCobatchInstance(XPInstance):
    """XP without co-batching (``xp_mode no-cobatch``, engine/xp/phases.py): a step with both phases
    runs as a prefill iteration, then a decode iteration; each timed by the same estimator."""

    def step_time(self, plan: StepPlan, load: BatchLoad) -> float:
        if not load.prefill_chunks or not any(load.decode_tokens):
            return self.estimator.estimate(load).total
        zeros = tuple(0 for _ in load.decode_tokens)
        prefill = BatchLoad(load.prefill_tokens, zeros, zeros, load.prefill_chunks)
        decode = BatchLoad(tuple(0 for _ in load.prefill_tokens), load.decode_tokens, load.decode_context, ())
        return self.estimator.estimate(prefill).total + self.estimator.estimate(decode).total
