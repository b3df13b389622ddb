"""Attention-region measurements of the GPU benchmark (benchmarks/steps/xp.py): the XP attention call
alone (paper Fig. 14a analog) and the decode GreenContext sizing of paper §6.1."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from conflux_cluster.engine.contracts.step import PrefillSlice, StepPlan
from conflux_cluster.engine.xp.attention import XPAttention
from conflux_cluster.engine.xp.comm import XPGroups
from conflux_cluster.engine.xp.meta import build_step_meta
from conflux_cluster.engine.xp.modes import XPMode
from benchmarks.steps.xp_instance import Ctx, Instance, profile_into, release, slowest, sync


def calibrate_decode_sms(ctx: Ctx, groups: XPGroups, world_group,
                         candidates: tuple[int, ...] = (8, 16, 24, 32, 48, 64)) -> dict:
    """Paper §6.1: the fewest SMs for the decode stream that keep >= 90% of its standalone speed
    (decode attention alone, Fig. 13 decode load, plain stream vs GreenContexts of k SMs)."""
    sz, w = ctx.sizes, ctx.world
    inst = Instance(ctx, XPMode.XP, w, 1, groups, sz.decodes_per_gpu * (sz.decode_ctx + 256) + 4096)
    dec = [[f"d{r}_{i}" for i in range(sz.decodes_per_gpu)] for r in range(w)]
    inst.add_resident_decodes(dec, sz.decode_ctx)
    plan = StepPlan(0, decode=dec)
    scale = ctx.dims.head_dim ** -0.5
    alone = region_time(ctx, inst, XPAttention(inst.heads, inst.kv, groups, scale, XPMode.XP), plan, world_group)
    times = {}
    for k in candidates:
        attn = XPAttention(inst.heads, inst.kv, groups, scale, XPMode.XP, k)
        if attn._green is None:  # GreenContext unavailable: nothing to calibrate
            break
        times[k] = region_time(ctx, inst, attn, plan, world_group)
    ok = [k for k, t in times.items() if t <= alone / 0.9]
    chosen = min(ok) if ok else max(times, default=0)
    inst = None
    release(ctx)
    out = {"standalone_ms_per_layer": round(alone * 1e3, 4),
           "green_ms_per_layer": {str(k): round(t * 1e3, 4) for k, t in times.items()}, "chosen_sms": chosen}
    if ctx.rank == 0:
        print(f"  [green calibration] {out}", flush=True)
    return out


def attention_region_sweep(ctx: Ctx, groups: XPGroups, world_group) -> dict:
    """Fig. 14(a) analog: one 8K prefill chunk (SP over all ranks) with D decodes/GPU at 8K context;
    the attention region (XP attention call, all layers) alone: prefill path only, decode path only,
    serialized (xp-no-overlap) and overlapped (xp, and xp in GreenContexts)."""
    sz, w, out = ctx.sizes, ctx.world, {}
    for per_gpu in ctx.region_decodes:
        pool = per_gpu * (sz.decode_ctx + 256) + 2 * sz.prefills[0] + 4096
        inst = Instance(ctx, XPMode.XP, w, 1, groups, pool)
        dec = [[f"d{r}_{i}" for i in range(per_gpu)] for r in range(w)]
        inst.add_resident_decodes(dec, sz.decode_ctx)
        share = sz.prefills[0] // w
        slices = [PrefillSlice("p", r, r * share, (r + 1) * share) for r in range(w)]
        plans = {"prefill_only": StepPlan(0, prefill=slices, decode=[[] for _ in range(w)]),
                 "decode_only": StepPlan(0, decode=dec), "both": StepPlan(0, prefill=slices, decode=dec)}
        row = {}
        for name, plan in plans.items():
            modes = [("serialized", XPMode.XP_NO_OVERLAP, None)]
            if name == "both":
                modes += [("overlapped", XPMode.XP, None)] + [(f"green{k}", XPMode.XP, k) for k in ctx.green_sms]
            for label, mode, sms in modes:
                attn = XPAttention(inst.heads, inst.kv, groups, ctx.dims.head_dim ** -0.5, mode, sms)
                key = name if name != "both" else label
                row[key] = round(1e3 * region_time(ctx, inst, attn, plan, world_group), 3)
                if name == "both" and per_gpu == max(ctx.region_decodes):
                    profile_into(ctx, f"attention region {label}, {per_gpu} decodes/GPU, all layers",
                                 lambda: region_time(ctx, inst, attn, plan, world_group, reps=1))
        p, d = row["prefill_only"], row["decode_only"]
        row["ideal_ms"] = round(max(p, d), 3)
        row["overlap_speedup"] = round(row["serialized"] / row["overlapped"], 3)
        gap = row["serialized"] - row["ideal_ms"]
        row["gap_closed"] = round((row["serialized"] - row["overlapped"]) / gap, 3) if gap > 0 else None
        out[f"{per_gpu}_decodes_per_gpu"] = row
        if ctx.rank == 0:
            print(f"  [attention region, {per_gpu} decodes/GPU, ms per layer] {row}", flush=True)
        inst = None  # drop the pool before the next load
        release(ctx)
    return out


def region_time(ctx: Ctx, inst: Instance, attn: XPAttention, plan: StepPlan, world_group, reps: int = 7) -> float:
    """Median seconds per layer of ``attn`` over every layer for ``plan`` (slowest rank)."""
    meta = build_step_meta(plan, inst.groups.rank, False)
    attn.begin_step(meta)
    t = meta.num_local_sp + len(meta.local_decode)
    h, d = inst.heads.tp_shard, ctx.dims.head_dim
    g = torch.Generator(device=ctx.device).manual_seed(1)
    q = torch.randn(t, h.num_q, d, device=ctx.device, dtype=ctx.dtype, generator=g)
    k = torch.randn(t, h.num_kv, d, device=ctx.device, dtype=ctx.dtype, generator=g)
    v = torch.randn_like(k)
    times = []
    for i in range(reps + 2):  # the first two are warm-ups
        sync(ctx)
        if world_group is not None:
            dist.barrier(group=world_group)
        t0 = time.perf_counter()
        for layer in range(ctx.dims.layers):
            attn(layer, q, k, v, meta)
        sync(ctx)
        if i >= 2:
            times.append(slowest(time.perf_counter() - t0, world_group, ctx) / ctx.dims.layers)
    return statistics.median(times)
