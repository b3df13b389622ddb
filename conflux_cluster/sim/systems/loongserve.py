"""LoongServe (elastic sequence parallelism, phases in separate iterations) model.

Assumptions (documented, not measured):

* The instance is M = GPUs / base_tp elastic instances (base TP ``base_tp``; the paper: TP1 for
  Llama-8B / Qwen-14B, TP2 for Qwen-32B, max SP 4).
* Two streams over the M instances. A prefill step takes whole prompts (no chunking) in policy
  order up to ``max_prefill_tokens`` and runs them with Ulysses SP over ``prefill_degree`` instances
  (swept: M or M/2), the ones holding the least decode context; tokens are spread evenly:
  ``L·(gemm(⌈Σℓ/k⌉) + a2a_k(⌈Σℓ/k⌉) + prefill_attn(Σ pairs / k))``.
* Decode steps run on the instances not locked by a prefill; decodes resident on locked instances
  stall for the prefill (phases never share an iteration). A prefill starts only at a decode-step
  boundary and, when decodes are resident, only after at least one decode step since the previous
  prefill (alternation, so decodes are never starved).
* After prefill the KV is kept on one instance (elastic scale-down; migration assumed free, as
  LoongServe's ESP avoids it): the one with the least decode context and KV room.
"""

from __future__ import annotations

import math

from conflux_cluster.engine.contracts.cluster import InstanceLoad

from ..core import Recorder, SimInstance
from ..costs import ComponentCosts
from ..hardware import kv_tokens_per_group
from ..workloads import SimRequest
from .common import DecodePool, Job, pairs, take_prefill_batch


class LoongServeInstance(SimInstance):
    streams = ("prefill", "decode")

    def __init__(self, recorder: Recorder, costs: ComponentCosts, num_instances: int, policy: str,
                 max_prefill_tokens: int = 16384, prefill_degree: int | None = None, max_seqs: int = 512) -> None:
        super().__init__(recorder)
        self.c, self.M, self.policy = costs, num_instances, policy
        self.k = prefill_degree or num_instances
        self.max_prefill_tokens = max_prefill_tokens
        kv = kv_tokens_per_group(costs.model, costs.hw, costs.tp)
        self.pools = [DecodePool(kv, max(1, max_seqs // num_instances)) for _ in range(num_instances)]
        self.queue: list[Job] = []
        self.joining: list[Job] = []
        self.locked: set[int] = set()  # instances running the current prefill
        self.decoded_since_prefill = True
        self.L = costs.model.num_layers
        self.prefill_rate = num_instances / (self.L * costs.gemm.slope)

    def admit(self, req: SimRequest, now: float) -> None:
        self.queue.append(Job(req))

    def start_step(self, stream: str, now: float):
        if stream == "prefill":
            return self._start_prefill()
        active = [r for r in range(self.M) if r not in self.locked and self.pools[r].jobs]
        if not active:
            return None
        c = self.c
        t = self.L * max(c.gemm(len(self.pools[r].jobs)) + c.decode_attn(self.pools[r].context) for r in active)
        n = sum(len(self.pools[r].jobs) for r in active)
        return t + c.step_overhead(n), [(r, list(self.pools[r].jobs)) for r in active]

    def _start_prefill(self):
        if not self.queue or self.busy["decode"]:
            return None
        if not self.decoded_since_prefill and any(p.jobs for p in self.pools):
            return None
        batch, total = take_prefill_batch(self.queue, self.policy, self.max_prefill_tokens)
        self.locked = set(sorted(range(self.M), key=lambda r: (self.pools[r].context, r))[:self.k])
        c, n = self.c, math.ceil(total / self.k)
        work = sum(pairs(j.remaining, j.computed) for j in batch)
        kv = sum(j.req.prompt_len for j in batch)
        t = (self.L * (c.gemm(n) + c.a2a(self.k)(n) + c.prefill_time(work / self.k, kv / self.k))
             + c.step_overhead(len(batch)))
        self.decoded_since_prefill = False
        return t, batch

    def finish_step(self, stream: str, payload, now: float) -> None:
        if stream == "prefill":
            self.locked = set()
            for job in payload:
                job.computed, job.generated = job.req.prompt_len, 1
                if not self.rec.emit(job.req.request_id, now):
                    self.joining.append(job)
        else:
            self.decoded_since_prefill = True
            for r, rids in payload:
                pool = self.pools[r]
                for rid in rids:
                    pool.jobs[rid].generated += 1
                    if self.rec.emit(rid, now):
                        pool.leave(rid)
        self._drain()

    def _drain(self) -> None:
        while self.joining:
            fits = [p for p in self.pools if p.fits(self.joining[0])]
            if not fits:
                return
            min(fits, key=lambda p: p.context).join(self.joining.pop(0))

    def load(self) -> InstanceLoad:
        return InstanceLoad(queued_prefill_tokens=sum(j.remaining for j in self.queue), num_waiting=len(self.queue),
                            num_decoding=sum(len(p.jobs) for p in self.pools),
                            decode_context_tokens=sum(p.context for p in self.pools),
                            prefill_capacity=self.prefill_rate, num_ranks=self.M)
