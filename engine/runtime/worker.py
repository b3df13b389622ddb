"""``RankWorker``: executes one ``StepInput`` on one rank (in-process, in a subprocess or in a Ray actor).

Per step the worker gathers its local tokens in a fixed order::

    rows = [ prefill slices of this rank, in plan order | decode tokens of plan.decode[rank] ]

runs ONE forward pass over the concatenation (shared linears see one batch), and samples where
a request needs a token: the last row of a request's final prefill chunk (output index 0) and
every decode row. Decode tokens are the worker's own previous samples, except the first decode
token of a request: the rank that sampled it (the final prompt row) keeps it, and the scheduler's
``StepInput.first_tokens`` brings it to a decode rank that did not (with N ranks the final chunk may
run on another rank). A pipelined engine plans the next step before this one's tokens reach it, so
a request whose first token stays on its decode rank decodes in the very next step.

``execute`` is ``launch`` then ``finish``. Split, they let the host prepare step k+1 while the device
still runs step k (an executor that overlaps calls ``launch(k+1)`` before ``finish(k)``, as vLLM's async
scheduling does)::

    host:    [launch k] [launch k+1 .......] [finish k] [launch k+2 ...] [finish k+1]
    device:  .. step k ...................][ step k+1 .....................][ step k+2

A decode whose previous token is not read yet takes it from the device (the earlier step's sampled
tensor); positions and output indices advance at launch. A step that needs those tokens on the host
(penalties read the history, a grammar accepts each token before the next mask) finishes the
earlier steps first.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch.profiler import record_function

from ..attention.base import AttentionBackend, RowSpan
from ..attention.torch_paged import TorchPagedAttention
from ..config import EngineConfig
from .cuda_graphs import GraphedCausalLM, default_buckets
from ..kv.cache import KVCache
from ..kv.sizing import rank_kv_blocks
from ..loader import ModelSource, load_model, resolve_model
from ..models.transformer import CausalLM
from ..contracts.step import NewRequest, StepInput, StepPlan, StepResult
from ..kv.prefix_blocks import insert_on_rank
from ..penalties import TokenHistory
from ..prompt_logprobs import PendingPromptScores, PromptTarget, score_prompt_async
from ..sampling import PendingSample, SampleOutput, SampleSpec, sample_async
from ..sampling_params import SamplingParams
from ..util.transfer import to_device

if TYPE_CHECKING:
    from ..structured.matchers import RankGrammars


@dataclass
class _RankRequest:
    prompt: list[int]
    params: SamplingParams
    seed: int
    base: int = 0  # outputs folded into ``prompt`` (NewRequest.num_output)
    last_token: int | None = None  # the token to feed at the next decode
    num_output: int = 0  # output tokens that exist (the next sample has this output index)
    blocked: tuple[int, ...] = ()  # NewRequest.min_tokens_blocked
    outputs: list[int] = field(default_factory=list)  # outputs past ``base`` this rank sampled or was sent
    # the latest sample when it is not read yet: (its launched step, its row among that step's samples)
    pending: tuple["LaunchedStep", int] | None = None

    def __post_init__(self) -> None:
        self.num_output = self.base

    def first_token(self, tok: int) -> None:
        """The token after the prompt (sampled here, or sent by the rank that sampled it)."""
        self.last_token, self.num_output, self.outputs = tok, self.base + 1, [tok]

    def history(self) -> TokenHistory | None:
        """The tokens so far, for a penalty (None when the request uses none)."""
        return TokenHistory(self.prompt, self.base, self.outputs) if self.params.uses_history else None

    @property
    def decoding(self) -> bool:
        """True once a token past the prompt exists (its sample is the next decode input)."""
        return self.num_output > self.base


@dataclass
class _Batch:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    spans: list[RowSpan] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_ids: list[str] = field(default_factory=list)
    specs: list[SampleSpec] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)  # rows whose logits score a prompt token
    prompt_targets: list[PromptTarget] = field(default_factory=list)  # one per prompt row
    from_device: list[tuple[int, "LaunchedStep", int]] = field(default_factory=list)  # (row, step, its sample)


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device (``RankWorker.launch``); ``finish`` reads its tokens."""

    step: int
    batch: _Batch
    requests: list[_RankRequest]  # per sampled row: the request state it advanced
    sample: PendingSample | None  # None: nothing sampled
    prompt_logprobs: PendingPromptScores | None  # None: no prompt position scored
    done: torch.cuda.Event | None  # CUDA: recorded after the step's last kernel
    result: StepResult | None = None  # set by ``finish``
    started: torch.cuda.Event | None = None  # CUDA: recorded before the step's first kernel (device_s)


