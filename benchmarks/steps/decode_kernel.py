#!/usr/bin/env python
"""Paged decode attention on one GPU: Triton kernel launch shapes vs the torch gather path vs HBM.

    python -m benchmarks.steps decode-kernel --out results/decode_kernel.json
    python -m benchmarks.steps decode-kernel --tiles 64 --splits 2048 --warps 4 --stages 3 \
        --min-splits 0,8,16,32 --workloads 1x4096,8x4096,64x4096,1x32768 --out $OUT/min_splits.json

For each workload (batch x context, Llama-3.1-8B heads: 32 q / 8 kv, head dim 128, bf16, ``--block-size``-token
pool blocks scattered at random over the pool) it times one layer's decode attention (median of
CUDA-event timings) for every ``DecodeKernelConfig`` in a grid and for the torch path (block gather
+ SDPA), and prints achieved bandwidth over the KV bytes read and the ratio to 4.3 TB/s.
Each config is timed twice: eagerly (``us``: Python launches included, which bound small batches) and
as ``--graph-calls`` calls captured in one CUDA graph (``graph_us``, per call: how the engine's decode
steps run it, one call a layer); the best config is the fastest in the graph.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from conflux_cluster.engine.util.cuda_timing import graph_timed, median_seconds
from conflux_cluster.engine.xp.ops import decode_attention
from conflux_cluster.engine.xp.triton_decode import DecodeKernelConfig, decode_work, paged_decode_attention

HBM_TBPS = 4.3
HQ, HKV, D = 32, 8, 128


def _ints(text: str) -> list[int]:
    """A flag value of comma-separated integers (the other benchmarks' spelling); spaces work too."""
    return [int(x) for x in text.split(",") if x]


def timed(fn, reps: int = 20) -> float:
    """Median seconds of ``fn()`` over ``reps`` CUDA-event-timed calls (after 3 warm-ups)."""
    return median_seconds(fn, reps, warmup=3)


def workload(batch: int, ctx: int, gen: torch.Generator, bs: int):
    nb = -(-ctx // bs)
    blocks = batch * nb + 64
    k = torch.randn(blocks, bs, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    table = torch.randperm(blocks, device="cuda", generator=gen)[: batch * nb].view(batch, nb)
    lengths = torch.full((batch,), ctx, device="cuda", dtype=torch.long)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, table, lengths, nb


def run(args) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    grid = [DecodeKernelConfig(t, s, w, st, min_splits=ms) for t, s, w, st, ms in itertools.product(
        args.tiles, args.splits, args.warps, args.stages, args.min_splits) if s >= t]
    out = {}
    BS = args.block_size
    for batch, ctx in ((int(b), int(c)) for b, c in (w.split("x") for w in args.workloads.split(","))):
        q, k, v, table, lengths, nb = workload(batch, ctx, gen, BS)
        kv_bytes = 2 * batch * ctx * HKV * D * 2
        scale = D ** -0.5
        kv_of_q = [i // (HQ // HKV) for i in range(HQ)]

        def torch_path():
            kp = k[table].reshape(batch, nb * BS, HKV, D)
            vp = v[table].reshape(batch, nb * BS, HKV, D)
            return decode_attention(q, kp, vp, lengths, kv_of_q, scale)

        ref = torch_path().float()
        rows = {"torch-gather": timed(torch_path)}
        graphed: dict[str, float] = {}
        for cfg in grid:
            name = f"t{cfg.tile_keys}-s{cfg.split_keys}-w{cfg.num_warps}-st{cfg.num_stages}-m{cfg.min_splits}"
            try:
                work = decode_work(lengths.tolist(), BS, HKV, cfg, q.device)
                got = paged_decode_attention(q, k, v, table, lengths, scale, work, cfg).float()
                err = (got - ref).abs().max().item()
                if err > 2e-2:
                    rows[name] = f"wrong: max err {err:.3g}"
                    continue
                call = (lambda c=cfg, w=work: paged_decode_attention(q, k, v, table, lengths, scale, w, c))
                rows[name] = timed(call)
                graphed[name] = graph_timed(call, args.graph_calls)
            except Exception as e:  # noqa: BLE001 - a launch shape the compiler rejects
                rows[name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        roof = kv_bytes / (HBM_TBPS * 1e12)
        table_rows = {n: ({"us": round(t * 1e6, 1), "tb_s": round(kv_bytes / t / 1e12, 2),
                           "over_roofline": round(t / roof, 3)} if isinstance(t, float) else t)
                      for n, t in rows.items()}
        for n, t in graphed.items():
            table_rows[n].update(graph_us=round(t * 1e6, 1), graph_over_roofline=round(t / roof, 3))
        best = min(graphed, key=graphed.get)
        key = f"b{batch}_ctx{ctx}"
        out[key] = {"kv_bytes_gb": round(kv_bytes / 1e9, 3), "roofline_us": round(roof * 1e6, 1), "best": best,
                    "best_over_torch": round(rows["torch-gather"] / rows[best], 2), "configs": table_rows}
        graph_list = ", ".join(f"{n} {t * 1e6:.1f}" for n, t in graphed.items())
        print(f"{key}: roofline {roof * 1e6:.1f} us; torch {rows['torch-gather'] * 1e6:.0f} us (eager); "
              f"best {best} {graphed[best] * 1e6:.1f} us in a graph ({roof / graphed[best]:.0%} of HBM), "
              f"{rows[best] * 1e6:.0f} us eager; graph us: {graph_list}", flush=True)
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiles", type=_ints, nargs="+", default=[[32, 64, 128]])
    ap.add_argument("--splits", type=_ints, nargs="+", default=[[512, 1024, 2048]])
    ap.add_argument("--warps", type=_ints, nargs="+", default=[[4, 8]])
    ap.add_argument("--stages", type=_ints, nargs="+", default=[[2, 3, 4]])
    ap.add_argument("--min-splits", type=_ints, nargs="+", default=[[0]],
                    help="DecodeKernelConfig.min_splits values (0: fixed splits of --splits keys)")
    ap.add_argument("--block-size", type=int, default=16, help="pool block (the engine's block_size)")
    ap.add_argument("--graph-calls", type=int, default=32, help="calls per captured graph (a step's layers)")
    ap.add_argument("--workloads", default="64x2048,64x4096,24x8192,32x8192,8x32768,1x131072",
                    help="comma-separated BATCHxCONTEXT")
    args = ap.parse_args(argv)
    for name in ("tiles", "splits", "warps", "stages", "min_splits"):  # "1,2 3" -> [1, 2, 3]
        setattr(args, name, [x for group in getattr(args, name) for x in group])
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    t0 = time.time()
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(["python"] + sys.argv),
           "results": run(args)}
    res["wall_s"] = round(time.time() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out} in {res['wall_s']} s")

