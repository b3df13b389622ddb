"""The per-instance scheduler: requests in, one ``StepPlan`` per iteration out (paper Alg. 1).

A thin coordinator over small parts::

    policies.py   which pending prefill goes first (fcfs / srpt / slo = Moore–Hodgson + EDF + SJF)
    dispatch.py   how many of its tokens fit this step and on which ranks (waterfill, Alg. 2)
    placement.py  where a completing prefill will decode (dual-mode, Alg. 3)
    kv_accounting.py  per-rank KV held (prompt shards while prefilling, decode KV as it grows)

Each step: every resident decode advances (stall-free); then prefills are taken in policy order,
each getting the largest TBT-safe chunk under the current tentative load. A chunk that completes
its prompt needs a decode rank first; when none is feasible the chunk is not scheduled and the
step stops taking prefills (Alg. 1 lines 8-11).

KV on demand and preemption: a decode holds only the blocks its context fills. When a rank's
decodes cannot all grow by one token, the newest request holding KV there (one of its decodes, or
a started prefill) is preempted (recompute, as vLLM does): its KV is freed (``plan.finished``), it
is listed in ``plan.preempted`` so the engine re-sends it with its outputs so far folded into the
prompt, and it waits again (a decode at the head of the queue, with the deadline of its next
token). The oldest request always progresses.

Step stretch (``max_step_stretch`` > 1, beyond the paper): the per-token SLO gives token i a
deadline of TTFT deadline + (i − 1)·τ, so a decode whose first token came early holds slack. A
step's prefill may then take up to SLACK_SHARE of the tightest carried decode's slack beyond the
step in flight, capped at ``max_step_stretch``·τ; B_0 (admission) stays per τ. A step that carries
no decode has no token due: with a fitted profile it may take ``idle_step_stretch``·τ, so a lone long
prompt's chunks do not shrink as its history grows (docs/scheduler.md, "Idle step stretch").

Prefix cache (``enable_prefix_caching``, ``prefix_index.py``): when a prefill starts, a cached
prefix of its prompt is acquired (on the rank placement prefers, or on the rank with the longest
one when that saves ``prefix_pin_tokens`` more); its tokens count as computed (free prefill work
for dispatch, admission and the estimator, which still charges the suffix's attention over them),
and the request must decode on that rank, where the cached blocks live. After its transition
step its full prompt blocks join the cache there.
"""

from __future__ import annotations

import logging
import math
from enum import Enum
from typing import Iterable, Iterator

from ..kv.layout import KVLayout
from ..contracts.step import CacheInsert, DecodeTransition, PrefillSlice, PrefixHit, StepPlan, StepResult
from .config import SchedulerConfig
from .dispatch import FixedLevelDispatcher, StepState, WaterfillDispatcher
from .estimator import BatchLoad, EstimatorProfile, LatencyEstimator, budget_profile, plan_batch_load
from .kv_accounting import KVAccounting
from .load import instance_load
from ..contracts.cluster import InstanceLoad
from .fitting.online import OnlineRefit, profiler_samples
from .deferred import FcfsClock
from .outcomes import AdmissionOutcomes
from .admission import DeadlineUnattainable, EDFQueue, PrefillWork, raw_tokens
from .placement import place_decode
from .prefix_index import PrefixIndex
from .prefix_wait import awaited_prefill
from .waterfill import pour
from .policies import OrderInput, by_priority, get_policy
from .requests import Phase, SchedRequest


log = logging.getLogger(__name__)

STEP_SCALE_EMA = 0.1  # weight of the newest step in Scheduler.step_scale
STEP_SCALE_RANGE = (0.8, 2.0)  # a step's measured / estimated time is clamped to this before averaging
SLACK_SHARE = 0.5  # share of the tightest decode's slack (beyond the step in flight) a stretched step may use


class _Outcome(Enum):
    NEXT = 0  # planned (or skipped); try the next request
    STOP = 1  # step full (no budget, or no decode rank): stop taking prefills


def load_estimator(config: SchedulerConfig, num_ranks: int) -> LatencyEstimator:
    """The latency estimator ``config.estimator_profile`` names for an instance of ``num_ranks`` ranks; a
    ValueError names the field (``conflux serve`` calls this before deploying, as the scheduler does)."""
    if config.estimator_profile in ("budget", "auto"):  # 'auto' unresolved by the caller: built-in budget
        return LatencyEstimator(budget_profile(config.tbt_slo, config.max_num_batched_tokens, num_ranks))
    try:
        profile = EstimatorProfile.from_json(config.estimator_profile)
    except FileNotFoundError:
        raise ValueError(f"estimator_profile: no such file {config.estimator_profile!r} "
                         f"(use 'budget' or run `conflux profile`)") from None
    except OSError as e:
        raise ValueError(f"estimator_profile: cannot read {config.estimator_profile!r}: {e.strerror}") from None
    except ValueError as e:  # names the file and what is wrong (not JSON, not a profile's fields)
        raise ValueError(f"estimator_profile: {e} (expected a profile written by `conflux profile`)") from None
    if profile.num_ranks != num_ranks:
        raise ValueError(f"estimator_profile {config.estimator_profile!r} was fitted for "
                         f"{profile.num_ranks} ranks, the instance has {num_ranks}")
    return LatencyEstimator(profile)