class RankWorker:
    """Holds one rank's model, KV pool and per-request token state."""

    def __init__(self, config: EngineConfig, rank: int = 0, source: ModelSource | None = None,
                 model: CausalLM | None = None,
                 attention_factory: Callable[[KVCache], AttentionBackend] = TorchPagedAttention) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config, self.rank = config, rank
        source = source or resolve_model(config.model)
        self.source = source
        self.model_config = source.config
        self.device = config.rank_device(rank)
        self.model = model or load_model(source, config.torch_dtype(), self.device,
                                         progress=config.load_progress, seed=config.seed)
        mc = self.model_config
        self.layout = config.kv_layout(mc)
        self.kv = KVCache(mc, self.layout, rank, rank_kv_blocks(config, mc, self.device),  # after the weights
                          config.torch_dtype(), self.device)
        self.attention = attention_factory(self.kv)
        self.graphed = self._graphed_model(config)  # None: plain eager forward
        self.decode_graphs = self._decode_graphs(config)  # None: decode-only steps as any other step
        # XP backends (engine/xp) allocate KV themselves from the plan (head-sharded prefill)
        self._reserve_kv = not self.attention.manages_kv
        self.requests: dict[str, _RankRequest] = {}
        self.keep_logits = False  # tests: keep each step's sampled-row logits in ``last_logits``
        self.last_logits: dict[str, torch.Tensor] = {}  # request id -> [V] float32 (when keep_logits)
        self.grammars: RankGrammars | None = None  # made by the first request with a structured output
        self._unread: list[LaunchedStep] = []  # launched steps whose tokens ``finish`` has not read, in order

    def execute(self, step_input: StepInput) -> StepResult:
        return self.finish(self.launch(step_input))

    def launch(self, step_input: StepInput) -> LaunchedStep:
        """Queue the step's work on the device and return without waiting for its tokens (``finish``)."""
        plan = step_input.plan
        if self._unread and self._needs_host_tokens(plan):
            self._finish_unread()
        started = _timing_event(self.device)
        if not self.attention.manages_kv:  # finished requests' blocks the cache keeps, before their tables go
            insert_on_rank(self.kv, plan.retained, self.rank)  # (an XP backend does it in its begin_step)
        for rid in plan.finished:
            self.kv.free(rid)
            self.requests.pop(rid, None)
            if self.grammars is not None:
                self.grammars.free(rid)
        for nr in step_input.new_requests:
            self.requests[nr.request_id] = _RankRequest(list(nr.prompt_token_ids), nr.params, nr.seed,
                                                        base=nr.num_output, blocked=nr.min_tokens_blocked)
            if nr.params.structured is not None:  # outputs folded into a recomputed prompt replay first
                outputs = nr.prompt_token_ids[len(nr.prompt_token_ids) - nr.num_output:]
                self._grammars().add(nr.request_id, nr.params.structured, outputs)
        for rid, tok in step_input.first_tokens.items():
            req = self.requests.get(rid)
            if req is not None and not req.decoding:  # the sampling rank has it (and may have decoded on)
                req.first_token(tok)
                if self.grammars is not None:
                    self.grammars.accept(rid, req.base, tok)
        self.attention.begin_plan(plan)
        batch = self._gather(plan)
        if not batch.input_ids and not self.attention.needs_forward():
            self.attention.end_plan(plan)
            launched = LaunchedStep(plan.step, batch, [], None, None, None, StepResult(step=plan.step, sampled={}))
        else:
            pending, prompt_lps = self._forward_and_sample(batch)
            self.attention.end_plan(plan)
            launched = LaunchedStep(plan.step, batch, [self.requests[rid] for rid in batch.sample_ids], pending,
                                    prompt_lps, _timing_event(self.device), started=started)
            for i, req in enumerate(launched.requests):  # positions and output indices advance now
                if req.decoding:
                    req.num_output += 1
                else:  # the final prompt row: the first token
                    req.num_output, req.outputs = req.base + 1, []
                req.last_token, req.pending = None, (launched, i)
        self._unread.append(launched)
        return launched

    def finish(self, launched: LaunchedStep) -> StepResult:
        """Wait for ``launched``'s tokens (and every step launched before it) and return its result."""
        if launched.result is None:
            self._finish_unread(until=launched)
        return launched.result

    @staticmethod
    def is_done(launched: LaunchedStep) -> bool:
        """Whether ``launched``'s device work has finished (``finish`` would not wait for the device)."""
        return launched.result is not None or launched.done is None or launched.done.query()

    def _finish_unread(self, until: LaunchedStep | None = None) -> None:
        """Read launched steps' tokens in launch order, up to ``until`` (None: all of them)."""
        while self._unread:
            launched = self._unread.pop(0)
            if launched.result is None:
                launched.result = self._read(launched)
            if launched is until:
                return

    def _read(self, launched: LaunchedStep) -> StepResult:
        b = launched.batch
        if launched.done is not None:
            launched.done.synchronize()
        out = launched.sample.result() if launched.sample is not None else SampleOutput([], [], [])
        for i, (rid, tok, spec) in enumerate(zip(b.sample_ids, out.token_ids, b.specs)):
            if self.grammars is not None and rid in self.grammars:
                self.grammars.accept(rid, spec.output_index, tok)
            req = launched.requests[i]
            req.outputs.append(tok)
            if req.pending is not None and req.pending[0] is launched:  # no later step took it from the device
                req.last_token, req.pending = tok, None
        scores = launched.prompt_logprobs.result() if launched.prompt_logprobs is not None else {}
        launched.sample = launched.prompt_logprobs = None  # the device tensors: no later step reads them now
        top = {rid: t for rid, t in zip(b.sample_ids, out.top_logprobs) if t}
        device_s = None
        if launched.started is not None and launched.done is not None:
            device_s = launched.started.elapsed_time(launched.done) / 1e3
        return StepResult(step=launched.step, sampled=dict(zip(b.sample_ids, out.token_ids)),
                          logprobs=dict(zip(b.sample_ids, out.logprobs)), top_logprobs=top,
                          prompt_logprobs=scores, device_s=device_s)

    def _needs_host_tokens(self, plan: StepPlan) -> bool:
        """Whether this step needs a not yet read token on the host: a penalty's history, a grammar's
        state before its mask, or the test hook that keeps logits."""
        if self.keep_logits:
            return True
        decodes = plan.decode[self.rank] if self.rank < len(plan.decode) else []
        for rid in decodes:
            req = self.requests.get(rid)
            if req is None or req.pending is None:
                continue
            if req.params.uses_history or (self.grammars is not None and rid in self.grammars):
                return True
        return False

    def _gather(self, plan: StepPlan) -> _Batch:
        """This rank's rows: prefill slices (plan order) then decode tokens; allocates their KV."""
        b = _Batch()
        for s in plan.prefill:
            if s.rank != self.rank:
                continue
            req = self.requests[s.request_id]
            if self._reserve_kv:
                self.kv.ensure(s.request_id, s.end)
            row = len(b.input_ids)
            b.input_ids += req.prompt[s.start:s.end]
            b.positions += range(s.start, s.end)
            b.spans.append(RowSpan(s.request_id, row, row + s.num_tokens, s.start, s.end, False))
            self._want_prompt_scores(b, s.request_id, req, row, s.start, s.end)
            if s.end == len(req.prompt):
                self._want_sample(b, s.request_id, row + s.num_tokens - 1, req, req.base)
        decodes = plan.decode[self.rank] if self.rank < len(plan.decode) else []
        for rid in decodes:
            req = self.requests[rid]
            if req.last_token is None and req.pending is None:
                raise RuntimeError(f"rank {self.rank}: decode of {rid} without its first token "
                                   f"(StepInput.first_tokens missed it)")
            pos = len(req.prompt) + req.num_output - req.base - 1
            if self._reserve_kv:
                self.kv.ensure(rid, pos + 1)
            row = len(b.input_ids)
            if req.pending is not None:  # sampled by a step whose tokens are not read yet: from the device
                b.from_device.append((row, *req.pending))
            b.input_ids.append(req.last_token if req.pending is None else 0)
            b.positions.append(pos)
            b.spans.append(RowSpan(rid, row, row + 1, pos, pos + 1, True))
            self._want_sample(b, rid, row, req, req.num_output)
        return b

    @staticmethod
    def _want_sample(b: _Batch, rid: str, row: int, req: _RankRequest, index: int) -> None:
        b.sample_rows.append(row)
        b.sample_ids.append(rid)
        b.specs.append(SampleSpec(req.params, req.seed, index, req.history(), req.blocked))

    @staticmethod
    def _want_prompt_scores(b: _Batch, rid: str, req: _RankRequest, row: int, start: int, end: int) -> None:
        """Rows ``row ..`` hold positions ``start .. end - 1``; each but the prompt's last scores the next
        prompt token (engine/prompt_logprobs.py). Not again for a preempted request that recomputes."""
        k = req.params.prompt_logprobs
        if k is None or req.base:
            return
        for pos in range(start, min(end, len(req.prompt) - 1)):
            b.prompt_rows.append(row + pos - start)
            b.prompt_targets.append(PromptTarget(rid, pos + 1, req.prompt[pos + 1], k))

    @torch.inference_mode()
    def _forward_and_sample(self, b: _Batch) -> tuple[PendingSample | None, PendingPromptScores | None]:
        """(the sampled rows' ``PendingSample``, the pending prompt scores of this batch's prefill rows)."""
        dev = self.device
        ids = to_device(b.input_ids, dev)  # [T]
        if b.from_device:
            ids = self._tokens_from_device(ids, b.from_device)
        pos = to_device(b.positions, dev)  # [T]
        meta = self.attention.prepare(b.spans, len(b.input_ids))
        rows = to_device(b.sample_rows + b.prompt_rows, dev)  # [S + P]: sampled rows, then prompt-scoring rows
        h = self.decode_graphs.run(ids, pos) if self.decode_graphs is not None else None
        if h is not None:
            logits = self.model.logits(h[rows])  # [S, V] float32
        else:
            forward = self.graphed or self.model
            logits = forward(ids, pos, self.attention, meta, sample_rows=rows)
        if self.keep_logits:
            self.last_logits = {rid: logits[i].cpu() for i, rid in enumerate(b.sample_ids)}
        s = len(b.sample_rows)
        # grammar masks: filled on the host here, while the device still runs the forward queued above
        # (the named ranges are the phases benchmarks/structured_overhead.py --profile-steps reports)
        with record_function("grammar.fill"):
            bitmask = self.grammars.fill(b.sample_ids) if self.grammars is not None else None
            if bitmask is not None and dev.type == "cuda":
                bitmask = bitmask.to(dev, non_blocking=True)  # from pinned memory
        with record_function("sample"):
            pending = sample_async(logits[:s], b.specs, bitmask) if s else None
            return pending, score_prompt_async(logits[s:], b.prompt_targets)

    def _tokens_from_device(self, ids: torch.Tensor, rows: list[tuple[int, LaunchedStep, int]]) -> torch.Tensor:
        """``ids`` with each of ``rows``' (row, step, its sample) input token taken from that step's sampled
        tokens on the device (one gather per step; normally only the previous one)."""
        by_step: dict[int, tuple[LaunchedStep, list[int], list[int]]] = {}
        for row, launched, i in rows:
            _, dst, src = by_step.setdefault(id(launched), (launched, [], []))
            dst.append(row)
            src.append(i)
        for launched, dst, src in by_step.values():
            ids[to_device(dst, ids.device)] = launched.sample.tokens[to_device(src, ids.device)]
        return ids

    def _grammars(self) -> RankGrammars:
        """This rank's grammar state, made on first use (imports xgrammar; loads the tokenizer)."""
        if self.grammars is None:
            from ..loader import load_tokenizer
            from ..structured.matchers import RankGrammars

            source = self.source
            self.grammars = RankGrammars(lambda: load_tokenizer(source), self.model_config.vocab_size,
                                         self.model_config.eos_token_ids, pin=self.device.type == "cuda")
        return self.grammars

    def _graphed_model(self, config: EngineConfig) -> GraphedCausalLM | None:
        """Piecewise CUDA graphs (``EngineConfig.cuda_graphs``; None = auto): CUDA only, not with base TP."""
        if config.cuda_graphs is False or self.device.type != "cuda":
            return None
        if config.tp_size > 1:
            if config.cuda_graphs:
                warnings.warn("cuda_graphs ignored with tp_size > 1 (TP all-reduce hooks are not captured)")
            return None
        return GraphedCausalLM(self.model, default_buckets(self._graph_max_tokens(config)))

    def _graph_max_tokens(self, config: EngineConfig) -> int:
        from ..kv.sizing import graph_max_tokens

        total = torch.cuda.get_device_properties(self.device).total_memory
        return graph_max_tokens(config, self.model_config, total)

    def _decode_graphs(self, config: EngineConfig):
        """Whole-forward graphs of decode-only steps where the attention backend has them (with the
        piecewise graphs: CUDA, no base TP), for up to ``max_num_seqs`` requests of any admitted length."""
        if self.graphed is None:
            return None
        max_batch = min(config.scheduler.max_num_seqs, self._graph_max_tokens(config))
        return self.attention.capture_decode_graphs(self.model, max_batch, config.context_limit(self.model_config))

    def live_requests(self) -> set[str]:
        return set(self.requests)

    def check_invariants(self) -> None:
        """KV pool invariants; only requests this rank still tracks may own blocks."""
        self.attention.check_invariants(self.live_requests())


def _timing_event(device: torch.device) -> torch.cuda.Event | None:
    """CUDA: a timing event recorded on the current stream now (None elsewhere). A step's ``device_s`` runs
    from the one recorded when its launch begins to the one after its last kernel: on the device's timeline,
    from when the step could start (the step before it done and its launch begun) to its end. Waiting for
    its own launch counts in it, the launch of the step after it does not (the host's clock at ``finish``
    has both)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
