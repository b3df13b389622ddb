#!/usr/bin/env python
"""The linear layers at decode batch sizes: the skinny Triton kernel's launch shapes vs cuBLAS vs HBM.

    python -m benchmarks.steps gemv --out $OUT/gemv.json                  # Llama-3.1-8B shapes, H200
    python -m benchmarks.steps gemv --rows 1,8 --block-n 32 --block-k 256 --warps 4 --stages 4

For each linear layer of ``--model`` (qkv, o, gate_up, down, LM head; bf16) and each row count, it
times ``F.linear`` (cuBLAS: the baseline, same run) and the skinny kernel (engine/models/skinny.py)
at its shipped ``launch_config`` and at every config of the grid. Each timing is ``--calls`` calls
captured in one CUDA graph (how the engine's decode steps run them: no launch gaps), rotating over 4
copies of the weight so that no call reads it from L2; per call: microseconds, the weight read's
bandwidth, its ratio to ``--hbm-tbps``. Each output is checked against ``F.linear`` in fp32 (max
relative error). Prints per (layer, rows) the baseline, the shipped config and the grid's best.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from conflux_cluster.engine.models import skinny
from conflux_cluster.engine.util.cuda_timing import graph_timed

HBM_TBPS = 4.3


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """Each linear layer's weight [N, K] for ``model``'s preset."""
    from conflux_cluster.engine.models.config import PRESETS

    mc = PRESETS[model]
    return {"qkv": (mc.q_size + 2 * mc.kv_size, mc.hidden_size), "o": (mc.hidden_size, mc.q_size),
            "gate_up": (2 * mc.intermediate_size, mc.hidden_size), "down": (mc.hidden_size, mc.intermediate_size),
            "lm_head": (mc.vocab_size, mc.hidden_size)}


def rotating(f, ws: list[torch.Tensor]):
    """``f`` over the weight copies in turn: consecutive calls (and captured ones) read different memory."""
    copies = itertools.cycle(ws)
    return lambda: f(next(copies))


def time_config(x: torch.Tensor, ws: list[torch.Tensor], ref: torch.Tensor, cfg: skinny.LaunchConfig,
                args: argparse.Namespace) -> dict:
    """One launch config at one shape: per-call time in a graph, bandwidth, error against fp32."""
    try:
        y = skinny.skinny_linear(x, ws[0], None, cfg)
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        sec = graph_timed(rotating(lambda w: skinny.skinny_linear(x, w, None, cfg), ws), args.calls, args.repeats)
    except Exception as exc:  # a config the compiler refuses (e.g. out of shared memory)
        return {"config": list(cfg), "error": f"{type(exc).__name__}: {str(exc)[:120]}"}
    return {"config": list(cfg), "us": sec * 1e6, "tbps": 2 * ws[0].numel() / sec / 1e12, "rel_err": err}


def time_layer(name: str, n: int, k: int, grid: list[skinny.LaunchConfig], gen: torch.Generator,
               args: argparse.Namespace) -> list[dict]:
    """Every row count of one layer: cuBLAS, the shipped config, the grid."""
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5 for _ in range(4)]
    gbytes = 2 * n * k
    out = []
    for m in _ints(args.rows):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = F.linear(x.float(), ws[0].float())
        base = graph_timed(rotating(lambda w: F.linear(x, w), ws), args.calls, args.repeats)
        shipped = skinny.launch_config(n, k)
        timed = [time_config(x, ws, ref, c, args) for c in [shipped] + [c for c in grid if c != shipped]]
        best = min((t for t in timed if "us" in t), key=lambda t: t["us"])
        ship = timed[0]
        out.append({"layer": name, "n": n, "k": k, "rows": m, "cublas_us": base * 1e6, "cublas_tbps": gbytes / base / 1e12,
                    "shipped": ship, "best": best, "grid": timed,
                    "shipped_vs_cublas": ship.get("us", float("nan")) / (base * 1e6),
                    "best_vs_cublas": best["us"] / (base * 1e6)})
        print(f"{name:8s} rows {m:3d} [{n}x{k}]: cuBLAS {base * 1e6:7.1f} us {gbytes / base / 1e12:.2f} TB/s "
              f"({gbytes / base / 1e12 / args.hbm_tbps:.0%}) | shipped {ship.get('us', float('nan')):7.1f} us "
              f"{ship.get('tbps', 0):.2f} TB/s | best {best['us']:7.1f} us {best['tbps']:.2f} TB/s "
              f"{tuple(best['config'])} err {best['rel_err']:.1e}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", default="qkv,o,gate_up,down,lm_head")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--block-k", default="128,256")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3,5")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--hbm-tbps", type=float, default=HBM_TBPS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv: needs a CUDA device")
        return 1
    shapes = layer_shapes(args.model)
    grid = [skinny.LaunchConfig(*c) for c in itertools.product(_ints(args.block_n), _ints(args.block_k),
                                                                _ints(args.warps), _ints(args.stages))]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for name in [x for x in args.layers.split(",") if x]:
        rows_out += time_layer(name, *shapes[name], grid, gen, args)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "device": torch.cuda.get_device_name(),
                                              "rows": rows_out}, indent=1))
    return 0
