"""Single-rank engine throughput on one GPU with a random-weight preset (figures only, no assertions).

    python3 benchmarks/bench_engine_gpu.py [--model llama-3.1-8b] [--requests 32] [--prompt 1024] [--output 64]

Requests arrive together; prefill is chunked under ``--chunk`` tokens per step while earlier
requests decode (continuous batching, one rank, torch SDPA attention backend).
"""

from __future__ import annotations

import argparse
import time

import torch

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.executor import LocalExecutor
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.tokenizer import ByteTokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=2048)
    args = ap.parse_args()
    cfg = EngineConfig(model=args.model, device="cuda", dtype="bfloat16", kv_cache_memory_gb=20, load_progress=False,
                       scheduler=SchedulerConfig(max_num_batched_tokens=args.chunk, max_num_seqs=args.requests))
    src = resolve_model(args.model)
    t = time.perf_counter()
    core = EngineCore(cfg, LocalExecutor(cfg, src), source=src, tokenizer=ByteTokenizer())
    print(f"{args.model}: built with random weights in {time.perf_counter() - t:.1f} s; "
          f"{core.blocks_per_rank} KV blocks", flush=True)
    gen = torch.Generator().manual_seed(0)
    vocab = src.config.vocab_size
    for rnd in ("warmup", "measured"):
        n = 2 if rnd == "warmup" else args.requests
        for i in range(n):
            ids = torch.randint(0, vocab, (args.prompt,), generator=gen).tolist()
            core.add_request(f"{rnd}-{i}", ids, SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first, produced, steps, decode_only = None, 0, 0, []
        while core.has_unfinished():
            s = time.perf_counter()
            plan_had_prefill = bool(core.scheduler.waiting)
            produced += sum(len(o.new_token_ids) for o in core.step())
            torch.cuda.synchronize()
            if not plan_had_prefill:
                decode_only.append(time.perf_counter() - s)
            first = first or time.perf_counter() - t0
            steps += 1
        wall = time.perf_counter() - t0
    tbt = sorted(decode_only)[len(decode_only) // 2] * 1e3 if decode_only else float("nan")
    print(f"{args.requests} requests x ({args.prompt} prompt + {args.output} output): {produced} output tokens "
          f"in {wall:.2f} s = {produced / wall:.0f} output tok/s, {args.requests * args.prompt / wall:.0f} "
          f"prompt tok/s overall; {steps} steps; median decode-only step {tbt:.1f} ms "
          f"(batch {args.requests}); peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
