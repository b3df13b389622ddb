#!/usr/bin/env python
"""What a step costs as its prefill splits into chunks, and decode-only steps, against the roofline.

    python -m benchmarks.steps chunks                     # llama-3.1-8b, cuda, random weights
    python -m benchmarks.steps chunks --splits 1,4,16 --histories 0,8192 --out $OUT/steps.json
    python -m benchmarks.steps chunks --model tiny-llama --device cpu --budget 256 --histories 0,256 \
        --decode-batches 1,4 --decode-context 256      # a CPU smoke run

The instance is built as ``conflux serve`` builds it (``instance_executor``: one device, XP attention).
Each point is one step of ``--budget`` prompt tokens split into k equal chunks, each chunk over a
history of H tokens (set up by untimed steps; the fastest of ``--repeats``). Every point is timed
twice in the same process: with the paged prefill kernel (FlashInfer, where it runs) and with the
torch path (per-chunk history gather + SDPA / split / cuDNN), the baseline. Decode-only steps of
``--decode-batches`` requests at ``--decode-context`` follow, timed one at a time (the host waits for
each step's tokens before it prepares the next) and launched ahead (step k+1 launched before step k's
tokens are read, as the engine runs them on GPUs: ``RankWorker.launch`` / ``finish``), then a
decode-only step followed by a step of ``--after-decode`` prompt tokens with and without those decodes,
launched ahead and not (what that launch costs the decode step's tokens). Prints ms,
prompt tok/s, the roofline (linear-layer and attention FLOPs at --peak-tflops; weights + KV bytes at
--hbm-tbps) and k-chunk over 1-chunk ratios.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import time

import torch

PEAK_TFLOPS = 790.0  # bf16 dense, one H200
HBM_TBPS = 4.3  # one H200


def build(args: argparse.Namespace):
    """(executor, model config, XP attention of the one rank)."""
    from conflux_cluster.engine.config import EngineConfig
    from conflux_cluster.engine.loader import resolve_model
    from conflux_cluster.engine.runtime.executor import instance_executor

    cfg = EngineConfig(model=args.model, device=args.device, num_ranks=1, load_progress=False,
                       async_scheduling=False)
    src = resolve_model(cfg.model)
    ex = instance_executor(cfg, src)
    return ex, src.config, ex.worker.attention


def linear_flops(mc) -> float:
    """FLOPs per token of the transformer's linear layers (no LM head: a non-final chunk samples nothing)."""
    from conflux_cluster.engine.scheduler.roofline import ModelDims

    return 2.0 * ModelDims.from_config("", mc).linear_params_per_layer * mc.num_hidden_layers


def attention_flops(mc, chunks: list[tuple[int, int]]) -> float:
    """Causal attention FLOPs of chunks (ℓ, c): QK and PV over c + (ℓ + 1) / 2 keys on average."""
    pairs = sum(ell * (c + (ell + 1) / 2) for ell, c in chunks)
    return 4.0 * pairs * mc.num_attention_heads * mc.head_dim * mc.num_hidden_layers


def weight_bytes(mc, elem: int = 2) -> float:
    """Bytes a decode step reads of the weights: the linear layers and the LM head (the embedding
    table is read one row per token, not counted)."""
    lin = linear_flops(mc) / 2
    return elem * (lin + mc.vocab_size * mc.hidden_size)


def kernel_of(attn) -> str:
    """The prefill kernel of the rank's attention (the torch paged backend off CUDA has only torch)."""
    from conflux_cluster.engine.xp.attention import XPAttention

    return attn.prefill_kernel if isinstance(attn, XPAttention) else "torch"


