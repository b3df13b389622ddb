"""``EngineCore``: one XP instance's iteration loop (scheduler + executor + stop handling).

    add_request ──▶ Scheduler.add ─┐
    step():  plan = Scheduler.schedule(now)
             result = executor.execute(StepInput(plan, new requests, first tokens))
             Scheduler.update(plan, result)
             per sampled token: detokenize, check EOS / stop ids / stop strings / max_tokens
             finished ──▶ Scheduler.finish ──▶ next plan's ``finished`` frees KV on every rank
    abort(id) ─────▶ Scheduler.finish (same path)

Pipelined (``async_scheduling`` over an executor whose ``submit`` returns before the step ran, as
vLLM's async scheduling and SGLang's overlap scheduler do): each ``step()`` makes and submits plan
k+1, then waits for plan k's tokens and processes them, so the ranks find their next step queued
while this process detokenizes, checks stops and streams::

    host:   [plan k+1 | submit] [wait k ......] [tokens k] [plan k+2 | submit] [wait k+1 ...
    ranks:  ... step k ..................][ step k+1 .................................][ step k+2

A plan never needs the previous plan's token values: ranks keep each decode's last sample. What the
host learns late costs little and changes no output: a request that stops in plan k (EOS, a stop
string) has run one more decode in plan k+1, whose token is dropped; a request whose prefill ends
in plan k sits out plan k+1 (its first token is its next input) and decodes from plan k+2; a plan
that preempts (recompute from the outputs so far) first waits for the step in flight, and so does a
plan carrying prefill over a decode-only step where the ranks launch ahead (``_reads_decode_step_first``).

Single-threaded: callers serialise add_request / abort / step (the serving layer runs them on
one engine thread).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace

from .config import EngineConfig
from .contracts.request import GenerateRequest, resolve_max_tokens
from .detokenizer import IncrementalDetokenizer
from .runtime.executor import Executor, PendingStep
from .loader import ModelSource, load_tokenizer, resolve_model
from .contracts.stream import FinishReason, StepOutput
from .contracts.step import NewRequest, StepInput, StepPlan, StepResult
from .kv.prefix_hash import block_hashes, extend_hashes
from .sampling_params import SamplingParams
from .contracts.cluster import InstanceLoad
from .scheduler.requests import SchedRequest
from .scheduler.scheduler import Scheduler
from .scheduler.fitting.step_log import StepLog
from .tokenizer import Tokenizer, out_of_vocab


@dataclass(frozen=True)
class EngineStats:
    """Counters an instance's stats line and metrics read from its engine."""

    prefix_queries: int  # prompt tokens looked up in the prefix cache (0 without one)
    prefix_hits: int  # of those, tokens served from the cache
    step_scale: float  # measured / estimated step time, smoothed (the scheduler's calibration)
    num_preemptions: int  # requests preempted for KV so far


@dataclass
class _Request:
    """The engine's state of one request: the ``GenerateRequest`` the handler built (its prompt copied), and what its
    steps have produced."""

    request: GenerateRequest
    max_tokens: int  # the output budget, resolved against the context
    detok: IncrementalDetokenizer
    seed: int
    output_ids: list[int] = field(default_factory=list)
    scheduled_at: float | None = None  # monotonic time a plan first gave it prefill tokens (vLLM's scheduled_ts)
    num_cached: int = 0  # prompt tokens its (latest) prefill took from the prefix cache
    prompt_scores: dict = field(default_factory=dict)  # position -> PromptLogprob, as its prefill chunks ran
    # params.stop_token_ids as a set: a client may send a long list, and every token is checked against it
    stop_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.request.params.stop_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


