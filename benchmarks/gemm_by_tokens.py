#!/usr/bin/env python
"""One layer's shared-linear GEMMs against the step's token count: is the cost linear (Eq. 3) or tiled?

    python benchmarks/gemm_by_tokens.py                        # Llama-3.1-8B dims, bf16, CUDA
    python benchmarks/gemm_by_tokens.py --tokens 64:1024:16 --out gemm.json

Times QKV, O, gate-up and down of one decoder layer (weights as the model holds them) for each token
count, CUDA-event medians, and prints each against the least-squares line through all of them (what
the estimator's f_GEMM is) and against the roofline (FLOPs at --peak-tflops, weights read once at
--hbm-tbps). A step of 257 tokens costing a 384-token step's time would show as a residual that
jumps at tile boundaries.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_decode_kernel import timed  # noqa: E402  (CUDA-event median)


def token_range(spec: str) -> list[int]:
    """"64:1024:16" -> 64, 80, ..., 1024; "128,256" -> [128, 256]."""
    if ":" in spec:
        lo, hi, step = (int(x) for x in spec.split(":"))
        return list(range(lo, hi + 1, step))
    return [int(x) for x in spec.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="32:1024:8", help="lo:hi:step or a comma list")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--hbm-tbps", type=float, default=4.3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_by_tokens: needs CUDA", file=sys.stderr)
        return 2
    h, d = args.hidden, args.head_dim
    shapes = {"qkv": (h, (args.q_heads + 2 * args.kv_heads) * d), "o": (args.q_heads * d, h),
              "gate_up": (h, 2 * args.intermediate), "down": (args.intermediate, h)}
    dev, dt = torch.device("cuda"), torch.bfloat16
    weights = {k: torch.randn(n_out, n_in, device=dev, dtype=dt) * 0.02 for k, (n_in, n_out) in shapes.items()}
    params = sum(w.numel() for w in weights.values())
    rows = []
    for n in token_range(args.tokens):
        xs = {k: torch.randn(n, n_in, device=dev, dtype=dt) for k, (n_in, _) in shapes.items()}

        def layer() -> None:
            for k, w in weights.items():
                torch.nn.functional.linear(xs[k], w)

        s = timed(layer, args.iters)
        roof = max(2 * n * params / (args.peak_tflops * 1e12), 2 * params / (args.hbm_tbps * 1e12))
        rows.append({"tokens": n, "seconds": s, "roofline_s": roof})
    xs_, ys_ = [r["tokens"] for r in rows], [r["seconds"] for r in rows]
    mx, my = sum(xs_) / len(xs_), sum(ys_) / len(ys_)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs_, ys_)) / max(sum((x - mx) ** 2 for x in xs_), 1e-30)
    icpt = my - slope * mx
    print(f"{'tokens':>6} {'ms':>8} {'line ms':>8} {'/line':>6} {'of roofline':>11}")
    for r in rows:
        r["line_s"] = slope * r["tokens"] + icpt
        print(f"{r['tokens']:>6} {1e3 * r['seconds']:>8.3f} {1e3 * r['line_s']:>8.3f} "
              f"{r['seconds'] / r['line_s']:>6.2f} {100 * r['roofline_s'] / r['seconds']:>10.1f}%")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "device": torch.cuda.get_device_name(),
                                              "line": {"slope": slope, "intercept": icpt}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
