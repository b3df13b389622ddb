"""Scheduling time per iteration vs pending-queue depth (paper §8.5, Table 5: 0.36-1.04 ms).

Setup per (N, depth): an XP instance of N ranks, Llama-3.1-8B roofline profile on H100 (the
paper's testbed), TBT 50 ms / TTFT 1 s, 16 resident decodes per rank with 2K-16K contexts, and
``depth`` pending prefills with toolagent-like prompt lengths (lognormal, P50 ≈ 6.3K, P95 ≈ 26K
tokens; DESIGN §8) arriving over the last second. Each measured step is ``schedule(now)``; the
fake ranks then return a token per decode, finished requests leave, and new pending prefills are
added so that the depth stays constant. Time is wall clock of ``schedule`` only (what runs on the
critical path) and CPU time of the scheduling thread (``time.thread_time``: immune to other
processes preempting this one on a shared machine), over ``--steps`` steps after ``--warmup``.

    .venv/bin/python -m benchmarks.bench_scheduler [--steps 100] [--policies slo,fcfs,srpt] [--prefix-cache]

``--prefix-cache``: the prefix cache on, and every pending prompt starts with one of 32 shared
prefixes (half its length) so lookups, hits and inserts run on the critical path too.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from conflux_cluster.engine.kv.layout import KVLayout
from conflux_cluster.engine.contracts.step import StepResult
from conflux_cluster.engine.kv.prefix_hash import chain_hashes
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.scheduler.estimator import LatencyEstimator
from conflux_cluster.engine.scheduler.requests import SchedRequest
from conflux_cluster.engine.scheduler.roofline import roofline_profile
from conflux_cluster.engine.scheduler.scheduler import Scheduler

SIGMA = math.log(26114 / 6346) / 1.645  # lognormal through P50 and P95 of Table 3


def prompt_len(rng: random.Random) -> int:
    return max(32, min(32000, int(rng.lognormvariate(math.log(6346), SIGMA))))


def pending(rid: str, rng: random.Random, arrival: float, prefix: bool) -> SchedRequest:
    """A pending prefill; with ``prefix``, its first half is one of 32 shared prefixes."""
    n = prompt_len(rng)
    hashes = []
    if prefix:
        shared, k = rng.randrange(32), n // 16
        own = 10**9 + int(rid[1:])  # this request's own blocks
        hashes = chain_hashes([shared, j] if j < k // 2 else [own, j] for j in range(k))
    return SchedRequest(rid, n, rng.randint(10, 600), arrival, arrival + 1.0, block_hashes=hashes)


def build(policy: str, n: int, depth: int, rng: random.Random, prefix: bool = False) -> tuple[Scheduler, float]:
    layout = KVLayout.build(16, 32, 8, n)
    est = LatencyEstimator(roofline_profile("llama-3.1-8b", "h100", n))
    cfg = SchedulerConfig(policy=policy, tbt_slo=0.05, ttft_slo=1.0, max_num_batched_tokens=2048,
                          max_num_seqs=4096, enable_prefix_caching=prefix)
    sched = Scheduler(cfg, layout, blocks_per_rank=4_000_000 // 16, estimator=est)
    now = 10.0
    for r in range(n):  # resident decodes: plant them through real transitions
        for j in range(16):
            req = SchedRequest(f"d{r}.{j}", rng.randint(2000, 16000), 100_000, now, now + 1.0)
            sched.add(req)
    while sched.waiting:
        plan = sched.schedule(now)
        sched.update(plan, StepResult(plan.step, {t.request_id: 1 for t in plan.transitions}))
    for i in range(depth):
        sched.add(pending(f"p{i}", rng, now - rng.random(), prefix))
    return sched, now


def run(policy: str, n: int, depth: int, steps: int, warmup: int, seed: int, prefix: bool = False
        ) -> tuple[list[float], list[float], int]:
    """(wall seconds, thread-CPU seconds) per schedule() call, and prefill tokens planned."""
    rng = random.Random(seed)
    sched, now = build(policy, n, depth, rng, prefix)
    wall, cpu, added, planned = [], [], depth, 0
    for step in range(warmup + steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        plan = sched.schedule(now)
        t1, c1 = time.perf_counter(), time.thread_time()
        if step >= warmup:
            wall.append(t1 - t0)
            cpu.append(c1 - c0)
            planned += sum(s.num_tokens for s in plan.prefill)
        sampled = {rid: 1 for ids in plan.decode for rid in ids}
        sampled.update({t.request_id: 1 for t in plan.transitions})
        sched.update(plan, StepResult(plan.step, sampled))
        for rid, req in list(sched.decoding.items()):
            if rid.startswith("p") and req.generated >= req.max_new_tokens:
                sched.finish(rid)
        now += 0.05
        while len(sched.waiting) < depth:  # keep the queue depth constant
            sched.add(pending(f"p{added}", rng, now, prefix))
            added += 1
    return wall, cpu, planned // max(1, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--depths", default="10,50,100,500")
    ap.add_argument("--ranks", default="4,8")
    ap.add_argument("--policies", default="slo,fcfs,srpt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-cache", action="store_true", help="prefix cache on, shared prefixes")
    args = ap.parse_args()
    depths = [int(x) for x in args.depths.split(",")]
    print(f"{'policy':6} {'N':>2} {'depth':>5} {'wall mean':>9} {'wall p50':>8} {'cpu mean':>8} "
          f"{'cpu p50':>7} {'cpu p99':>7} {'tok/step':>8}  cpu mean vs paper (ms)")
    paper = {10: 0.36, 500: 1.04}
    for policy in args.policies.split(","):
        for n in (int(x) for x in args.ranks.split(",")):
            for depth in depths:
                wall, cpu, tokens = run(policy, n, depth, args.steps, args.warmup, args.seed, args.prefix_cache)
                ms = lambda xs, q=None: (statistics.fmean(xs) if q is None  # noqa: E731
                                         else sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]) * 1e3
                ref = f"{ms(cpu) / paper[depth]:.2f}x of {paper[depth]}" if depth in paper else ""
                print(f"{policy:6} {n:>2} {depth:>5} {ms(wall):9.3f} {ms(wall, .5):8.3f} {ms(cpu):8.3f} "
                      f"{ms(cpu, .5):7.3f} {ms(cpu, .99):7.3f} {tokens:8d}  {ref}")

if __name__ == "__main__":
    main()