@dataclass
class _Launched:
    """A submitted plan whose tokens are not processed yet."""

    plan: StepPlan
    decode_context: list[int]  # Σc_i per rank when it was planned
    pending: PendingStep
    at: float  # monotonic time it was handed to the executor
    expected_s: float = 0.0  # its estimated run time (estimator x step calibration)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor, source: ModelSource | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.executor = executor
        self.source = source or resolve_model(config.model)
        self.tokenizer = tokenizer or load_tokenizer(self.source)
        mc = self.source.config
        self.max_model_len = config.context_limit(mc, executor.blocks_per_rank)  # capped by the KV pool
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(mc.eos_token_ids)
        layout = config.kv_layout(mc)
        self.blocks_per_rank = executor.blocks_per_rank  # what the ranks allocated (sized on CUDA)
        self.scheduler = Scheduler(config.scheduler, layout, self.blocks_per_rank)
        self.requests: dict[str, _Request] = {}
        self._new: list[NewRequest] = []  # to send with the next step
        self._first_tokens: dict[str, int] = {}  # sampled at a final chunk; decode input next step
        self._rng = random.Random(config.seed)  # seeds for unseeded requests
        self.last_plan: StepPlan | None = None  # latest executed plan (read by metrics)
        self.last_decode_context: list[int] = [0] * config.num_ranks  # Σc_i per rank at that plan
        # pipelined steps (module docstring): only where the executor runs a step in the background
        self.pipelined = config.async_scheduling and executor.overlaps
        self.launches_ahead = self.pipelined and executor.launches_ahead
        self.scheduler.defer_first_decode = self.pipelined
        self._in_flight: _Launched | None = None  # pipelined: the plan the ranks run now
        self._collected_at = 0.0  # monotonic time the latest step's tokens came back
        self.step_log = StepLog(config.step_log) if config.step_log else None  # served steps as samples

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request: GenerateRequest) -> None:
        """Queue a request, as the handler built it; ValueError (clear message) for bad params or context
        overflow; ``DeadlineUnattainable`` when the scheduler refuses it at arrival (``reject_unattainable``,
        of the scheduler's config or of ``params``). ``request.arrival``: wall-clock time at the ingress
        (None: now); ``request.priority``: lower is scheduled first (vLLM's rule), in every policy."""
        request_id, params, priority = request.request_id, request.params, request.priority
        prompt = list(request.prompt_token_ids)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.check_request(request_id, prompt, params)
        now = request.monotonic_arrival() or time.monotonic()
        # a request scoring its prompt takes no prefix-cache hit (cached positions have no logits)
        caching = self.config.scheduler.enable_prefix_caching and params.prompt_logprobs is None
        hashes = block_hashes(prompt, self.config.block_size) if caching else []
        self.scheduler.add(SchedRequest(request_id, len(prompt), max_tokens, now,
                                        now + self.config.scheduler.ttft_slo, block_hashes=hashes,
                                        priority=priority),
                           now=time.monotonic(), reject=params.reject_unattainable)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self._new.append(NewRequest(request_id, prompt, params, seed,
                                    min_tokens_blocked=self._min_tokens_blocked(params)))
        detok = IncrementalDetokenizer(self.tokenizer, prompt, params.stop, params.include_stop_str_in_output,
                                       params.skip_special_tokens)
        self.requests[request_id] = _Request(replace(request, prompt_token_ids=prompt), max_tokens, detok, seed)

    def _min_tokens_blocked(self, params: SamplingParams) -> tuple[int, ...]:
        """The ids a request cannot sample before ``min_tokens`` outputs: its stop ids, EOS unless ignored;
        only ids inside the vocabulary (a stop id outside it can never be sampled, and as a logit index it
        would fail the step)."""
        if params.min_tokens == 0:
            return ()
        eos = () if params.ignore_eos else tuple(self.eos_token_ids)
        vocab = self.source.config.vocab_size
        return tuple(sorted(t for t in {*eos, *params.stop_token_ids} if 0 <= t < vocab))

    def check_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> int:
        """The request's output budget (max_tokens resolved against the context); ValueError / TypeError
        naming ``request_id`` if ``add_request`` would refuse it. Changes nothing (callers validate a whole
        batch before adding any of it)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {request_id}: sampling params must be a SamplingParams, "
                            f"got {type(params).__name__}")
        if not prompt:
            raise ValueError(f"request {request_id}: the prompt is empty")
        not_ints = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)]
        if not_ints:
            raise TypeError(f"request {request_id}: token ids must be integers, got {not_ints[0]!r} "
                            f"({type(not_ints[0]).__name__})")
        vocab = self.source.config.vocab_size
        bad = out_of_vocab(prompt, vocab)
        if bad:
            raise ValueError(f"request {request_id}: token ids {bad[:3]} are outside the vocabulary [0, {vocab})")
        if out_of_vocab(list(params.logit_bias), vocab):  # (a stop token id outside it never matches: harmless)
            raise ValueError(f"request {request_id}: logit_bias names token ids "
                             f"{out_of_vocab(list(params.logit_bias), vocab)[:3]} outside the vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > vocab:
                raise ValueError(f"request {request_id}: {name} {asked} is more than the vocabulary ({vocab})")
        if params.n != 1:
            raise ValueError("EngineCore takes n=1 per request; submit n requests (LLM.generate does)")
        capped = self.max_model_len < self.config.context_limit(self.source.config)  # by the pool, not the config
        return resolve_max_tokens(len(prompt), params.max_tokens, self.max_model_len,
                                  "the model's context, capped by one rank's KV pool" if capped else "")

    def abort(self, request_id: str) -> None:
        """Stop a request now; its KV is freed on every rank by the next step's plan."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(request_id, self._context_hashes(req))
            self._first_tokens.pop(request_id, None)
            self._new = [r for r in self._new if r.request_id != request_id]

    def _context_hashes(self, req: _Request) -> list[int] | None:
        """With the prefix cache, the chained hashes of the full blocks of a decoding request's prompt and
        outputs whose KV exists (all outputs but the latest, which is not fed back yet); None otherwise."""
        sched = self.scheduler.decoding.get(req.request_id)
        if sched is None or self.scheduler.prefix is None:
            return None
        return extend_hashes(sched.block_hashes, req.prompt + req.output_ids[:-1], self.config.block_size)

    def has_unfinished(self) -> bool:
        """True while any request runs, a step is in flight or KV of finished ones still has to be freed."""
        return self.scheduler.has_work() or self._in_flight is not None

    def load(self) -> InstanceLoad:
        return self.scheduler.load()

    def stats(self) -> EngineStats:
        prefix = self.scheduler.prefix
        return EngineStats(prefix.queries if prefix else 0, prefix.hits if prefix else 0, self.scheduler.step_scale,
                           self.scheduler.num_preemptions)

    def close(self) -> None:
        """Stop what the scheduler runs beside the engine (the estimator's refit process)."""
        self.scheduler.close()

    # ---- one iteration -----------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One iteration: the outputs of the plan whose tokens came back (pipelined: the previous one)."""
        if not self.pipelined:
            launched = self._launch([])
            outputs = [] if launched is None else self._collect(launched)
        else:
            outputs = []
            launched = self._launch(outputs)  # while the step in flight runs
            if self._in_flight is not None:
                outputs += self._collect(self._in_flight)
            self._in_flight = launched
        if self.step_log is not None and not self.has_unfinished():  # idle now: what was logged is on disk
            self.step_log.flush()
        return outputs

    def _launch(self, outputs: list[StepOutput]) -> _Launched | None:
        """Plan the next step and hand it to the executor (None: nothing to run). A plan that preempts
        first collects the step in flight into ``outputs`` (the recompute prompt needs every output)."""
        now = time.monotonic()
        plan = self.scheduler.schedule(now, starts_at=self._expected_start(now))
        if plan.is_empty() and not plan.finished and not self._new:
            return None
        if self._in_flight is not None and (plan.preempted or self._reads_decode_step_first(plan)):
            outputs += self._collect(self._in_flight)
            self._in_flight = None
        context = self.scheduler.decode_context_per_rank()
        self._mark_scheduled(plan, now)
        self._resend_preempted(plan)
        step_input = StepInput(plan, self._new, self._first_tokens)
        self._new, self._first_tokens = [], {}
        at = time.monotonic()
        if self.pipelined:
            pending = self.executor.submit(step_input)
            self.scheduler.advance(plan)
            expected = self.scheduler.plan_estimate(plan, context) * self.scheduler.step_scale
            return _Launched(plan, context, pending, at, expected)
        return _Launched(plan, context, _Ran(self.executor.execute(step_input)), at)

    def _reads_decode_step_first(self, plan: StepPlan) -> bool:
        """Whether ``plan`` waits for the decode-only step in flight to come back before it is submitted:
        it carries prefill and the ranks launch ahead. A rank hands a step's tokens back only once it has
        launched the step submitted after it; launching a prefill step takes long, so every running
        decode's token would come late by that launch (docs/xp.md, "Decode steps launched ahead").
        Decode-only steps still launch ahead, and so does a step after a prefill step, whose device time
        covers the launch. The plan itself is made while the step in flight runs, as before."""
        return self.launches_ahead and bool(plan.prefill) and not self._in_flight.plan.prefill

    def _expected_start(self, now: float) -> float:
        """When a plan made ``now`` starts running: pipelined, once the step in flight ends (it started
        at its launch or at the end of the one before it, and runs about its estimate). Admission
        counts a request's iterations before its TTFT deadline from there, as the simulator does:
        counted from ``now``, a prefill planned to end in the deadline's last iteration ended a step late."""
        f = self._in_flight
        if f is None:
            return now
        return max(now, max(f.at, self._collected_at) + f.expected_s)

    def _collect(self, launched: _Launched) -> list[StepOutput]:
        """Wait for ``launched``'s tokens and turn them into outputs."""
        plan, result = launched.plan, launched.pending.result()
        now = time.monotonic()
        # the step ran from its launch, or (pipelined, queued behind the previous one) from that one's end
        measured = now - max(launched.at, self._collected_at)
        self.scheduler.observe_step(plan, launched.decode_context, measured)
        if self.step_log is not None:
            self._log_step(plan, launched.decode_context, measured, result.compute_s, result.launch_s,
                           result.device_s)
        self._collected_at = now
        self.scheduler.first_tokens((t.request_id for t in plan.transitions), now)  # admission's outcomes
        self.last_plan, self.last_decode_context = plan, launched.decode_context
        if not self.pipelined:
            self.scheduler.update(plan, result)
        return self._process(plan, result)

    def _log_step(self, plan: StepPlan, decode_context: list[int], measured_s: float,
                  compute_s: float | None, launch_s: float | None, device_s: float | None) -> None:
        sched = self.scheduler
        load = sched.plan_load(plan, decode_context)
        if not (any(load.prefill_tokens) or any(load.decode_tokens)):
            return
        estimated = sched.plan_estimate(plan, decode_context) if sched.config.uses_estimator() else None
        self.step_log.record(load, measured_s, estimated, compute_s, launch_s, device_s)

    def _mark_scheduled(self, plan: StepPlan, now: float) -> None:
        """A request's first prefill slice ends its queueing (a preempted one keeps its first time)."""
        for sl in plan.prefill:
            req = self.requests.get(sl.request_id)
            if req is not None and req.scheduled_at is None:
                req.scheduled_at = now

    def _resend_preempted(self, plan: StepPlan) -> None:
        """Preempted requests lose their KV on every rank this step (they are in ``plan.finished``);
        the ranks get them again with their outputs so far as part of the prompt (recompute)."""
        for rid in plan.preempted:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._first_tokens.pop(rid, None)
            self._new.append(NewRequest(rid, req.prompt + req.output_ids, req.params, req.seed,
                                        num_output=len(req.output_ids),
                                        min_tokens_blocked=self._min_tokens_blocked(req.params)))

    def _process(self, plan: StepPlan, result: StepResult) -> list[StepOutput]:
        transitioning = {t.request_id for t in plan.transitions}
        outputs = []
        for rid, scores in result.prompt_logprobs.items():
            if rid in self.requests:
                self.requests[rid].prompt_scores.update(scores)
        for rid, token in result.sampled.items():
            req = self.requests.get(rid)
            if req is None:
                continue  # aborted while the step ran
            req.output_ids.append(token)
            if rid in transitioning:
                req.num_cached = self.scheduler.decoding[rid].cached if rid in self.scheduler.decoding else 0
            reason, stop_reason = self._check_stop(req, token)
            finished = reason is not None
            top = result.top_logprobs.get(rid)
            outputs.append(StepOutput(
                request_id=rid, new_token_ids=[token], new_text=req.detok.take(finished),
                new_logprobs=[result.logprobs[rid]] if rid in result.logprobs else [],
                finished=finished, finish_reason=reason, num_prompt_tokens=req.prompt_len,
                num_output_tokens=len(req.output_ids), new_top_logprobs=[top] if top else [],
                stop_reason=stop_reason, scheduled_at=req.scheduled_at, num_cached_tokens=req.num_cached,
                prompt_logprobs=self._prompt_logprobs(req)))
            if finished:
                del self.requests[rid]
                self.scheduler.finish(rid, self._context_hashes(req))
            elif rid in transitioning:
                self._first_tokens[rid] = token
        return outputs

    @staticmethod
    def _prompt_logprobs(req: _Request) -> list | None:
        """With a request's first token: its prompt's scores (None for position 0, which nothing predicts)."""
        if req.params.prompt_logprobs is None or len(req.output_ids) != 1:
            return None
        return [None] + [req.prompt_scores.get(p) for p in range(1, req.prompt_len)]

    def _check_stop(self, req: _Request, token: int) -> tuple[FinishReason | None, str | int | None]:
        p = req.params
        reason: FinishReason | None = None
        stop_reason: str | int | None = None
        if token in req.stop_ids:
            reason, stop_reason = "stop", token
        elif not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        else:
            stop_str = req.detok.add(token, match_stop=len(req.output_ids) >= p.min_tokens)  # vLLM's rule
            if stop_str is not None:
                return "stop", stop_str
            if len(req.output_ids) >= req.max_tokens:
                reason = "length"
        if reason is not None:
            # flush a held-back tail (incomplete UTF-8 at the end): it may still hold a stop string
            stop_str = req.detok.finish()
            if stop_str is not None:
                return "stop", stop_str
        return reason, stop_reason


@dataclass(frozen=True)
class _Ran:
    """A step that already ran (the executor's plain ``execute``)."""

    value: StepResult

    def result(self) -> StepResult:
        return self.value
