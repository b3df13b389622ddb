"""DistServe (static phase isolation) model.

Assumptions (documented, not measured):

* The instance's GPUs are split statically into ``prefill_dp`` prefill replicas of TP
  ``prefill_tp`` and ``decode_dp`` decode replicas of TP ``decode_tp`` (split swept; the paper's
  best is 1:1 with TP2/TP2 on 4 GPUs, TP4/TP4 on 8).
* Prefill replicas take whole prompts (no chunking) from one shared queue in policy order
  (fcfs, or srpt for "++"), batching prompts up to ``max_prefill_tokens`` (one longer prompt runs
  alone). Step time: ``L·(gemm(Σℓ) + prefill_attn(Σ pairs))`` on the TP group + LM head.
* The first token is emitted when the prefill step ends. The KV then moves to a decode replica
  over NVLink (``kv_transfer``: latency + bytes / (min TP · link bandwidth)), not overlapped.
* Decode replicas run continuous batching of their resident requests, every step
  ``L·(gemm(n_d) + decode_attn(Σc))``; a request joins the replica with the least context that has
  KV room (prompt + max output reserved), at the next step boundary.
"""

from __future__ import annotations

from conflux_cluster.engine.contracts.cluster import InstanceLoad

from ..core import Recorder, SimInstance
from ..costs import ComponentCosts
from ..hardware import kv_tokens_per_group
from ..workloads import SimRequest
from .common import DecodePool, Job, pairs, take_prefill_batch


class DistServeInstance(SimInstance):
    def __init__(self, recorder: Recorder, costs: ComponentCosts, prefill_tp: int, prefill_dp: int,
                 decode_tp: int, decode_dp: int, policy: str, max_prefill_tokens: int = 16384,
                 max_seqs: int = 512) -> None:
        self.streams = tuple(f"p{i}" for i in range(prefill_dp)) + tuple(f"d{i}" for i in range(decode_dp))
        super().__init__(recorder)
        self.cp, self.cd = costs.scaled(prefill_tp), costs.scaled(decode_tp)
        self.links = min(prefill_tp, decode_tp)
        self.policy, self.max_prefill_tokens = policy, max_prefill_tokens
        kv = kv_tokens_per_group(costs.model, costs.hw, decode_tp)
        self.pools = [DecodePool(kv, max_seqs) for _ in range(decode_dp)]
        self.queue: list[Job] = []
        self.joining: list[Job] = []  # KV arrived, waiting for decode room
        self.L = costs.model.num_layers
        self.prefill_rate = prefill_dp / (self.L * self.cp.gemm.slope)

    def admit(self, req: SimRequest, now: float) -> None:
        self.queue.append(Job(req))

    def start_step(self, stream: str, now: float):
        if stream[0] == "p":
            return self._start_prefill()
        pool = self.pools[int(stream[1:])]
        if not pool.jobs:
            return None
        n = len(pool.jobs)
        t = self.L * (self.cd.gemm(n) + self.cd.decode_attn(pool.context)) + self.cd.step_overhead(n)
        return t, list(pool.jobs)

    def _start_prefill(self):
        if not self.queue:
            return None
        batch, total = take_prefill_batch(self.queue, self.policy, self.max_prefill_tokens)
        work = sum(pairs(j.remaining, j.computed) for j in batch)
        kv = sum(j.req.prompt_len for j in batch)
        t = self.L * (self.cp.gemm(total) + self.cp.prefill_time(work, kv)) + self.cp.step_overhead(len(batch))
        return t, batch

    def finish_step(self, stream: str, payload, now: float) -> None:
        if stream[0] == "p":
            for job in payload:
                job.computed = job.req.prompt_len
                job.generated = 1
                if not self.rec.emit(job.req.request_id, now):
                    self.timers.append((now + self.cp.kv_transfer(job.req.prompt_len, self.links), job))
            return
        pool = self.pools[int(stream[1:])]
        for rid in payload:
            job = pool.jobs[rid]
            job.generated += 1
            if self.rec.emit(rid, now):
                pool.leave(rid)
        self._drain()

    def on_ready(self, job: Job, now: float) -> None:
        self.joining.append(job)
        self._drain()

    def _drain(self) -> None:
        while self.joining:
            job = self.joining[0]
            fits = [p for p in self.pools if p.fits(job)]
            if not fits:
                return
            min(fits, key=lambda p: p.context).join(job)
            self.joining.pop(0)

    def load(self) -> InstanceLoad:
        dec = sum(len(p.jobs) for p in self.pools)
        return InstanceLoad(queued_prefill_tokens=sum(j.remaining for j in self.queue), num_waiting=len(self.queue),
                            num_decoding=dec, decode_context_tokens=sum(p.context for p in self.pools),
                            prefill_capacity=self.prefill_rate)
