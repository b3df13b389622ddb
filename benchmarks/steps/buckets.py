#!/usr/bin/env python
"""Decode-only step time by the smallest replayed CUDA-graph bucket (one-device instance).

    python -m benchmarks.steps buckets --floors 1,2,4,8 --requests 1,2,4 --prompt 16384 --out $OUT/b.json

The instance is built once as ``conflux serve`` builds it (benchmarks/steps/trace.py ``build``). For
each repeat, floor F and request count R (interleaved), R requests of --prompt random tokens decode
--output tokens greedily while the decode graphs replay only buckets >= F (a step of R < F rows pads to
F). Prints the median decode-only step wall time per (F, R) and its ratio to F = 1: whether a padded
bigger bucket is cheaper than the exact small one (the sixth GPU run's hint: 1 request 8.3 ms, 4-32
requests 7.1-7.5 ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.steps.trace import build

from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.sampling_params import SamplingParams


def decode_step_times(core, requests: int, prompt: int, output: int, gen: torch.Generator) -> list[float]:
    vocab = core.source.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i in range(requests):
        core.add_request(GenerateRequest(f"r{time.monotonic_ns()}-{i}",
                                         torch.randint(0, vocab, (prompt,), generator=gen).tolist(),
                                         params))
    times = []
    while core.has_unfinished():
        t0 = time.perf_counter()
        core.step()
        dt = time.perf_counter() - t0
        plan = core.last_plan
        if sum(plan.prefill_tokens_per_rank()) == 0 and sum(plan.decode_tokens_per_rank()) == requests:
            times.append(dt)
    return times[2:]  # the first decode steps also sample the first tokens' neighbours: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--floors", default="1,2,4,8")
    ap.add_argument("--requests", default="1,2,4")
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    floors = [int(x) for x in args.floors.split(",")]
    counts = [int(x) for x in args.requests.split(",")]
    # step_trace.build's remaining fields: the product's defaults
    bargs = argparse.Namespace(model=args.model, device=args.device, ranks=1, policy=None, budget=None,
                               ttft_slo=1.0, tbt_slo=0.1, xp_mode=None)
    core = build(bargs)
    graphs = getattr(getattr(core.executor, "worker", None), "decode_graphs", None)
    if graphs is None:
        print("no decode graphs on this instance (CUDA, one rank only)")
        return 1
    all_buckets = graphs.buckets
    gen = torch.Generator().manual_seed(0)
    samples: dict[str, list[float]] = {}
    try:
        for _ in range(args.repeats):
            for f in floors:
                graphs.buckets = tuple(b for b in all_buckets if b >= f)
                for r in counts:
                    replays = graphs.replays
                    ts = decode_step_times(core, r, args.prompt, args.output, gen)
                    assert graphs.replays > replays, "decode steps did not replay a graph"
                    samples.setdefault(f"{f}/{r}", []).extend(ts)
    finally:
        graphs.buckets = all_buckets
        core.executor.shutdown()
    table = {}
    for r in counts:
        base = statistics.median(samples[f"1/{r}"])
        for f in floors:
            med = statistics.median(samples[f"{f}/{r}"])
            table[f"floor {f}, {r} requests"] = {"median_ms": round(med * 1e3, 3), "vs_floor_1": round(med / base, 4),
                                                  "steps": len(samples[f"{f}/{r}"])}
            print(f"floor {f:3d}  requests {r:3d}  decode step {med * 1e3:7.3f} ms  x{med / base:.3f} of floor 1")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "buckets": list(all_buckets), "table": table,
                                              "samples": samples}))
    return 0

