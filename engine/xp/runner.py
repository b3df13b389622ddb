"""One device's share of an XP step: local batch -> model (XP attention seam) -> sampled tokens.

The device's local batch follows ``meta.py``'s order (prefill slices on its logical rank in plan
order, then its resident decodes). Rows that need a token:

  * the last prompt token of a request whose final chunk runs here -> output token 0;
  * each local decode token -> the request's next output token.

Requests know their prompt ids and sampling params from ``XPRequest`` (sent once, when the
request first appears in a plan); the first sampled token of a request that starts decoding on
another rank arrives in ``XPStepInput.first_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..plan import StepPlan, StepResult
from ..sampling import SampleSpec, sample
from ..sampling_params import SamplingParams
from .attention import XPAttention
from .meta import XPMode, build_step_meta


@dataclass(frozen=True)
class XPRequest:
    """What ranks cannot know themselves about a new request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed or one the engine drew at admission


@dataclass
class XPStepInput:
    """StepPlan plus the new requests and the first tokens of requests that begin decoding."""

    plan: StepPlan
    new_requests: list[XPRequest] = field(default_factory=list)
    first_tokens: dict[str, int] = field(default_factory=dict)  # request id -> output token 0


@dataclass
class _ReqState:
    req: XPRequest
    outputs: list[int] = field(default_factory=list)  # output tokens known to this device


class XPRunner:
    """Runs steps on one device: model (already TP-sharded) + XP attention + sampling."""

    def __init__(self, model: torch.nn.Module, attn: XPAttention, mode: XPMode, device: torch.device,
                 report: bool = True) -> None:
        self.model, self.attn, self.mode, self.device = model, attn, mode, device
        self.report = report  # False on TP ranks t > 0 (their tokens duplicate t == 0's)
        self.rank = attn.groups.rank
        self.reqs: dict[str, _ReqState] = {}

    def execute(self, inp: XPStepInput) -> StepResult:
        for r in inp.new_requests:
            self.reqs.setdefault(r.request_id, _ReqState(r))
        for rid, tok in inp.first_tokens.items():
            st = self.reqs.get(rid)
            if st is not None and not st.outputs:
                st.outputs.append(tok)
        plan = inp.plan
        sampled: dict[str, int] = {}
        logprobs: dict[str, float] = {}
        if self.mode == XPMode.NO_COBATCH and plan.prefill and any(plan.decode):
            n = plan.num_ranks()
            first = StepPlan(plan.step, plan.prefill, [[] for _ in range(n)], plan.transitions, plan.finished)
            second = StepPlan(plan.step, [], plan.decode, [], [])
            self._run(first, sampled, logprobs)
            self._run(second, sampled, logprobs)
        else:
            self._run(plan, sampled, logprobs)
        for rid in plan.finished:
            self.reqs.pop(rid, None)
        if not self.report:
            return StepResult(plan.step, {}, {})
        return StepResult(plan.step, sampled, logprobs)

    @torch.no_grad()
    def _run(self, plan: StepPlan, sampled: dict[str, int], logprobs: dict[str, float]) -> None:
        uniform_sp = self.mode == XPMode.UNIFORM_SP
        sp_pos = None
        if uniform_sp:
            sp_pos = {rid: self.attn.kv.prefill_len(rid) for ids in plan.decode for rid in ids}
        meta = build_step_meta(plan, self.rank, uniform_sp, sp_pos)
        self.attn.begin_step(meta)
        if plan.is_empty():
            self.attn.end_step(meta)
            return
        ids, pos, rows, specs = self._batch(plan)
        logits = self.model(torch.tensor(ids, dtype=torch.long, device=self.device),
                            torch.tensor(pos, dtype=torch.long, device=self.device), self.attn, meta,
                            torch.tensor([r for r, _ in rows], dtype=torch.long, device=self.device))
        self.attn.end_step(meta)
        if rows:
            out = sample(logits, specs)
            for (_, rid), tok, lp in zip(rows, out.token_ids, out.logprobs):
                self.reqs[rid].outputs.append(tok)
                sampled[rid] = tok
                logprobs[rid] = lp

    def _batch(self, plan: StepPlan):
        """Local token ids, positions, rows to sample (row, rid) and their sample specs."""
        ids: list[int] = []
        pos: list[int] = []
        rows: list[tuple[int, str]] = []
        specs: list[SampleSpec] = []
        final = {t.request_id for t in plan.transitions}
        for s in plan.prefill:
            if s.rank != self.rank:
                continue
            st = self.reqs[s.request_id]
            ids += st.req.prompt_token_ids[s.start:s.end]
            pos += range(s.start, s.end)
            if s.request_id in final and s.end == len(st.req.prompt_token_ids):
                rows.append((len(ids) - 1, s.request_id))
                specs.append(SampleSpec(st.req.params, st.req.seed, 0))
        for rid in plan.decode[self.rank]:
            st = self.reqs[rid]
            ids.append(st.outputs[-1])
            pos.append(len(st.req.prompt_token_ids) + len(st.outputs) - 1)
            rows.append((len(ids) - 1, rid))
            specs.append(SampleSpec(st.req.params, st.req.seed, len(st.outputs)))
        return ids, pos, rows, specs

    def set_mode(self, mode: XPMode) -> None:
        """Switch execution mode between workloads (only with no request in flight)."""
        mode = XPMode(mode)
        if self.reqs or not self.kv_is_free():
            raise RuntimeError("set_mode needs an idle instance (no request holds KV)")
        if (mode == XPMode.UNIFORM_TP) != (self.mode == XPMode.UNIFORM_TP):
            raise ValueError("uniform-tp changes the device topology: start a new instance")
        self.mode = mode
        self.attn.set_mode(mode)

    def kv_is_free(self) -> bool:
        kv = self.attn.kv
        return kv.num_free_blocks == kv.num_blocks and not kv.prefill and not kv.decode