def online_refit(config: SchedulerConfig, profile: EstimatorProfile) -> OnlineRefit:
    """The online refit of ``profile`` (``config.refit_every``), with the profiler's samples where they lie
    beside ``config.estimator_profile`` (``fitting.online.profiler_samples``)."""
    base = []
    if config.estimator_profile not in ("auto", "budget"):
        try:
            base = profiler_samples(config.estimator_profile)
        except (OSError, ValueError) as e:
            log.warning("online refit without the profiler's samples (%s)", e)
    return OnlineRefit(profile, base, config.refit_every, config.refit_window)


class Scheduler:
    """Owns scheduler-side request state and KV reservations; pure Python."""

    def __init__(self, config: SchedulerConfig, layout: KVLayout, blocks_per_rank: int,
                 estimator: LatencyEstimator | None = None) -> None:
        self.config = config
        self.policy = get_policy(config.policy)
        self.layout = layout
        n = layout.num_ranks
        # the prefix cache's index (None: off); KV accounting evicts from it when blocks run out
        self.prefix = PrefixIndex(n, layout.block_size) if config.enable_prefix_caching else None
        self.kv = KVAccounting(layout, blocks_per_rank, prefix=self.prefix)
        self.estimator = estimator or load_estimator(config, n)
        if config.uses_estimator():
            quantum = config.quantum
            if self.estimator.profile.is_budget:  # its level is the token budget itself
                quantum = math.gcd(quantum, config.max_num_batched_tokens)
            self.dispatcher: WaterfillDispatcher | FixedLevelDispatcher = WaterfillDispatcher(
                self.estimator, config.tbt_slo * config.slo_margin, quantum, config.max_level)
        else:
            self.dispatcher = FixedLevelDispatcher(config.max_num_batched_tokens)
        # measured / estimated step time (Scheduler.observe_step); a built-in budget is exact by construction
        self.step_scale = 1.0
        # plan_estimate's cache: plan step -> its estimate, for the latest plan and (pipelined) the one in flight
        self._estimated: dict[int, float] = {}
        self._loads: dict[int, BatchLoad] = {}  # plan_load's, by step (the latest two plans)
        fitted = self.dispatcher.estimates and not self.estimator.profile.is_budget  # attention terms
        self._calibrates = config.calibrate_steps and fitted
        # the profile refitted on served steps, in the background (scheduler/fitting/online.py); None: off or not fitted
        self.refit = online_refit(config, self.estimator.profile) if fitted and config.refit_every else None
        self._idle_stretch = config.idle_step_stretch if fitted else 1.0  # a step without decodes (no token due)
        self._stretches = self.dispatcher.estimates and (config.max_step_stretch > 1 or self._idle_stretch > 1)
        idle = self._refresh_capacity()
        self.last_budget = idle  # B_0 of the latest step
        self.waiting: dict[str, SchedRequest] = {}  # prefill not finished, insertion = arrival order
        self.decoding: dict[str, SchedRequest] = {}
        # the waiting requests by (ttft_deadline, seq), with m_i and d_i; with a fitted profile, m_i in
        # step tokens (admission.PrefillWork: a chunk over a long history fits fewer tokens than B_0)
        self._edf = EDFQueue(PrefillWork.from_profile(self.estimator.profile, idle) if fitted
                             else raw_tokens)
        self._started: set[str] = set()  # prefill begun (KV shards held), not yet transitioned
        self._rank_decodes: list[dict[str, None]] = [{} for _ in range(n)]  # D_r, insertion-ordered
        self._ctx = [0] * n  # Σ_{i∈D_r} c_i
        # admission's meets / misses predictions judged when first tokens come, and the FCFS fallback (slo)
        self.outcomes = (AdmissionOutcomes(config.admission_window, config.admission_fallback_accuracy,
                                           config.admission_window // 2) if self.policy.admission else None)
        self._fcfs_clock = FcfsClock()  # when FCFS would serve each arrival (policy slo: bounds deferred waits)
        self._to_free: list[str] = []  # finished/aborted since the last plan
        self._retained: list[CacheInsert] = []  # finished decodes' blocks cached since the last plan
        self._step = 0
        self._seq = 0
        self.num_preemptions = 0  # decodes preempted so far (KV exhausted on their rank)
        # pipelined engine (EngineCore with async scheduling): the next plan is made before the
        # previous one's tokens are back, so a request that transitions in plan k sits out plan k+1
        # (its first token, its next decode input, is not known yet) and decodes from plan k+2
        self.defer_first_decode = False
        self._fresh: set[str] = set()  # transitioned in the latest plan (only with defer_first_decode)

    # ---- request lifecycle -------------------------------------------------------------
    def add(self, req: SchedRequest, now: float | None = None, reject: bool = False) -> None:
        """Queue ``req``; ValueError if it can never fit, ``DeadlineUnattainable`` (with the config's
        ``reject_unattainable`` or ``reject``: the request asked for it; at ``now``, default its arrival) if
        Moore–Hodgson drops it on arrival. ``reject`` is ignored by policies without admission."""
        if not self.kv.fits_alone(req.max_context, self.config.headroom_blocks):
            limit = self.kv.max_context_alone(self.config.headroom_blocks)
            raise ValueError(
                f"request {req.request_id}: prompt+max_tokens={req.max_context} tokens is more KV than one "
                f"rank can hold for it ({limit} tokens with this pool: the decode rank holds the whole "
                f"context plus, while prefill finishes, its prompt shard); shorten the prompt or max_tokens")
        if req.request_id in self.waiting or req.request_id in self.decoding:
            raise ValueError(f"request {req.request_id} already scheduled")
        req.seq = self._seq
        self._seq += 1
        req.cached = self._probe(req)  # a guess for ordering; fixed when its prefill starts
        self.waiting[req.request_id] = req
        self._edf.add(req)
        if self.config.reject_unattainable or (reject and self.policy.admission):
            self._reject_if_unattainable(req, req.arrival if now is None else now)
        if self.policy.admission:  # (a refused request never queued: FCFS would not have served it)
            self._fcfs_clock.stamp(req, self._edf.work(req), self.last_budget, self.config.tbt_slo,
                                   req.arrival if now is None else now)

    def _reject_if_unattainable(self, req: SchedRequest, now: float) -> None:
        """Paper Alg. 4 at arrival: refuse ``req`` now rather than serve it after its TTFT deadline. Only
        the newcomer can be refused; requests already admitted keep their place (late ones are backfilled)."""
        b0, tau = max(self.last_budget, 1), self.config.tbt_slo
        if not self._edf.rejects(req, b0, now, tau):
            return
        self._edf.remove(req)
        del self.waiting[req.request_id]
        backlog = sum(self._edf.remaining) / (b0 / tau)
        raise DeadlineUnattainable(req.request_id, self.config.ttft_slo, backlog)

    def finish(self, request_id: str, context_hashes: list[int] | None = None) -> None:
        """Request ended (stop, length or abort): its KV is freed by the next plan. ``context_hashes``
        (prefix cache): chained hashes of the full blocks of prompt + outputs whose KV its decode table
        holds; those not cached yet join the cache before the table is freed (``_retain``)."""
        req = self.waiting.pop(request_id, None)
        if req is not None:
            self._edf.remove(req)
            if self.outcomes is not None:
                self.outcomes.forget(request_id)
            self._started.discard(request_id)
        else:
            req = self.decoding.pop(request_id, None)
            if req is None:
                return
            self._rank_decodes[req.decode_rank].pop(request_id)
            self._ctx[req.decode_rank] -= req.context_len
            if self.prefix is not None and context_hashes:
                self._retain(req, context_hashes)
        req.phase = Phase.FINISHED
        self.kv.release(request_id)
        self._to_free.append(request_id)

    def _retain(self, req: SchedRequest, context_hashes: list[int]) -> None:
        """Cache a finished decode's blocks after the ones it already shares with the cache (its
        prompt's), up to the first hash its rank caches already; the ranks do the same with
        ``plan.retained`` before they free its table."""
        rank, start = req.decode_rank, len(self.prefix.held.get(req.request_id, (0, []))[1])
        new = context_hashes[start:]
        n = self.prefix.insert(req.request_id, rank, new) if new else 0
        if n:
            self.kv.to_cache(req.request_id, n)
            self._retained.append(CacheInsert(req.request_id, rank, start, tuple(new[:n])))

    def first_tokens(self, request_ids: Iterable[str], now: float) -> None:
        """The first tokens of ``request_ids`` (a plan's transitions) were produced at ``now``: judge
        admission's predictions on them (``outcomes.py``)."""
        if self.outcomes is not None:
            for rid in request_ids:
                self.outcomes.resolve(rid, now)

    def has_work(self) -> bool:
        return bool(self.waiting or self.decoding or self._to_free)

    def load(self) -> InstanceLoad:
        """Load summary for the global router."""
        return instance_load(self)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens a new arrival would queue behind: with Moore–Hodgson admission (policy slo), those
        of the admitted requests and the overdue deferred ones (the other given-up ones are backfilled after
        every admitted one, a new arrival included: deferred.py), as its latest pass saw them (O(waiting), no admission pass of its own); otherwise
        every waiting request's."""
        gone = self._edf.given_up if self.policy.admission else ()
        return sum(r.remaining_prefill for rid, r in self.waiting.items() if rid not in gone)

    def decode_context_per_rank(self) -> list[int]:
        """Σ_{i∈D_r} c_i of the resident decodes, per rank."""
        return list(self._ctx)

    # ---- one iteration -----------------------------------------------------------------
    def plan_estimate(self, plan: StepPlan, decode_context: list[int]) -> float:
        """The estimator's time for ``plan`` (``decode_context``: Σc_i per rank when it was planned). Once per
        plan: the pipelined engine's launch (when the step in flight ends), the step calibration, the step log
        and the metrics all ask for the same step; plan k is asked again after plan k+1 was launched."""
        est = self._estimated.get(plan.step)
        if est is None:
            est = self._estimated[plan.step] = self.estimator.estimate(self.plan_load(plan, decode_context)).total
            _keep_latest_two(self._estimated, plan.step)
        return est

    def plan_load(self, plan: StepPlan, decode_context: list[int]) -> BatchLoad:
        """``plan``'s BatchLoad (``decode_context`` as in ``plan_estimate``), built once per plan: the estimate,
        the online refit's sample and the step log all read it."""
        load = self._loads.get(plan.step)
        if load is None:
            load = self._loads[plan.step] = plan_batch_load(plan, decode_context, self.layout.num_ranks)
            _keep_latest_two(self._loads, plan.step)
        return load

    def observe_step(self, plan: StepPlan, decode_context: list[int], measured_s: float) -> None:
        """A step ran in ``measured_s`` (wall, as its tokens' gap): calibrate the per-step budget on steps
        that carried prefill and were planned to fill at least half of τ (the ones the budget shapes); with
        ``refit_every``, every step is a sample for the online refit, whose better profile is taken here."""
        if self.refit is not None and measured_s > 0:
            self.refit.observe(self.plan_load(plan, decode_context), measured_s)
            better = self.refit.poll()
            if better is not None:
                self._use_profile(better)
        if not self._calibrates or not plan.prefill or measured_s <= 0:
            return
        estimated = self.plan_estimate(plan, decode_context)
        if estimated < 0.5 * self.config.tbt_slo * self.config.slo_margin:
            return
        ratio = min(max(measured_s / estimated, STEP_SCALE_RANGE[0]), STEP_SCALE_RANGE[1])
        self.step_scale += STEP_SCALE_EMA * (ratio - self.step_scale)
        self.dispatcher.calibrate(self.step_scale)
        self._refresh_capacity()

    def begin_serving(self) -> None:
        """Forget what the warm-up's synthetic requests taught (engine/runtime/warmup.py): admission's judged
        predictions, the step calibration and the online refit's steps. Their first steps pay first-use costs
        (kernel compilation, allocator growth), so their first tokens come late against predictions that were
        right for every later step: kept, they could start serving in the FCFS fallback with the budget shrunk
        and a refit fitted on compile-bound steps."""
        if self.refit is not None:
            self.refit.forget_steps()
        if self.outcomes is not None:
            o = self.outcomes
            self.outcomes = AdmissionOutcomes(self.config.admission_window, o.threshold, o.min_samples)
        if self.step_scale != 1.0:
            self.step_scale = 1.0
            self.dispatcher.calibrate(1.0)
            self._refresh_capacity()

    def close(self) -> None:
        """Stop the online refit's process (an engine that is discarded or shut down); idempotent."""
        if self.refit is not None:
            self.refit.close()

    def _use_profile(self, profile: EstimatorProfile) -> None:
        """Plan with a refitted ``profile``: the waterfill's coefficients, the admission's step-token work of
        every queued request and the router's capacity follow; the step calibration restarts at 1 (the refit
        was fitted on the measured times it corrected)."""
        fit = profile.meta.get("online_refit", {})
        log.info("estimator refitted on %d served steps: MAPE there %.1f %% (was %.1f %%)", fit.get("steps", 0),
                 fit.get("mape_percent", float("nan")), fit.get("previous_mape_percent", float("nan")))
        self.estimator = LatencyEstimator(profile)
        self.dispatcher.use(self.estimator)
        self._estimated.clear()
        self.step_scale = 1.0
        self.dispatcher.calibrate(1.0)
        self._edf.rework(PrefillWork.from_profile(profile, self._refresh_capacity()))

    def _refresh_capacity(self) -> int:
        """B_0 of an idle instance under the current budget, and from it ``prefill_capacity`` (tokens/s on an
        idle instance: what the router normalizes queued work by); returns that B_0."""
        idle = self.dispatcher.reference_budget(StepState.from_decodes([0] * self.layout.num_ranks, 0.0))
        self.prefill_capacity = max(idle, 1) / self.config.tbt_slo
        return idle

    def schedule(self, now: float, starts_at: float | None = None) -> StepPlan:
        """The next step's plan, made at ``now``. ``starts_at``: when that step will start running
        (pipelined: after the step in flight), from which TTFT admission counts the iterations left
        before each deadline; default ``now``."""
        preempted = self._grow_decodes()
        plan = StepPlan(step=self._step, decode=[self._stepping(ids) for ids in self._rank_decodes],
                        finished=self._to_free, preempted=preempted, retained=self._retained)
        self._to_free, self._retained = [], []
        self._fresh = set()
        self._step += 1
        decode_tokens = plan.decode_tokens_per_rank()
        st = StepState.from_decodes(decode_tokens, self.estimator.decode_time(self._ctx, decode_tokens))
        self.last_budget = self.dispatcher.reference_budget(st)
        if self._stretches:
            self.dispatcher.stretch(self._step_stretch(plan, now))
        ctx = list(self._ctx)  # D̃: resident plus reserved-this-step decode context
        for req in self._prefill_order(now if starts_at is None else max(now, starts_at)):
            if self._plan_request(req, st, ctx, plan) is _Outcome.STOP:
                break
        if self.prefix is not None:
            plan.evicted = self.kv.drain_evictions()
        return plan

    def _step_stretch(self, plan: StepPlan, now: float) -> float:
        """How many τ this step's prefill may take (``max_step_stretch``). The token a decode produces
        this step is due at its TTFT deadline + (tokens so far)·τ. Pipelined, it arrives after the step
        still in flight (at most the previous stretch times τ) and this one, so a step may use
        ``SLACK_SHARE`` of the tightest decode's slack beyond the previous step's length."""
        cap = self.config.max_step_stretch
        if not any(plan.decode):  # no decode rides in this step: ``idle_step_stretch``
            return max(cap, self._idle_stretch)
        if cap <= 1.0:  # decodes ride and their stretch is off: no slack to look up
            return 1.0
        tau = self.config.tbt_slo
        slack = min(self.decoding[rid].ttft_deadline + self.decoding[rid].generated * tau - now
                    for ids in plan.decode for rid in ids)
        return min(cap, max(1.0, SLACK_SHARE * (slack - self.dispatcher.step_stretch * tau) / tau))

    def _grow_decodes(self) -> list[str]:
        """Give every resident decode the block its next token needs. Where a rank is out of
        blocks, preempt the newest request holding KV there (its decodes, or a started prefill,
        whose prompt shard sits on every rank) until the rest fit. Returns the preempted ids."""
        kv, preempted, decoding, cover = self.kv, [], self.decoding, self.kv.decode_cover
        for rank, resident in enumerate(self._rank_decodes):
            # only a decode whose next token passes the tokens its blocks hold grows (one in block_size steps);
            # the filter first, so the per-step pass over every resident decode is one lookup each
            ids = self._stepping([rid for rid in resident
                                  if (r := decoding[rid]).computed + r.generated > cover[rid]])
            need = sum(kv.growth(rid, decoding[rid].context_len) for rid in ids)
            while need > kv.free_blocks(rank):
                victims = [self.decoding[i] for i in resident] + [self.waiting[i] for i in self._started]
                if len(victims) <= 1:  # Scheduler.add guarantees one request alone fits a rank
                    raise RuntimeError(f"rank {rank}: KV accounting cannot grow its last decode "
                                       f"(used {kv.used[rank]} of {kv.blocks_per_rank})")
                victim = max(victims, key=lambda r: r.seq)
                if victim.request_id in ids:
                    need -= kv.growth(victim.request_id, victim.context_len)
                    ids.remove(victim.request_id)
                self._preempt(victim)
                preempted.append(victim.request_id)
            for rid in ids:
                kv.grow_decode(rid, self.decoding[rid].context_len)
        return preempted

    def _stepping(self, resident: Iterable[str]) -> list[str]:
        """The resident decodes that produce a token this step: all of them, except (pipelined) one whose
        first token is still in flight to another rank and one that already has every token it may produce
        (its finish is in flight). A first token sampled on the decode rank itself stays there (the rank
        keeps its own samples: engine/runtime/worker.py), so that request decodes in the very next step."""
        if not self.defer_first_decode:
            return list(resident)
        decoding, fresh = self.decoding, self._fresh
        return [rid for rid in resident
                if rid not in fresh and decoding[rid].generated < decoding[rid].max_new_tokens]

    def _preempt(self, req: SchedRequest) -> None:
        """Free ``req``'s KV; it waits again (first in line) to recompute prompt + outputs so far."""
        rid = req.request_id
        self.kv.release(rid)
        self._to_free.append(rid)
        self.num_preemptions += 1
        req.num_preemptions += 1
        req.cached, req.hit_rank = 0, None  # its cached prefix was released with its KV
        if req.phase is Phase.WAITING:  # a started prefill: restart it from scratch
            self._started.discard(rid)
            req.computed = 0
            self._edf.refresh(req)
            return
        del self.decoding[rid]
        self._rank_decodes[req.decode_rank].pop(rid)
        self._ctx[req.decode_rank] -= req.context_len
        # the recompute prompt is the prompt plus every output; its next token keeps its deadline
        req.ttft_deadline += req.generated * self.config.tbt_slo
        req.prompt_len += req.generated
        req.max_new_tokens -= req.generated
        req.computed = req.generated = 0
        req.decode_rank, req.phase = None, Phase.WAITING
        self.waiting = {rid: req, **self.waiting}
        self._edf.add(req)

    def _prefill_order(self, now: float) -> Iterator[SchedRequest]:
        return by_priority(self.policy.order(OrderInput(self.waiting.values(), self._edf, self.last_budget, now,
                                                        self.config.tbt_slo, self.config.deferred_wait(),
                                                        self.outcomes, self.config.deferred_wait_factor,
                                                        self.config.overdue_share, self.config.deferred_first_factor)),
                           self.waiting.values())

    def _plan_request(self, req: SchedRequest, st: StepState, ctx: list[int], plan: StepPlan) -> _Outcome:
        """Alg. 1 lines 6-13 for one request: start (prefix hit, KV check), dispatch, place if
        completing, commit. A fresh request that is not committed gives its prefix hit back."""
        fresh = req.request_id not in self._started
        if fresh and self._awaits_prefix(req):
            return _Outcome.NEXT  # an earlier prefill is computing its prefix: take it from the cache later
        if fresh and not self._begin(req, ctx):
            # FCFS waits for KV in order; the others let a request that fits go ahead.
            return _Outcome.STOP if self.policy.in_order_kv else _Outcome.NEXT
        outcome, committed = self._plan_chunk(req, st, ctx, plan, fresh)
        if fresh and not committed:
            self._unbegin(req)
        return outcome

    def _plan_chunk(self, req: SchedRequest, st: StepState, ctx: list[int], plan: StepPlan,
                    fresh: bool) -> tuple[_Outcome, bool]:
        m, c = req.prompt_len - req.computed, req.computed
        cap = m if req.step_share >= 1.0 else \
            min(m, max(self.dispatcher.quantum, int(req.step_share * self.last_budget)))  # B_0: all ranks
        chunk, give = self.dispatcher.dispatch(st, cap, c)
        if chunk == 0 and not plan.prefill:
            chunk, give = self._progress_chunk(st, m)
        if chunk == 0:
            return _Outcome.STOP, False  # TBT-safe budget exhausted
        if fresh:  # before placing: while its step runs, a rank holds the prompt shard and the decode KV
            self.kv.reserve_prefill(req.request_id, req.prompt_len)
        if chunk == m:
            rank = self._place(req, ctx, len(plan.transitions))
            if rank is None:
                if fresh:
                    self.kv.release_prefill(req.request_id)
                return _Outcome.STOP, False  # no feasible decode host: do not start the transition
            self._transition(req, rank, plan)
            ctx[rank] += req.prompt_len
        if fresh:
            self._started.add(req.request_id)
            self._count_hit(req, plan)
        pos = c
        for rank, count in enumerate(give):
            if count:
                plan.prefill.append(PrefillSlice(req.request_id, rank, pos, pos + count))
                pos += count
        st.commit(give, chunk, c, self.dispatcher.tile)
        return _Outcome.NEXT, True

    def _transition(self, req: SchedRequest, rank: int, plan: StepPlan) -> None:
        """The final chunk runs this step: reserve its decode KV on ``rank`` and, with the prefix
        cache, have its full prompt blocks cached there once the step ran."""
        shared = self._shared_blocks(req)
        self.kv.reserve_decode(req.request_id, rank, req.prompt_len, shared)
        req.decode_rank = rank
        plan.transitions.append(DecodeTransition(req.request_id, rank, shared * self.layout.block_size))
        full = min(len(req.block_hashes), req.prompt_len // self.layout.block_size)
        if self.prefix is not None and full > shared:
            plan.cache_inserts.append(CacheInsert(req.request_id, rank, shared, tuple(req.block_hashes[shared:full])))

    # ---- prefix cache ------------------------------------------------------------------
    def _cacheable(self, req: SchedRequest) -> list[int]:
        """Hashes of the blocks a hit may cover: full prompt blocks, leaving at least one prompt
        token to prefill (its logits give the first output token)."""
        return req.block_hashes[:(req.prompt_len - 1) // self.layout.block_size]

    def _probe(self, req: SchedRequest) -> int:
        """Prompt tokens the cache would serve now (no refs taken)."""
        if self.prefix is None:
            return 0
        return self.prefix.best(self._cacheable(req), req.prefix_memo)[1] * self.layout.block_size

    def _awaits_prefix(self, req: SchedRequest) -> bool:
        """Whether ``req`` waits for a started prefill to cache its prefix (``prefix_wait.py``)."""
        if self.prefix is None or not self.config.prefix_wait_inflight or not self._started:
            return False
        hashes = self._cacheable(req)
        started = (self.waiting[rid] for rid in self._started)
        return awaited_prefill(hashes, self.prefix.best(hashes, req.prefix_memo)[1], started,
                               self.layout.block_size) is not None

    def _shared_blocks(self, req: SchedRequest) -> int:
        """Cached blocks at the front of ``req``'s decode table (its hit)."""
        return req.cached // self.layout.block_size if req.hit_rank is not None else 0

    def _begin(self, req: SchedRequest, ctx: list[int]) -> bool:
        """Whether ``req``'s prefill can start now: with its cached prefix if that leaves room (KV,
        a decode host on the prefix's rank), else from scratch. ``ctx``: D̃ of this step."""
        if self.prefix is not None:
            hashes = self._cacheable(req)
            rank, n = self._choose_hit(req, hashes, ctx)
            if n:
                self.prefix.acquire(req.request_id, rank, hashes[:n])
                self._set_hit(req, rank, n * self.layout.block_size)
                if self._can_start(req):
                    return True
                self._unbegin(req)
        self._set_hit(req, None, 0)
        return self._can_start(req)

    def _choose_hit(self, req: SchedRequest, hashes: list[int], ctx: list[int]) -> tuple[int, int]:
        """(rank, cached blocks) to start ``req`` with. A hit decides the decode rank, so a short
        one (a system prompt cached everywhere soon) must not pile every decode onto one rank:
        the rank dual-mode placement prefers wins, with what it caches, unless the longest hit
        elsewhere saves ``prefix_pin_tokens`` more prompt tokens."""
        matches = [self.prefix.match(r, hashes, req.prefix_memo) for r in range(self.layout.num_ranks)]
        best = max(range(len(matches)), key=lambda r: (matches[r], -r))
        if matches[best] == 0:
            return 0, 0
        kv = self.kv
        free = [kv.free_blocks(r) for r in range(self.layout.num_ranks)]
        preferred = place_decode(self._decode_need(req), free, kv.blocks_per_rank, ctx,
                                 self.config.eta, self.config.headroom_blocks)
        if preferred is not None and (matches[best] - matches[preferred]) * self.layout.block_size \
                < self.config.prefix_pin_tokens:
            return preferred, matches[preferred]
        return best, matches[best]

    def _unbegin(self, req: SchedRequest) -> None:
        """Undo ``_begin`` for a request that did not start after all."""
        if self.prefix is not None:
            self.prefix.release(req.request_id)
        self._set_hit(req, None, 0)
        req.cached = self._probe(req)
        self._edf.refresh(req)

    def _set_hit(self, req: SchedRequest, rank: int | None, tokens: int) -> None:
        req.hit_rank, req.cached, req.computed = rank, tokens, tokens
        self._edf.refresh(req)

    def _count_hit(self, req: SchedRequest, plan: StepPlan) -> None:
        """A prefill started: count the lookup, and tell the ranks about its hit."""
        if self.prefix is None:
            return
        self.prefix.queries += req.prompt_len
        plan.prefix_queries += req.prompt_len
        if req.hit_rank is not None:
            self.prefix.hits += req.cached
            _, hashes = self.prefix.held[req.request_id]
            plan.prefix_hits.append(PrefixHit(req.request_id, req.hit_rank, tuple(hashes), self.layout.block_size))

    def _progress_chunk(self, st: StepState, m: int) -> tuple[int, list[int]]:
        """Liveness: when no chunk of the step's first prefill fits the TBT budget (a long
        history's attention alone can exceed it, or the decodes do), still advance it. The chunk
        is what would fit if its history were free (its attention cost is paid once per step, so
        a larger chunk amortizes it), at least one quantum: one step overruns, none starves."""
        chunk, give = self.dispatcher.dispatch(st, m, 0)
        if chunk:
            return chunk, give
        chunk = min(m, self.config.quantum)
        level = min(st.combined) + chunk  # the least loaded rank alone can take it
        return chunk, pour(st.combined, chunk, level)

    def _place(self, req: SchedRequest, ctx: list[int], reserved_now: int) -> int | None:
        if len(self.decoding) + reserved_now >= self.config.max_num_seqs:
            return None
        kv = self.kv  # its prefill's shards are reserved: the free counts exclude them
        need = self._transition_need(req)
        if req.hit_rank is not None:  # its cached prefix lives there
            fits = kv.free_blocks(req.hit_rank) - need >= self.config.headroom_blocks
            return req.hit_rank if fits else None
        free = [kv.free_blocks(r) for r in range(self.layout.num_ranks)]
        return place_decode(need, free, kv.blocks_per_rank, ctx, self.config.eta, self.config.headroom_blocks)

    def _decode_need(self, req: SchedRequest) -> int:
        """Blocks a decode placement must find free: the prompt plus a growth estimate
        (``decode_reserve_tokens``, capped at the request's own output limit)."""
        grow = min(req.max_new_tokens, self.config.decode_reserve_tokens)
        return self.kv.decode_need(req.prompt_len + max(1, grow)) - self._shared_blocks(req)

    def _transition_need(self, req: SchedRequest) -> int:
        """Blocks ``req``'s transition takes beyond its prefill's: its decode need, less the prompt blocks
        on a rank that hands them over to the decode (``KVAccounting.hands_over``)."""
        need = self._decode_need(req)
        return need - self.kv.prefill_need(req.prompt_len)[0] if self.kv.hands_over else need

    def _can_start(self, req: SchedRequest) -> bool:
        """Start a new prefill only if its KV shards fit AND every started-but-unplaced prefill,
        this one included, could still get a decode rank (first-fit decreasing): a started
        prefill can then always complete, so KV can never deadlock with no decodes to drain it."""
        kv, h = self.kv, self.config.headroom_blocks
        shards = kv.prefill_need(req.prompt_len)
        free = [kv.free_blocks(r) - n for r, n in enumerate(shards)]
        if min(free) < 0:
            return False
        pending = [self.waiting[rid] for rid in self._started if rid not in kv.decode_held] + [req]
        for r in pending:  # a prefix hit decodes where its prefix lives
            if r.hit_rank is not None:
                free[r.hit_rank] -= self._transition_need(r)
                if free[r.hit_rank] < h:
                    return False
        needs = [self._transition_need(r) for r in pending if r.hit_rank is None]
        for need in sorted(needs, reverse=True):
            for r, f in enumerate(free):
                if f - need >= h:
                    free[r] -= need
                    break
            else:
                return False
        return True

    # ---- results -----------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> None:
        """Advance progress after ``plan`` ran: computed prompt tokens, generated tokens, transitions."""
        progressed = {}
        for s in plan.prefill:
            req = self.waiting.get(s.request_id)
            if req is not None and s.end > req.computed:
                req.computed = s.end
                progressed[s.request_id] = req
        for t in plan.transitions:
            req = self.waiting.pop(t.request_id, None)
            if req is None:
                continue  # finished/aborted meanwhile
            req.phase = Phase.DECODING
            progressed.pop(req.request_id, None)
            self._edf.remove(req)
            self._started.discard(req.request_id)
            self.kv.release_prefill(req.request_id)
            self.decoding[req.request_id] = req
            self._rank_decodes[t.decode_rank][req.request_id] = None
            self._ctx[t.decode_rank] += req.context_len
            if self.defer_first_decode and _sampling_rank(plan, req.request_id) != t.decode_rank:
                self._fresh.add(req.request_id)  # its first token reaches the decode rank through the host
        for req in progressed.values():
            self._edf.refresh(req)
        for ins in plan.cache_inserts:
            self._insert(ins)
        if plan.cache_inserts:
            self._reprobe(plan.cache_inserts)
        decoding, ctx = self.decoding, self._ctx
        for rid in result.sampled:
            req = decoding.get(rid)
            if req is not None:
                req.generated += 1
                ctx[req.decode_rank] += 1

    def advance(self, plan: StepPlan) -> None:
        """``update`` before the ranks answered (pipelined engine): every decode of ``plan`` and every
        transition produces exactly one token, whatever its value."""
        sampled = {rid: -1 for ids in plan.decode for rid in ids}
        sampled.update((t.request_id, -1) for t in plan.transitions)
        self.update(plan, StepResult(plan.step, sampled))

    def _insert(self, ins: CacheInsert) -> None:
        """Mirror the ranks: after the step, ``ins``'s blocks joined the cache on its rank."""
        n = self.prefix.insert(ins.request_id, ins.rank, list(ins.hashes))
        if ins.request_id in self.kv.decode_held:
            self.kv.to_cache(ins.request_id, n)
        else:  # finished while the step ran: its blocks were released, the cached ones stay
            self.kv.used[ins.rank] += n
            self.prefix.release(ins.request_id)

    def _reprobe(self, inserts: list[CacheInsert]) -> None:
        """New cached blocks: the waiting requests that share them (a later turn that waited for its
        prefix) now owe less prefill work, which admission and SJF should see before they start."""
        # first block index -> the hashes inserted there; hashes are chained, so one equal hash at a
        # block means the whole prefix up to it is equal
        heads: dict[int, set] = {}
        for i in inserts:
            if i.hashes:
                heads.setdefault(i.first_block, set()).add(i.hashes[0])
        if not heads:
            return
        for req in self.waiting.values():
            if req.request_id in self._started:
                continue
            h = req.block_hashes
            if any(len(h) > fb and h[fb] in hs for fb, hs in heads.items()):
                req.cached = self._probe(req)
                self._edf.refresh(req)

    def check_invariants(self) -> None:
        """Raise AssertionError if internal bookkeeping disagrees with itself (tests, debugging)."""
        for r, ids in enumerate(self._rank_decodes):
            assert all(self.decoding[i].decode_rank == r for i in ids), "decode on wrong rank"
            assert self._ctx[r] == sum(self.decoding[i].context_len for i in ids), "decode context drift"
        assert sum(map(len, self._rank_decodes)) == len(self.decoding)
        assert self._started <= set(self.waiting), "started prefill not waiting"
        assert [r.request_id for r in self._edf.reqs] == sorted(
            self.waiting, key=lambda i: (self.waiting[i].ttft_deadline, self.waiting[i].seq)), "EDF queue drift"
        assert self._edf.remaining == [self._edf.work(r) for r in self._edf.reqs], "EDF m_i drift"
        assert all(0 <= u <= self.kv.blocks_per_rank for u in self.kv.used), f"KV over-committed {self.kv.used}"
        kv = self.kv
        for r in range(self.layout.num_ranks):
            held = sum(n[r] for n in kv.prefill_held.values()) + sum(
                n for rank, n in kv.decode_held.values() if rank == r)
            cached = self.prefix.size(r) if self.prefix else 0
            assert kv.used[r] == held + cached, f"rank {r}: used {kv.used[r]} != held {held} + cached {cached}"
        if self.prefix is not None:
            self.prefix.check_invariants()


def _keep_latest_two(by_step: dict, step: int) -> None:
    """Drop a per-plan cache's entries older than plan ``step - 1`` (pipelined, plan k is asked about again
    after plan k + 1 was launched)."""
    for k in [k for k in by_step if k < step - 1]:
        del by_step[k]


def _sampling_rank(plan: StepPlan, request_id: str) -> int | None:
    """The rank that samples ``request_id``'s first token in ``plan``: the one carrying its final prompt
    slice (None: no slice of it in the plan)."""
    final = max((s for s in plan.prefill if s.request_id == request_id), key=lambda s: s.end, default=None)
    return None if final is None else final.rank
