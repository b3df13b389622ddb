#!/usr/bin/env python
"""Which kernel attends a chunk's queries over a long history fastest: torch's flash or cuDNN's.

    python benchmarks/history_attn_backends.py                       # Llama-3.1-8B heads, bf16, CUDA
    python benchmarks/history_attn_backends.py --chunks 264,1024 --histories 98304 --out $OUT/b.json

The split-history path (engine/xp/split_history.py) needs the history's partial output and its
log-sum-exp without a mask. Per (chunk, history) this times, CUDA-event medians of --iters:

* ``flash``: ``aten._scaled_dot_product_flash_attention`` on the engine's layout (GQA kv heads as
  they are, strided views of a [S, hkv, D] history), one partition and the engine's tuned count;
* ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` with ``compute_log_sumexp`` on the same
  views, and on contiguous [1, h, S, D] copies (the copy not timed), with kv heads as they are and,
  if cuDNN refuses GQA, expanded to the query heads;

and prints each against flash with one partition, with the largest output and log-sum-exp
differences. A failing variant prints its error instead (the shapes cuDNN accepts differ by version).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_decode_kernel import timed  # noqa: E402  (CUDA-event median)

from conflux_cluster.engine.xp.split_history import tune  # noqa: E402


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    return out, lse


def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)
    return r[0], r[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", default="128,264,512,640,1024,2048")
    ap.add_argument("--histories", default="32768,98304")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("history_attn_backends: needs CUDA", file=sys.stderr)
        return 2
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    dev, dt, scale = torch.device("cuda"), torch.bfloat16, args.head_dim ** -0.5
    table = tune([i // (hq // hkv) for i in range(hq)], d, dt, dev)
    rows = []
    for s in (int(x) for x in args.histories.split(",")):
        hist = torch.randn(s, 2, hkv, d, device=dev, dtype=dt)
        k, v = hist[:, 0].transpose(0, 1)[None], hist[:, 1].transpose(0, 1)[None]  # [1, hkv, S, D] strided
        kc, vc = k.contiguous(), v.contiguous()
        g = hq // hkv
        kx, vx = kc.repeat_interleave(g, dim=1), vc.repeat_interleave(g, dim=1)
        for t in (int(x) for x in args.chunks.split(",")):
            q = torch.randn(1, hq, t, d, device=dev, dtype=dt)
            ref_o, ref_l = flash(q, k, v, scale)
            variants = {"flash": lambda: flash(q, k, v, scale),
                        "cudnn strided gqa": lambda: cudnn(q, k, v, scale),
                        "cudnn contiguous gqa": lambda: cudnn(q, kc, vc, scale),
                        "cudnn expanded": lambda: cudnn(q, kx, vx, scale)}
            parts = table.parts(t, s) or 1
            if parts > 1:
                qp = q.expand(parts, hq, t, d).contiguous()
                part = s // parts
                kp = hist[:part * parts, 0].reshape(parts, part, hkv, d).transpose(1, 2)
                vp = hist[:part * parts, 1].reshape(parts, part, hkv, d).transpose(1, 2)
                variants[f"flash x{parts} (tuned)"] = lambda: flash(qp, kp, vp, scale)
            base = None
            for name, fn in variants.items():
                row = {"chunk": t, "history": s, "variant": name}
                try:
                    o, lse = fn()
                    sec = timed(fn, args.iters)
                    row.update(seconds=sec)
                    if "x" not in name.split()[-1] and o.shape == ref_o.shape:
                        row.update(max_out_diff=(o.float() - ref_o.float()).abs().max().item(),
                                   max_lse_diff=(lse.float().reshape(1, hq, -1)[..., :t]
                                                 - ref_l.float()[..., :t]).abs().max().item())
                    base = base or sec
                    row["vs_flash"] = base / sec
                    print(f"{t:>6} {s:>7} {name:<24} {1e3 * sec:8.3f} ms  {row['vs_flash']:5.2f}x  "
                          f"out diff {row.get('max_out_diff', float('nan')):.2g}  lse diff "
                          f"{row.get('max_lse_diff', float('nan')):.2g}", flush=True)
                except Exception as e:  # noqa: BLE001 - report what this torch/cuDNN refuses
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    print(f"{t:>6} {s:>7} {name:<24} error: {row['error']}", flush=True)
                rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "device": torch.cuda.get_device_name(),
                                              "torch": torch.__version__,
                                              "cudnn": torch.backends.cudnn.version(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
