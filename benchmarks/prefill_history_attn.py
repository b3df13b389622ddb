#!/usr/bin/env python
"""What a prefill chunk over a long history costs in one attention layer: the engine's own path.

    python benchmarks/prefill_history_attn.py                  # Llama-3.1-8B heads, bf16, CUDA
    python benchmarks/prefill_history_attn.py --chunks 512,2048 --histories 0,16384,65536

Per (chunk ℓ, history c): the history's KV gathered from a paged pool (``XPKVCache.read_at``'s
index_select) and ``ops.causal_attention`` over history + chunk, timed with CUDA events (median
of --iters after 3 warm-ups), against the roofline of its FLOPs (4·ℓ·(c + (ℓ+1)/2)·heads·head_dim at
--peak-tflops) and of its bytes (history + chunk KV read once at --hbm-tbps). Also the
estimator's view: the seconds per causal pair (Eq. 9's work unit), the number a fitted
``f_prefill_attn`` slope should come near at this context.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_decode_kernel import timed  # noqa: E402  (CUDA-event median)

from conflux_cluster.engine.xp.ops import causal_attention  # noqa: E402


def time_one(chunk: int, history: int, args: argparse.Namespace) -> dict:
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

    def step() -> None:
        k = pool_k.index_select(0, blocks).reshape(-1, hkv, d)[:total]
        v = pool_v.index_select(0, blocks).reshape(-1, hkv, d)[:total]
        causal_attention(q, k, v, history, kv_of_q, scale)

    s = timed(step, args.iters)
    pairs = chunk * (history + (chunk + 1) / 2)
    flops = 4 * pairs * hq * d
    kv_bytes = 2 * total * hkv * d * 2
    roof = max(flops / (args.peak_tflops * 1e12), kv_bytes / (args.hbm_tbps * 1e12))
    return {"chunk": chunk, "history": history, "seconds": s, "tflops": flops / s / 1e12,
            "roofline_s": roof, "of_roofline": roof / s, "s_per_pair": s / pairs}


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
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill_history_attn: needs CUDA", file=sys.stderr)
        return 2
    rows = []
    print(f"{'chunk':>6} {'history':>8} {'ms':>9} {'TFLOP/s':>8} {'of roofline':>11} {'s/pair':>10}")
    for c in (int(x) for x in args.histories.split(",")):
        for ell in (int(x) for x in args.chunks.split(",")):
            r = time_one(ell, c, args)
            rows.append(r)
            print(f"{ell:>6} {c:>8} {1e3 * r['seconds']:>9.3f} {r['tflops']:>8.1f} {100 * r['of_roofline']:>10.1f}% "
                  f"{r['s_per_pair']:>10.3g}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "device": torch.cuda.get_device_name(),
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