def time_split(h, k: int, budget: int, history: int, repeats: int) -> float:
    from conflux_cluster.engine.profiling.harness import _measure_chunks

    empty = [[]]
    return _measure_chunks(h, [(budget // k, history)] * k, empty, repeats).seconds


def chunk_points(args, h, attn, mc) -> list[dict]:
    rows = []
    kernels = ["torch"]
    if kernel_of(attn) == "flashinfer":  # each FlashInfer backend asked for, then the torch path
        kernels = [f"flashinfer-{b}" if b != "auto" else "flashinfer" for b in args.backends] + kernels
    for history in args.histories:
        base = {}
        for k in args.splits:
            for kernel in kernels:
                if kernels != ["torch"]:
                    attn.set_prefill_kernel(kernel != "torch")
                if kernel.startswith("flashinfer"):
                    attn.set_prefill_backend(kernel.partition("-")[2] or "auto")
                sec = time_split(h, k, args.budget, history, args.repeats)
                chunks = [(args.budget // k, history)] * k
                flops = linear_flops(mc) * args.budget + attention_flops(mc, chunks)
                roof = flops / (args.peak_tflops * 1e12)
                base.setdefault(kernel, sec)
                rows.append({"kernel": kernel, "backend": attn.prefill_backend if kernel != "torch" else "",
                             "chunks": k, "history": history, "ms": 1e3 * sec,
                             "tok_s": args.budget / sec, "roofline_ms": 1e3 * roof, "x_roofline": sec / roof,
                             "x_one_chunk": sec / base[kernel]})
                r = rows[-1]
                print(f"{kernel:>10} ({r['backend'] or '-'}) k={k:2d} H={history:6d}: {r['ms']:7.2f} ms {r['tok_s']:8.0f} tok/s "
                      f"roofline {r['roofline_ms']:6.2f} ms ({r['x_roofline']:.2f}x)  vs 1 chunk {r['x_one_chunk']:.2f}x",
                      flush=True)
    if kernels != ["torch"]:
        attn.set_prefill_kernel(True)
        attn.set_prefill_backend("auto")
    return rows


def set_skinny(ex, on: bool) -> None:
    """The few-row linear kernel on or off (engine/models/skinny.py), the decode graphs captured again."""
    from conflux_cluster.engine.models.skinny import set_skinny as switch

    switch(ex.worker.model, on)
    if ex.worker.decode_graphs is not None:
        ex.worker.decode_graphs.capture()


def decode_points(args, h, mc) -> list[dict]:
    from conflux_cluster.engine.profiling.harness import _Progress

    rows = []
    h.build_pool(max(args.decode_batches), [args.decode_context], _Progress(max(args.decode_batches), "pool"))
    for _ in range(3):
        h.run([], [list(h.pool[0])])
    kv_per_token = 2 * 2 * mc.num_key_value_heads * mc.head_dim * mc.num_hidden_layers
    for skinny in args.skinny:
        if len(args.skinny) > 1:
            set_skinny(h.ex, skinny == "on")
        rows += _decode_rows(args, h, mc, kv_per_token, skinny)
    if len(args.skinny) > 1:
        set_skinny(h.ex, True)
    return rows


def _decode_rows(args, h, mc, kv_per_token: int, skinny: str) -> list[dict]:
    rows = []
    for b in args.decode_batches:
        ids = h.pool[0][:b]
        ts = [h.run([], [ids])[0] for _ in range(args.decode_iters)]
        sec = statistics.median(ts)
        ahead = min(h.run_ahead([ids], args.decode_iters) for _ in range(3))
        ctx = sum(h.context[i] for i in ids)
        roof = (weight_bytes(mc) + kv_per_token * ctx) / (args.hbm_tbps * 1e12)
        rows.append({"batch": b, "context": args.decode_context, "skinny": skinny, "ms": 1e3 * sec,
                     "ahead_ms": 1e3 * ahead, "roofline_ms": 1e3 * roof, "x_roofline": sec / roof,
                     "ahead_x_roofline": ahead / roof})
        print(f"decode B={b:3d} ctx={args.decode_context} skinny {skinny}: {1e3 * sec:6.2f} ms one at a time, "
              f"{1e3 * ahead:6.2f} ms launched ahead; roofline {1e3 * roof:5.2f} ms ({sec / roof:.2f}x / "
              f"{ahead / roof:.2f}x)", flush=True)
        if args.profile:
            rows[-1]["kernels"] = kernel_table(lambda: h.run([], [ids]), args.profile)
        if args.host_profile:
            rows[-1]["host"] = host_table(lambda: h.run([], [ids]), args.host_profile)
    return rows


def after_decode_points(args, h) -> list[dict]:
    """A decode-only step followed by a step of ``--after-decode`` prompt tokens, with the same decodes
    (mixed) or without (prefill-only), the second launched ahead of the first's read or after it: the
    second's launch on the host and how long the decode step's tokens took to come back (docs/xp.md,
    "Decode steps launched ahead"). Medians of ``--repeats``."""
    rows = []
    for b in args.decode_batches:
        ids = [h.pool[0][:b]]
        for second in ("mixed", "prefill"):
            for ahead in (False, True):
                runs = [h.run_after_decode(ids, args.after_decode, second == "mixed", ahead)
                        for _ in range(args.repeats)]
                rows.append({"batch": b, "second": second, "ahead": ahead, "prompt_tokens": args.after_decode,
                             "launch_ms": 1e3 * statistics.median(r.launch_s for r in runs),
                             "decode_read_ms": 1e3 * statistics.median(r.decode_read_s for r in runs),
                             "pair_ms": 1e3 * statistics.median(r.pair_s for r in runs)})
                r = rows[-1]
                print(f"decode B={b:3d} then {second:7s} ({args.after_decode} tokens) "
                      f"{'launched ahead' if ahead else 'after the read'}: launch {r['launch_ms']:7.2f} ms, "
                      f"decode tokens back after {r['decode_read_ms']:7.2f} ms, pair {r['pair_ms']:7.2f} ms",
                      flush=True)
                if args.host_profile and not ahead:
                    prof = cProfile.Profile()
                    for _ in range(args.host_profile):
                        h.run_after_decode(ids, args.after_decode, second == "mixed", False, profiler=prof)
                    r["host"] = profile_rows(prof, args.host_profile, "launches")
    return rows


def host_table(step, iters: int, top: int = 25) -> list[dict]:
    """Where a step's host time goes (cProfile over ``iters`` calls of ``step``): the functions with the
    most time of their own, per step. A device wait shows as the call that synchronises (e.g. ``tolist``)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        step()
    prof.disable()
    return profile_rows(prof, iters, "steps", top)


def profile_rows(prof: "cProfile.Profile", iters: int, what: str, top: int = 25) -> list[dict]:
    """The functions with the most host time of their own in ``prof``, per one of its ``iters`` calls."""
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, prim calls, tottime, cumtime, callers)
    rows = sorted(((tt / iters, ct / iters, nc / iters, f"{fn.rsplit('/', 2)[-1]}:{ln}:{name}")
                   for (fn, ln, name), (_, nc, tt, ct, _) in stats.items()), reverse=True)
    total = sum(r[0] for r in rows)
    print(f"  host (cProfile, {iters} {what}): {1e3 * total:.3f} ms per one of own time")
    for tt, ct, nc, where in rows[:top]:
        print(f"    own {1e3 * tt:7.3f} ms  cum {1e3 * ct:7.3f} ms  x{nc:5.0f}  {where[:100]}")
    return [{"own_ms": 1e3 * tt, "cum_ms": 1e3 * ct, "calls": nc, "where": where} for tt, ct, nc, where in rows[:top]]


def kernel_table(step, iters: int, top: int = 14) -> dict:
    """GPU kernel time of ``iters`` calls of ``step`` (torch.profiler): per step, the kernels' summed
    time and count against the wall time, and the kernels that take most of it."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / iters
    by_name: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            by_name.setdefault(ev.name, []).append(ev.device_time)  # microseconds
    total = sum(sum(v) for v in by_name.values()) / iters
    count = sum(len(v) for v in by_name.values()) / iters
    rows = sorted(((sum(v) / iters, len(v) / iters, name) for name, v in by_name.items()), reverse=True)
    print(f"  kernels per step: {count:.0f}, GPU time {total / 1e3:.3f} ms of wall {1e3 * wall:.3f} ms "
          f"({1e-3 * total / wall:.0%} busy)")
    for us, n, name in rows[:top]:
        print(f"    {us / 1e3:7.3f} ms  x{n:5.0f}  {name[:110]}")
    return {"wall_ms": 1e3 * wall, "kernel_ms": total / 1e3, "kernels_per_step": count,
            "top": [{"ms": us / 1e3, "calls": n, "name": name[:200]} for us, n, name in rows[:top]]}


def gemm_points(mc, dtype=torch.bfloat16, batches=(1, 8, 64), iters: int = 200) -> list[dict]:
    """Each linear layer's GEMM alone (F.linear, the model's call) at decode batch sizes: achieved
    HBM bandwidth of its weight read, the bound a decode step's linear layers run against."""
    import torch.nn.functional as F

    shapes = {"qkv": (mc.q_size + 2 * mc.kv_size, mc.hidden_size), "o": (mc.hidden_size, mc.q_size),
              "gate_up": (2 * mc.intermediate_size, mc.hidden_size), "down": (mc.hidden_size, mc.intermediate_size),
              "lm_head": (mc.vocab_size, mc.hidden_size)}
    out = []
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(4)]  # rotate: no L2 reuse
        for b in batches:
            x = torch.randn(b, k, device="cuda", dtype=dtype)
            for w in ws:
                F.linear(x, w)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(iters):
                F.linear(x, ws[i % 4])
            end.record()
            torch.cuda.synchronize()
            us = 1e3 * start.elapsed_time(end) / iters
            tbps = 2 * n * k / (us * 1e-6) / 1e12
            out.append({"gemm": name, "n": n, "k": k, "batch": b, "us": us, "tbps": tbps})
            print(f"gemm {name:8s} [{b:3d} x {k}] x [{k} x {n}]: {us:7.1f} us, {tbps:.2f} TB/s", flush=True)
        del ws
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=int, default=2048, help="prompt tokens of each timed step")
    ap.add_argument("--splits", default="1,2,4,8,16", help="chunks per step")
    ap.add_argument("--histories", default="0,2048,8192", help="history of every chunk (tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="auto",
                    help="FlashInfer prefill backends to time (auto, fa2, fa3; comma-separated)")
    ap.add_argument("--decode-batches", default="1,8,64")
    ap.add_argument("--decode-context", type=int, default=4096)
    ap.add_argument("--decode-iters", type=int, default=20)
    ap.add_argument("--skinny", default="on", help="decode with the few-row linear kernel: on, off or on,off "
                    "(both: the baseline in the same run; the decode graphs are captured again for each)")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    ap.add_argument("--hbm-tbps", type=float, default=HBM_TBPS)
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also a kernel table of STEPS decode steps per batch (torch.profiler)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                    help="also where STEPS decode steps per batch spend host time (cProfile)")
    ap.add_argument("--after-decode", type=int, default=1024, metavar="TOKENS",
                    help="then a decode-only step followed by a step of TOKENS prompt tokens, with and without "
                    "the decodes, launched ahead and not (0: skip)")
    ap.add_argument("--gemm", action="store_true", help="also each linear layer's GEMM alone (CUDA)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.splits = [int(x) for x in args.splits.split(",") if x]
    args.histories = [int(x) for x in args.histories.split(",")]
    args.decode_batches = [int(x) for x in args.decode_batches.split(",") if x]
    args.backends = [b for b in args.backends.split(",") if b]
    args.skinny = [x for x in args.skinny.split(",") if x in ("on", "off")] or ["on"]

    from conflux_cluster.engine.profiling.harness import _Harness, engine_adapters

    ex, mc, attn = build(args)
    h = _Harness(ex, 1, mc.vocab_size, random.Random(0), *engine_adapters(), setup_tokens=8192)
    h.settle()
    result = {"model": args.model, "device": args.device, "budget": args.budget,
              "prefill_kernel": kernel_of(attn), "chunks": chunk_points(args, h, attn, mc)}
    result["prefill_kernel_after_validation"] = kernel_of(attn)
    if args.decode_batches:
        result["decode"] = decode_points(args, h, mc)
        if args.after_decode:
            result["after_decode"] = after_decode_points(args, h)
    if args.gemm:
        result["gemm"] = gemm_points(mc)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    ex.shutdown()
    return result

