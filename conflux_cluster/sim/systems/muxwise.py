"""MuxWise (spatial multiplexing: concurrent prefill and decode kernels on partitioned SMs) model.

Assumptions (documented, not measured):

* Uniform parallelism: the whole instance is one TP group (TP4 / TP8 as in the paper) for both
  phases. Prefill and decode run as two concurrent streams with separate kernels: NO co-batched
  linears, so each stream streams the weights itself.
* SM partition: a decode step with a fraction s of the SMs takes
  ``mem / min(1, s/S_BW) + compute / s + comm`` where mem is the memory-bound part (weights,
  KV), compute the FLOP-bound part and S_BW = 0.4 the fraction of SMs that already saturates HBM
  bandwidth (generous to MuxWise). As in MuxWise's TBT-aware allocation, decode gets the smallest
  s (in steps of 0.05) whose step time, times the contention factor α, is ≤ 0.9·TBT; prefill gets
  the rest (1 − s), fixed at the start of its step, slowed by β. Alone, a stream gets all SMs.
* Prefill is chunked (SGLang-style) up to ``chunk_tokens`` per step, in policy order (fcfs /
  srpt "++"); a completed prompt emits its first token and joins the decode batch at the next
  decode step boundary (KV room permitting).
"""

from __future__ import annotations

from conflux_cluster.engine.contracts.cluster import InstanceLoad
from conflux_cluster.slo import SLO

from ..core import Recorder, SimInstance
from ..costs import ComponentCosts
from ..hardware import kv_tokens_per_group
from ..workloads import SimRequest
from .common import DecodePool, Job, ordered, pairs

S_BW = 0.4  # fraction of SMs that saturates HBM bandwidth
MIN_SHARE = 0.05


def share_time(mem: float, compute: float, comm: float, s: float) -> float:
    """Step time with a fraction ``s`` of the SMs."""
    return mem / min(1.0, s / S_BW) + compute / s + comm


class MuxWiseInstance(SimInstance):
    streams = ("decode", "prefill")

    def __init__(self, recorder: Recorder, costs: ComponentCosts, policy: str, slo: SLO,
                 chunk_tokens: int = 8192, max_seqs: int = 512) -> None:
        super().__init__(recorder)
        self.c, self.policy, self.slo, self.chunk = costs, policy, slo, chunk_tokens
        self.pool = DecodePool(kv_tokens_per_group(costs.model, costs.hw, costs.tp), max_seqs)
        self.queue: list[Job] = []
        self.joining: list[Job] = []
        self.decode_share = 0.0  # SM fraction of the running decode step (0: none running)
        self.L = costs.model.num_layers
        self.prefill_rate = 1.0 / (self.L * costs.gemm.slope)

    def admit(self, req: SimRequest, now: float) -> None:
        self.queue.append(Job(req))

    def _decode_parts(self) -> tuple[float, float, float]:
        c, n = self.c, len(self.pool.jobs)
        ar = c.gemm.intercept - c.scaled(1).gemm.intercept / c.tp if c.tp > 1 else 0.0  # all-reduce latency
        mem = self.L * (c.gemm.intercept - ar + c.decode_attn(self.pool.context)) + c.lm_head.intercept
        return mem, self.L * c.gemm.slope * n + c.hw.step_overhead, self.L * ar

    def start_step(self, stream: str, now: float):
        return self._start_decode() if stream == "decode" else self._start_prefill()

    def _start_decode(self):
        if not self.pool.jobs:
            self.decode_share = 0.0
            return None
        mem, comp, comm = self._decode_parts()
        if not self.busy["prefill"] and not self.queue:
            self.decode_share = 1.0
            return share_time(mem, comp, comm, 1.0), list(self.pool.jobs)
        s = MIN_SHARE
        while s < 1.0 and self.c.alpha * share_time(mem, comp, comm, s) > 0.9 * self.slo.tbt_s:
            s = round(s + 0.05, 2)
        self.decode_share = s
        return self.c.alpha * share_time(mem, comp, comm, s), list(self.pool.jobs)

    def _start_prefill(self):
        if not self.queue:
            return None
        share = 1.0 - self.decode_share if self.pool.jobs else 1.0
        if share < MIN_SHARE:
            return None
        plan, total = [], 0
        for job in ordered(self.queue, self.policy):
            take = min(job.remaining, self.chunk - total)
            if take <= 0:
                break
            plan.append((job, take))
            total += take
        c = self.c
        work = sum(pairs(l, j.computed) for j, l in plan)
        ar = c.gemm.intercept - c.scaled(1).gemm.intercept / c.tp if c.tp > 1 else 0.0
        mem = self.L * (c.gemm.intercept - ar)
        kv = sum(l + j.computed for j, l in plan)
        comp = self.L * (c.gemm.slope * total + c.prefill_time(work, kv))
        t = share_time(mem, comp, self.L * ar, share) * (c.beta if self.pool.jobs else 1.0)
        return t + c.step_overhead(sum(1 for j, l in plan if l == j.remaining)), plan

    def finish_step(self, stream: str, payload, now: float) -> None:
        if stream == "prefill":
            for job, take in payload:
                job.computed += take
                if job.remaining == 0:
                    self.queue.remove(job)
                    job.generated = 1
                    if not self.rec.emit(job.req.request_id, now):
                        self.joining.append(job)
        else:
            for rid in payload:
                self.pool.jobs[rid].generated += 1
                if self.rec.emit(rid, now):
                    self.pool.leave(rid)
        while self.joining and self.pool.fits(self.joining[0]):
            self.pool.join(self.joining.pop(0))

    def load(self) -> InstanceLoad:
        return InstanceLoad(queued_prefill_tokens=sum(j.remaining for j in self.queue), num_waiting=len(self.queue),
                            num_decoding=len(self.pool.jobs), decode_context_tokens=self.pool.context,
                            prefill_capacity=self.prefill_rate)
