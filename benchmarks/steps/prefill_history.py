#!/usr/bin/env python
"""What a prefill chunk over a long history costs in one attention layer: the engine's own path.

    python -m benchmarks.steps prefill-history                  # Llama-3.1-8B heads, bf16, CUDA
    python -m benchmarks.steps prefill-history --chunks 512,2048 --histories 0,16384,65536

Per (chunk ℓ, history c): the history's KV gathered from a paged pool (``XPKVCache.read_at``'s
index_select) and ``ops.causal_attention`` over history + chunk, timed with CUDA events (median
of --iters after 3 warm-ups), against the roofline of its FLOPs (4·ℓ·(c + (ℓ+1)/2)·heads·head_dim at
--peak-tflops) and of its bytes (history + chunk KV read once at --hbm-tbps). Also the
estimator's view: the seconds per causal pair (Eq. 9's work unit), the number a fitted
``f_prefill_attn`` slope should come near at this context.

``--parts`` also times the split-history path (``engine/xp/split_history.py``) with each number of
history partitions listed (``auto``: the static rule, ``tuned``: what the engine picks, the partition
counts timed on this device as a rank does when it starts), its speed-up over the unsplit call
(``parts`` 0) and its largest difference from it (bf16). ``*`` marks the engine's flash pick;
``engine`` times what the engine runs (``tuned``, or cuDNN's fixed partitions where the table took
them, or a long chunk in pieces through them: printed as ``cudnn``).

    python -m benchmarks.steps prefill-history --parts 1,auto,tuned,engine,2,4,8,16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from conflux_cluster.engine.util.cuda_timing import median_seconds

from conflux_cluster.engine.xp.ops import causal_attention
from conflux_cluster.engine.xp.split_history import SplitTable, history_splits, tune


def time_one(chunk: int, history: int, args: argparse.Namespace, parts: int | None = 1,
             table: SplitTable | None = None) -> tuple[dict, torch.Tensor]:
    """(row, output) of one shape; the inputs depend on the shape alone (seeded), so outputs compare.
    ``parts`` None: as ``table`` routes it."""
    torch.manual_seed(chunk * 1_000_003 + history)
    dev, dt = torch.device(args.device), torch.bfloat16
    hq, hkv, d, tpb = args.q_heads, args.kv_heads, args.head_dim, args.block_size
    total = history + chunk
    nb = -(-total // tpb)
    pool_k = torch.randn(nb + 8, tpb, hkv, d, device=dev, dtype=dt)
    pool_v = torch.randn_like(pool_k)
    blocks = torch.randperm(nb + 8, device=dev)[:nb]  # a scattered table, as a real pool has
    q = torch.randn(chunk, hq, d, device=dev, dtype=dt)
    kv_of_q = [i // (hq // hkv) for i in range(hq)]
    scale = d ** -0.5

    def step() -> torch.Tensor:
        k = pool_k.index_select(0, blocks).reshape(-1, hkv, d)[:total]
        v = pool_v.index_select(0, blocks).reshape(-1, hkv, d)[:total]
        return causal_attention(q, k, v, history, kv_of_q, scale, parts=parts, table=table)

    s = median_seconds(step, args.iters, warmup=3)  # CUDA-event median after 3 warm-ups
    pairs = chunk * (history + (chunk + 1) / 2)
    flops = 4 * pairs * hq * d
    kv_bytes = 2 * total * hkv * d * 2
    roof = max(flops / (args.peak_tflops * 1e12), kv_bytes / (args.hbm_tbps * 1e12))
    return {"chunk": chunk, "history": history, "parts": parts, "seconds": s, "tflops": flops / s / 1e12,
            "roofline_s": roof, "of_roofline": roof / s, "s_per_pair": s / pairs}, step()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--chunks", default="128,512,2048,8192")
    ap.add_argument("--histories", default="0,4096,16384,65536")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--hbm-tbps", type=float, default=4.3)
    ap.add_argument("--parts", default="1", help="history partitions to time, comma-separated; 'auto' = the "
                                                 "static rule, 'tuned' = the engine's choice; 0 = unsplit (always "
                                                 "timed first)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill_history_attn: needs CUDA", file=sys.stderr)
        return 2
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = tune([i // (args.q_heads // args.kv_heads) for i in range(args.q_heads)], args.head_dim, torch.bfloat16,
                 torch.device(args.device))
    print(f"tuned partitions per query block (1..{len(table.best)}): {table.best}; cuDNN for {sorted(table.cudnn)}")
    print(f"{'chunk':>6} {'history':>8} {'parts':>5} {'ms':>9} {'TFLOP/s':>8} {'of roofline':>11} {'s/pair':>10} "
          f"{'vs unsplit':>10} {'max diff':>9}")
    for c in (int(x) for x in args.histories.split(",")):
        for ell in (int(x) for x in args.chunks.split(",")):
            auto, tuned = history_splits(ell, c, args.q_heads, sms), table.parts(ell, c)
            engine = "cudnn" if table.uses_cudnn(ell, c) or table.piece(ell, c) else tuned
            pick = {"auto": auto, "tuned": tuned, "engine": engine}
            want = [0] + [pick[p] if p in pick else int(p) for p in args.parts.split(",") if p not in ("0", "")]
            base = None
            for parts in dict.fromkeys(want):  # unsplit first, then each distinct count once
                if parts != "cudnn" and parts and c // parts < 1:
                    continue
                r, out = (time_one(ell, c, args, None, table) if parts == "cudnn" else time_one(ell, c, args, parts))
                r["parts"] = parts
                if base is None:
                    base = (r["seconds"], out.float())
                r["auto"], r["tuned"] = parts == auto, parts == tuned
                r["speedup"] = base[0] / r["seconds"]
                r["max_abs_diff"] = (out.float() - base[1]).abs().max().item()
                rows.append(r)
                print(f"{ell:>6} {c:>8} {parts:>5}{'*' if r['tuned'] else ' '} {1e3 * r['seconds']:>9.3f} "
                      f"{r['tflops']:>8.1f} {100 * r['of_roofline']:>10.1f}% {r['s_per_pair']:>10.3g} "
                      f"{r['speedup']:>9.2f}x {r['max_abs_diff']:>9.2g}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "device": torch.cuda.get_device_name(), "sms": sms,
                                              "tuned_parts": table.best,
                                              "cudnn_query_blocks": sorted(table.cudnn), "rows": rows}, indent=1))
    return 0

