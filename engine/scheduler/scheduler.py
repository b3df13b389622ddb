"""The per-instance scheduler: requests in, one ``StepPlan`` per iteration out (paper Alg. 1).

Decodes always advance (stall-free). Prefill work is poured into ranks toward a combined-load
level ``n_target``: a fixed token budget for the ``fcfs``/``srpt`` baselines, the TBT-safe level
found by the estimator for ``slo``. A request whose last chunk is planned gets a decode rank or
is not scheduled at all.
"""

from __future__ import annotations

from ..kv_layout import KVLayout
from ..plan import DecodeTransition, PrefillSlice, StepPlan, StepResult
from .config import SchedulerConfig
from .kv_accounting import KVAccounting
from .requests import Phase, SchedRequest
from .waterfill import capacity, pour


class Scheduler:
    """Owns scheduler-side request state and KV reservations; pure Python."""

    def __init__(self, config: SchedulerConfig, layout: KVLayout, blocks_per_rank: int) -> None:
        self.config = config
        self.layout = layout
        self.kv = KVAccounting(layout, blocks_per_rank)
        self.waiting: dict[str, SchedRequest] = {}  # prefill not finished, insertion = arrival order
        self.decoding: dict[str, SchedRequest] = {}
        self._to_free: list[str] = []  # finished/aborted since the last plan
        self._step = 0

    # ---- request lifecycle -------------------------------------------------------------
    def add(self, req: SchedRequest) -> None:
        need = self.kv.decode_need(req.max_context)
        if need + self.config.headroom_blocks > self.kv.blocks_per_rank:
            raise ValueError(
                f"request {req.request_id}: prompt+max_tokens={req.max_context} tokens needs {need} KV "
                f"blocks, more than one rank holds ({self.kv.blocks_per_rank})")
        self.waiting[req.request_id] = req

    def finish(self, request_id: str) -> None:
        """Request ended (stop, length or abort): its KV is freed by the next plan."""
        req = self.waiting.pop(request_id, None) or self.decoding.pop(request_id, None)
        if req is None:
            return
        req.phase = Phase.FINISHED
        self.kv.release(request_id)
        self._to_free.append(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.decoding or self._to_free)

    # ---- one iteration -----------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        n = self.layout.num_ranks
        plan = StepPlan(step=self._step, decode=[[] for _ in range(n)], finished=self._to_free)
        self._to_free = []
        self._step += 1
        for req in self.decoding.values():
            plan.decode[req.decode_rank].append(req.request_id)
        loads = plan.decode_tokens_per_rank()
        for req in self._prefill_order(now):
            if not self._plan_prefill(req, loads, plan):
                break
        return plan

    def _prefill_order(self, now: float) -> list[SchedRequest]:
        reqs = list(self.waiting.values())
        if self.config.policy == "srpt":
            reqs.sort(key=lambda r: (r.remaining_prefill, r.arrival))
        return reqs

    def _plan_prefill(self, req: SchedRequest, loads: list[int], plan: StepPlan) -> bool:
        """Pour as much of ``req``'s prefill as fits under the level; False when the step is full."""
        n_target = self.config.max_num_batched_tokens
        budget = capacity(loads, n_target)
        chunk = min(req.remaining_prefill, budget)
        if chunk <= 0:
            return False
        if req.computed == 0 and req.request_id not in self.kv.prefill_held:
            if not self.kv.can_reserve_prefill(req.prompt_len):
                return False  # wait for KV: never over-commit the pool
        if chunk == req.remaining_prefill:
            if len(self.decoding) + len(plan.transitions) >= self.config.max_num_seqs:
                chunk -= 1  # keep the final token back until a decode slot frees
                if chunk <= 0:
                    return False
            else:
                rank = self._place_decode(req)
                if rank is None:
                    chunk -= 1
                    if chunk <= 0:
                        return False
                else:
                    plan.transitions.append(DecodeTransition(req.request_id, rank))
                    self.kv.reserve_decode(req.request_id, rank, req.max_context)
                    req.decode_rank = rank
        if req.request_id not in self.kv.prefill_held:
            self.kv.reserve_prefill(req.request_id, req.prompt_len)
        self._emit_slices(req, chunk, loads, n_target, plan)
        return chunk == req.remaining_prefill or budget > chunk

    def _emit_slices(self, req: SchedRequest, chunk: int, loads: list[int], n_target: int,
                     plan: StepPlan) -> None:
        give = pour(loads, chunk, n_target)
        pos = req.computed
        for rank, count in enumerate(give):
            if count:
                plan.prefill.append(PrefillSlice(req.request_id, rank, pos, pos + count))
                loads[rank] += count
                pos += count

    def _place_decode(self, req: SchedRequest) -> int | None:
        """Worst-fit by resident decode context among ranks with room (dual-mode: see placement)."""
        need = self.kv.decode_need(req.max_context) + self.config.headroom_blocks
        ctx = [0] * self.layout.num_ranks
        for d in list(self.decoding.values()) + list(self.waiting.values()):
            if d.decode_rank is not None:  # resident, or placed earlier this step (D~ in Alg. 1)
                ctx[d.decode_rank] += max(d.context_len, d.prompt_len if d.phase == Phase.WAITING else 0)
        feasible = [r for r in range(self.layout.num_ranks) if self.kv.free_blocks(r) >= need]
        if not feasible:
            return None
        return min(feasible, key=lambda r: (ctx[r], r))

    # ---- results -----------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> None:
        """Advance progress after ``plan`` ran: computed prompt tokens, generated tokens, transitions."""
        for s in plan.prefill:
            req = self.waiting.get(s.request_id)
            if req is not None:
                req.computed = max(req.computed, s.end)
        for t in plan.transitions:
            req = self.waiting.pop(t.request_id, None)
            if req is None:
                continue  # finished/aborted meanwhile
            req.phase = Phase.DECODING
            self.kv.release_prefill(req.request_id)
            self.decoding[req.request_id] = req
        for rid in result.sampled:
            req = self.decoding.get(rid)
            if req is not None:
                req.generated += 1
