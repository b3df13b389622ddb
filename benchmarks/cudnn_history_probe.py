#!/usr/bin/env python
"""What cuDNN's attention costs for the split-history call in serving, not only in a loop.

    python benchmarks/cudnn_history_probe.py --out $OUT/probe.json        # CUDA

``history_attn_backends.py`` found cuDNN 1.45-1.94x faster than flash for a chunk over a 98K
history, with the shape repeated. Serving brings a new (chunk, history) almost every step, and
cuDNN builds an execution plan per new shape (36 ms on an H200, engine/attention/sdpa.py). This
measures, with wall clocks around synchronized calls:

* ``plan``: the first call of a new shape against a repeat, changing the query length, the key
  length and the batch (partition count) one at a time;
* ``fixed``: the history cut into partitions of a fixed length L (the batch axis), the queries
  padded to whole 128-row tiles, so a server sees at most (chunk tiles) x (partitions) shapes: cuDNN
  on that layout against flash with one partition and against cuDNN in one call, CUDA-event medians.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_decode_kernel import timed  # noqa: E402  (CUDA-event median)


def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)
    return r[0], r[1]


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]


def wall(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def fixed_parts(q: torch.Tensor, hist: torch.Tensor, length: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN over ``hist`` [S, 2, hkv, D] cut into S // length partitions of ``length`` keys, q [1, hq, T, D]
    padded to a multiple of 128 rows and expanded over the partitions; merged with the log-sum-exps."""
    _, hq, t, d = q.shape
    parts = hist.shape[0] // length
    tp = -(-t // 128) * 128
    qp = torch.nn.functional.pad(q, (0, 0, 0, tp - t)).expand(parts, hq, tp, d).contiguous()
    hkv = hist.shape[2]
    kp = hist[:parts * length, 0].reshape(parts, length, hkv, d).transpose(1, 2)
    vp = hist[:parts * length, 1].reshape(parts, length, hkv, d).transpose(1, 2)
    o, lse = cudnn(qp, kp, vp, scale)
    lse = lse.reshape(parts, hq, tp)[..., :t].float()
    w = torch.softmax(lse, dim=0)
    return (w[..., None] * o[:, :, :t].float()).sum(0, keepdim=True).to(q.dtype), torch.logsumexp(lse, 0)[None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", default="264,640,1024,2048")
    ap.add_argument("--histories", default="40000,98304")
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cudnn_history_probe: needs CUDA", file=sys.stderr)
        return 2
    hq, hkv, d, dev, dt = 32, 8, 128, torch.device("cuda"), torch.bfloat16
    scale = d ** -0.5
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "cudnn": torch.backends.cudnn.version(), "plan": [], "fixed": [],
                 "varlen_op": hasattr(torch.ops.aten, "_cudnn_attention_forward")}
    hist = torch.randn(131072, 2, hkv, d, device=dev, dtype=dt)

    def call(t: int, s: int, b: int = 1) -> None:
        q = torch.randn(b, hq, t, d, device=dev, dtype=dt)
        k = hist[:s, 0].transpose(0, 1)[None].expand(b, hkv, s, d) if b == 1 else \
            hist[:b * (s // b), 0].reshape(b, s // b, hkv, d).transpose(1, 2)
        cudnn(q, k, k, scale)

    for label, (t, s, b) in [("first", (256, 32768, 1)), ("repeat", (256, 32768, 1)), ("new query length", (257, 32768, 1)),
                             ("new key length", (256, 32769, 1)), ("new batch", (256, 32768, 2)),
                             ("repeat batch", (256, 32768, 2)), ("new length 2", (384, 65536, 1))]:
        sec = wall(lambda: call(t, s, b))
        out["plan"].append({"case": label, "chunk": t, "keys": s, "batch": b, "seconds": sec})
        print(f"plan  {label:<18} T={t:5d} S={s:6d} B={b}  {1e3 * sec:8.2f} ms", flush=True)

    for s in (int(x) for x in args.histories.split(",")):
        h = hist[:s]
        k, v = h[:, 0].transpose(0, 1)[None], h[:, 1].transpose(0, 1)[None]
        for t in (int(x) for x in args.chunks.split(",")):
            q = torch.randn(1, hq, t, d, device=dev, dtype=dt)
            ref_o, ref_l = flash(q, k, v, scale)
            row = {"chunk": t, "history": s, "flash_s": timed(lambda: flash(q, k, v, scale), args.iters),
                   "cudnn_one_s": timed(lambda: cudnn(q, k, v, scale), args.iters)}
            for length in (int(x) for x in args.lengths.split(",")):
                if s // length < 1:
                    continue
                cut = (s // length) * length
                kc, vc = k[:, :, :cut], v[:, :, :cut]
                ref_c, _ = flash(q, kc, vc, scale)
                o, _ = fixed_parts(q, h, length, scale)
                row[f"cudnn_L{length}_s"] = timed(lambda: fixed_parts(q, h, length, scale), args.iters)
                row[f"flash_L{length}_cut_s"] = timed(lambda: flash(q, kc, vc, scale), args.iters)
                row[f"cudnn_L{length}_max_diff"] = (o.float() - ref_c.float()).abs().max().item()
            out["fixed"].append(row)
            print("fixed " + "  ".join(f"{k_}={v_ * 1e3:.3f}ms" if k_.endswith("_s") else f"{k_}={v_:.3g}"
                                       for k_, v_ in row.items()), flush=True)
            del ref_o, ref_l
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
