#!/usr/bin/env python
"""XP on GPUs: the issue's benchmarks with Llama-3.1-8B dimensions and random bf16 weights.

    python -m benchmarks.steps xp --out results/xp_gpu.json          # all visible GPUs (1 or 2 used)
    python -m benchmarks.steps xp --tiny --out /tmp/xp_tiny.json     # CPU/gloo smoke run (tiny dims)
    python -m benchmarks.steps xp --cuda-graphs --out results/xp_graphs.json   # graphs A/B only

Figures (printed, and written as JSON to ``--out``):
  decode      1 GPU, batch 64, 4K context: iteration time vs the HBM roofline (bytes read / 4.3 TB/s);
              with --graphs also with piecewise CUDA graphs
  prefill     1 GPU, one 8K prompt in one chunk: MFU vs 790 TFLOP/s
  sp_scaling  a 32K prefill under 24 decodes/GPU at 8K context, 100 ms TBT budget: SP1 vs SP2 time
  fig13       per mode (xp, xp-no-overlap, uniform-sp, no-cobatch, uniform-tp, xp in GreenContexts):
              24 decodes/GPU at 8K plus one injected 8K and one 32K prefill under the TBT budget;
              medians of --repeats interleaved runs, ratios to xp
  region      the attention call alone, 8K chunk + 8..32 decodes/GPU: serialized vs overlapped
              (Fig. 14a analog); --green-auto sizes the decode GreenContext first (paper 6.1)
  cuda_graphs (--cuda-graphs; replaces the figures above) decode roofline and fig13 ``xp``, each
              eager and with piecewise CUDA graphs of the shared linears, in the same run

Files: benchmarks/steps/xp_model.py (the model: plain PyTorch, random weights, mirrors the engine's model,
which needs pydantic, absent on the GPU machine), benchmarks/steps/xp_instance.py (one XP instance and the
scenarios), benchmarks/steps/xp_region.py (attention region, GreenContext sizing); this file: phases, worker
processes, summary. Attention, KV pool, Triton kernels and graph runner are the engine's
(engine/xp, engine/runtime/cuda_graphs.py). Chunk sizes follow the TBT budget with a feedback rule: next
chunk = chunk * budget / measured iteration time (slowest rank), like a scheduler with a perfect
estimator; with --layers the budget shrinks in proportion.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conflux_cluster.engine.runtime.cuda_graphs import default_buckets
from conflux_cluster.engine.xp.comm import XPGroups
from conflux_cluster.engine.xp.launch import host_store, join_group
from conflux_cluster.engine.xp.modes import XPMode
from benchmarks.steps.xp_instance import (Ctx, decode_roofline, median_runs, prefill_mfu, release,
                               run_scenario)
from benchmarks.steps.xp_model import TINY_DIMS, TINY_SIZES, Dims, Sizes
from benchmarks.steps.xp_region import attention_region_sweep, calibrate_decode_sms


def single_gpu_phase(ctx: Ctx) -> dict:
    out = {"decode": decode_roofline(ctx)}
    if ctx.graphs:  # the same decode step with the shared linears replayed from CUDA graphs
        ctx.models[1].enable_graphs(ctx.graphs)
        out["decode_graphs"] = decode_roofline(ctx)
        ctx.models[1].use_graphs = False
    release(ctx)
    out["prefill"] = prefill_mfu(ctx)
    release(ctx)
    sz, one = ctx.sizes, XPGroups.single()
    out["sp1_32k"] = median_runs([run_scenario(ctx, XPMode.XP, 1, 1, one, [sz.long_prefill], None)
                                  for _ in range(ctx.repeats)])
    if ctx.world == 1:  # the modes that exist on one GPU
        for mode in (XPMode.XP, XPMode.XP_NO_OVERLAP, XPMode.NO_COBATCH):
            out[f"fig13_1gpu_{mode.value}"] = median_runs([run_scenario(ctx, mode, 1, 1, one, list(sz.prefills), None)
                                                          for _ in range(ctx.repeats)])
        release(ctx)
        out["attention_region"] = attention_region_sweep(ctx, one, None)
    release(ctx)
    return out


FIG13_MODES = (XPMode.XP, XPMode.XP_NO_OVERLAP, XPMode.UNIFORM_SP, XPMode.NO_COBATCH, XPMode.UNIFORM_TP)


def multi_gpu_phase(ctx: Ctx) -> dict:
    sz, w = ctx.sizes, ctx.world
    world = dist.group.WORLD
    sp_groups = XPGroups(ctx.rank, 0, w, 1, sp=world)
    tp_groups = XPGroups(0, ctx.rank, 1, w, tp=world)
    out = {}
    if ctx.green_auto and ctx.device.type == "cuda":
        out["green_calibration"] = calibrate_decode_sms(ctx, sp_groups, world)
        if out["green_calibration"]["chosen_sms"]:
            ctx.green_sms = tuple(sorted(set(ctx.green_sms) | {out["green_calibration"]["chosen_sms"]}))
    configs = [(m.value, m, None) for m in FIG13_MODES] + [(f"xp-green{k}", XPMode.XP, k) for k in ctx.green_sms]
    runs: dict[str, list] = {name: [] for name, _, _ in configs}
    runs["sp2_32k"] = []
    for rep in range(ctx.repeats):  # configurations interleaved: drift hits all alike
        for name, mode, sms in configs:
            n, tp, groups = (1, w, tp_groups) if mode == XPMode.UNIFORM_TP else (w, 1, sp_groups)
            runs[name].append(run_scenario(ctx, mode, n, tp, groups, list(sz.prefills), world, sms))
            if mode == XPMode.XP and not sms:
                runs["sp2_32k"].append(run_scenario(ctx, mode, n, tp, groups, [sz.long_prefill], world))
            if ctx.rank == 0:
                print(f"  [rep {rep} {name}] {runs[name][-1]['completion_s']} "
                      f"iters {runs[name][-1]['iterations']} chunk {runs[name][-1]['steady_chunk']}", flush=True)
    out.update({name: median_runs(r) for name, r in runs.items()})
    release(ctx)
    out["attention_region"] = attention_region_sweep(ctx, sp_groups, world)
    return out


def graphs_phase(ctx: Ctx, max_tokens: int, big_tokens: int = 0, repeats: int = 1) -> dict:
    """Eager vs piecewise CUDA graphs in one run: decode roofline (rank 0) and fig13 ``xp``."""
    sz, w, out = ctx.sizes, ctx.world, {}
    if ctx.rank == 0:
        eager = decode_roofline(ctx)
        out["capture_s"] = round(ctx.models[1].enable_graphs(max_tokens), 2)
        graphed = decode_roofline(ctx)
        ctx.models[1].use_graphs = False
        out["decode"] = {"eager": eager, "graphs": graphed}
        print(f"  [decode] eager {eager['iter_ms']} ms, graphs {graphed['iter_ms']} ms "
              f"(roofline {eager['roofline_ms']} ms; capture {out['capture_s']} s)", flush=True)
        release(ctx)
    world = dist.group.WORLD if w > 1 else None
    groups = XPGroups(ctx.rank, 0, w, 1, sp=world) if w > 1 else XPGroups.single()
    if w > 1:
        dist.barrier()
        run_scenario(ctx, XPMode.XP, w, 1, groups, list(sz.prefills), world)  # discarded (one-time costs)
    model = ctx.models[1]
    configs = {"eager": None, f"graphs{max_tokens}": max_tokens}
    if big_tokens and big_tokens > max_tokens:
        configs[f"graphs{big_tokens}"] = big_tokens
    fig: dict = {name: [] for name in configs}
    for _ in range(repeats):  # configurations interleaved, so drift hits all alike
        for name, mt in configs.items():
            if mt is None:
                model.use_graphs = False
            else:
                model.enable_graphs(mt)
            before = (model.graphs.replays, model.graphs.eager_runs) if mt else (0, 0)
            r = run_scenario(ctx, XPMode.XP, w, 1, groups, list(sz.prefills), world)
            if mt:  # forwards (incl. the scenario's warm-up) that replayed graphs / ran eagerly
                r["graph_replays"] = model.graphs.replays - before[0]
                r["eager_forwards"] = model.graphs.eager_runs - before[1]
            fig[name].append(r)
            if ctx.rank == 0:
                print(f"  [fig13 xp {name}] {r}", flush=True)
    model.use_graphs = False
    out[f"fig13_xp_{w}gpu"] = {name: {"runs": runs, "median_completion_s": {
        k: round(statistics.median(x["completion_s"][k] for x in runs), 4) for k in runs[0]["completion_s"]}}
        for name, runs in fig.items()}
    out["buckets"] = list(default_buckets(max_tokens))
    return out


def _worker(rank: int, rdv, args, world: int, queue) -> None:
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        dims, sizes = (TINY_DIMS, TINY_SIZES) if args.tiny else (Dims(), Sizes())
        if args.layers:  # fewer layers: the TBT budget shrinks with them, so chunks keep their full-model size
            sizes = Sizes(**{**sizes.__dict__, "budget_s": sizes.budget_s * args.layers / dims.layers})
            dims = Dims(**{**dims.__dict__, "layers": args.layers})
        cuda = torch.cuda.is_available() and not args.tiny
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        if world > 1:
            join_group(rdv, rank)
        ctx = Ctx(dims, sizes, device, torch.bfloat16 if cuda else torch.float32, world, rank,
                  tuple(args.green_sms), args.repeats, tuple(args.region_decodes), args.profile,
                  0 if args.cuda_graphs else args.graphs, args.green_auto)
        res = {}
        if args.cuda_graphs:
            res["cuda_graphs"] = graphs_phase(ctx, args.graph_max_tokens, args.graph_big_tokens, args.repeats)
            if world > 1:
                dist.barrier()
            if rank == 0:
                queue.put(("ok", res))
            return
        if rank == 0:
            res["single_gpu"] = single_gpu_phase(ctx)
            print(f"  single-GPU phase done: {json.dumps(res['single_gpu'])}", flush=True)
        if world > 1:
            dist.barrier()
            res["multi_gpu"] = multi_gpu_phase(ctx)
            dist.barrier()
        if rank == 0:
            queue.put(("ok", res))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        import traceback
        queue.put(("err", f"rank {rank}: {e!r}\n{traceback.format_exc()}"))
        raise


def _only(d: dict) -> float:
    return next(iter(d["completion_s"].values()))


def summarize_graphs(g: dict) -> dict:
    d = g["decode"]
    out = {"decode_iter_ms_eager": d["eager"]["iter_ms"], "decode_iter_ms_graphs": d["graphs"]["iter_ms"],
           "decode_over_roofline_eager": d["eager"]["ratio_to_roofline"],
           "decode_over_roofline_graphs": d["graphs"]["ratio_to_roofline"],
           "decode_speedup": round(d["eager"]["iter_ms"] / d["graphs"]["iter_ms"], 3), "capture_s": g["capture_s"]}
    key = next(k for k in g if k.startswith("fig13_xp"))
    fig = g[key]
    for length, t in fig["eager"]["median_completion_s"].items():
        row = {name: c["median_completion_s"][length] for name, c in fig.items()}
        row.update({f"speedup_{n}": round(t / v, 3) for n, v in row.items() if n != "eager"})
        out[f"{key}_prefill_{length}_median_s"] = row
    return out


def summarize(res: dict) -> dict:
    if "cuda_graphs" in res:
        return summarize_graphs(res["cuda_graphs"])
    s = res["single_gpu"]
    out = {"decode_iter_over_roofline": s["decode"]["ratio_to_roofline"], "prefill_mfu": s["prefill"]["mfu"]}
    if "decode_graphs" in s:
        out["decode_iter_over_roofline_graphs"] = s["decode_graphs"]["ratio_to_roofline"]
    m = res.get("multi_gpu")
    if m:
        key = str(max(int(k) for k in m["xp"]["completion_s"]))
        xp = m["xp"]["completion_s"][key]
        for mode in ("xp-no-overlap", "uniform-sp", "no-cobatch", "uniform-tp") + tuple(
                k for k in m if k.startswith("xp-green")):
            out[f"{mode}_over_xp_prefill_{key}"] = round(m[mode]["completion_s"][key] / xp, 3)
        out["sp2_speedup_over_sp1_32k"] = round(_only(s["sp1_32k"]) / _only(m["sp2_32k"]), 3)
        out["attention_overlap_speedup"] = {k: r["overlap_speedup"] for k, r in m["attention_region"].items()}
    else:
        key = str(max(int(k) for k in s["fig13_1gpu_xp"]["completion_s"]))
        xp = s["fig13_1gpu_xp"]["completion_s"][key]
        for mode in ("xp-no-overlap", "no-cobatch"):
            out[f"1gpu_{mode}_over_xp_prefill_{key}"] = round(s[f"fig13_1gpu_{mode}"]["completion_s"][key] / xp, 3)
        out["attention_overlap_speedup"] = {k: r["overlap_speedup"] for k, r in s["attention_region"].items()}
    out["targets"] = {"xp-no-overlap_over_xp": ">=1.1", "uniform-sp_over_xp": ">=1.15",
                      "no-cobatch_over_xp": ">=1.3", "sp2_speedup_over_sp1": ">=1.95",
                      "decode_over_roofline": "<=1.25", "prefill_mfu": ">=0.60"}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible, at most 2)")
    ap.add_argument("--tiny", action="store_true", help="tiny dims on CPU/gloo (smoke test)")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (faster runs)")
    ap.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    ap.add_argument("--green-sms", type=int, nargs="*", default=[],
                    help="also run xp with decode attention in a torch.cuda.GreenContext of these many SMs")
    ap.add_argument("--graphs", type=int, default=0,
                    help="scenarios (all modes but uniform-tp) and the decode step also with piecewise CUDA "
                         "graphs of the shared linears, buckets up to this many tokens")
    ap.add_argument("--profile", default=None, help="append torch.profiler kernel tables to this text file")
    ap.add_argument("--green-auto", action="store_true",
                    help="calibrate the decode GreenContext size (fewest SMs with >= 90%% of standalone decode "
                         "speed, paper 6.1) and also run xp with it")
    ap.add_argument("--region-decodes", type=int, nargs="*", default=[8, 16, 24, 32],
                    help="attention-region sweep (Fig. 14a analog): decodes per GPU")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="only the A/B: decode roofline and fig13 xp, eager and with piecewise CUDA graphs")
    ap.add_argument("--graph-max-tokens", type=int, default=512, help="largest captured token count")
    ap.add_argument("--graph-big-tokens", type=int, default=0,
                    help="--cuda-graphs: also fig13 with buckets up to this many tokens (covers prefill chunks)")
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per configuration (medians reported)")
    args = ap.parse_args(argv)
    if args.tiny:
        world = args.gpus or 2
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --tiny for a CPU smoke test")
        world = min(args.gpus or torch.cuda.device_count(), torch.cuda.device_count(), 2)
    t0 = time.time()
    hw = {"torch": torch.__version__, "world": world,
          "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu"}
    print(f"bench_xp_gpu: {hw}", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store, rdv = host_store(world, "gloo" if args.tiny else "nccl", timeout_s=1200) if world > 1 else (None, None)
    procs = [ctx.Process(target=_worker, args=(r, rdv, args, world, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        status, res = queue.get(timeout=args.timeout)
    except Exception:  # noqa: BLE001 - queue.Empty: a hang (e.g. a collective that never matched)
        status, res = "err", f"no result within {args.timeout} s"
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.terminate()
    del store
    if status != "ok":
        sys.exit(f"benchmark failed:\n{res}")
    result = {"hardware": hw, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "command": " ".join(["python"] + sys.argv), "dims": (TINY_DIMS if args.tiny else Dims()).__dict__,
              "results": res, "summary": summarize(res), "wall_s": round(time.time() - t0, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {args.out} in {result['wall_s']} s")

