#!/usr/bin/env python
"""XP on GPUs: the issue's benchmarks with Llama-3.1-8B dimensions and random bf16 weights.

    python benchmarks/bench_xp_gpu.py --out results/xp_gpu.json          # all visible GPUs (1 or 2 used)
    python benchmarks/bench_xp_gpu.py --tiny --out /tmp/xp_tiny.json     # CPU/gloo smoke run (tiny dims)
    python benchmarks/bench_xp_gpu.py --cuda-graphs --out results/xp_graphs.json   # graphs A/B only

Figures (printed, and written as JSON to ``--out``):
  decode      1 GPU, batch 64, 4K context: iteration time vs the HBM roofline (bytes read / 4.3 TB/s)
  prefill     1 GPU, one 8K prompt in one chunk: MFU vs 790 TFLOP/s
  sp_scaling  a 32K prefill under 24 decodes/GPU at 8K context, 100 ms TBT budget: SP1 vs SP2 time
  fig13       per mode (xp, xp-no-overlap, uniform-sp, no-cobatch, uniform-tp): 24 decodes/GPU at 8K
              plus one injected 8K and one 32K prefill under the TBT budget; completion times, ratios
  cuda_graphs (--cuda-graphs; replaces the figures above) decode roofline and fig13 ``xp``, each
              eager and with piecewise CUDA graphs of the shared linears (engine/cuda_graphs.py,
              buckets up to --graph-max-tokens; larger batches eager), in the same run

The model is a plain-PyTorch Llama stack written here (the engine's model imports pydantic, which
the GPU machine lacks); attention is the engine's XP attention (engine/xp), imported without the
package __init__ chain. Chunk sizes follow the TBT budget with a feedback rule: next chunk =
chunk * budget / measured iteration time (slowest rank), like a scheduler with a perfect estimator.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import engine_only  # noqa: E402,F401  (before any conflux_cluster import: no pydantic / Ray needed)

from conflux_cluster.engine.cuda_graphs import PiecewiseCudaGraphs, default_buckets  # noqa: E402
from conflux_cluster.engine.plan import DecodeTransition, PrefillSlice, StepPlan  # noqa: E402
from conflux_cluster.engine.xp.attention import XPAttention  # noqa: E402
from conflux_cluster.engine.xp.comm import XPGroups  # noqa: E402
from conflux_cluster.engine.xp.heads import DeviceHeads  # noqa: E402
from conflux_cluster.engine.xp.kv import XPKVCache  # noqa: E402
from conflux_cluster.engine.xp.launch import host_store, join_group  # noqa: E402
from conflux_cluster.engine.xp.meta import XPMode, build_step_meta  # noqa: E402

PEAK_TFLOPS = 790.0  # bf16 dense GEMM ceiling measured on H200 (DESIGN §6)
HBM_TBPS = 4.3  # device copy ceiling (DESIGN §6)


@dataclass(frozen=True)
class Dims:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    inter: int = 14336
    vocab: int = 128256
    theta: float = 500000.0


@dataclass(frozen=True)
class Sizes:
    """Workload sizes (the issue's numbers; --tiny scales them down for a CPU smoke run)."""

    decodes_per_gpu: int = 24
    decode_ctx: int = 8192
    prefills: tuple[int, ...] = (8192, 32768)  # fig13: injected together (FCFS order)
    long_prefill: int = 32768  # sp_scaling
    roofline_batch: int = 64
    roofline_ctx: int = 4096
    mfu_prompt: int = 8192
    budget_s: float = 0.100
    first_chunk: int = 2048  # per rank, first iteration (then the budget rule)
    min_chunk: int = 128
    block_size: int = 32


TINY_DIMS = Dims(layers=2, hidden=128, heads=8, kv_heads=2, head_dim=16, inter=256, vocab=512, theta=10000.0)
TINY_SIZES = Sizes(decodes_per_gpu=3, decode_ctx=64, prefills=(64, 256), long_prefill=256, roofline_batch=4,
                   roofline_ctx=64, mfu_prompt=128, budget_s=0.05, first_chunk=32, min_chunk=8, block_size=8)


# ---- the model (one device; TP applied by cutting weights at construction) ---------------
class Model:
    """Llama decoder stack with random weights; device shard t of a TP group of ``tp`` devices."""

    def __init__(self, dims: Dims, heads: DeviceHeads, tp_rank: int, tp: int, tp_group, device, dtype,
                 seed: int = 0) -> None:
        self.d, self.heads, self.tp_group = dims, heads, tp_group if tp > 1 else None
        g = torch.Generator(device=device).manual_seed(seed)
        s, hd = heads.tp_shard, dims.head_dim
        base, extra = divmod(dims.inter, tp)
        self.inter = base + (1 if tp_rank < extra else 0)

        def w(*shape):
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

        self.embed = w(dims.vocab, dims.hidden)
        self.lm_head = w(dims.vocab, dims.hidden)
        self.layers = []
        for _ in range(dims.layers):
            self.layers.append(dict(
                qkv=w((s.num_q + 2 * s.num_kv) * hd, dims.hidden), o=w(dims.hidden, s.num_q * hd),
                gu=w(2 * self.inter, dims.hidden), down=w(dims.hidden, self.inter),
                n1=torch.ones(dims.hidden, device=device, dtype=dtype),
                n2=torch.ones(dims.hidden, device=device, dtype=dtype)))
        self.inv_freq = 1.0 / (dims.theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
        self.graphs: PiecewiseCudaGraphs | None = None  # the active runner (enable_graphs; tp == 1 only)
        self._runners: dict[int, PiecewiseCudaGraphs] = {}  # max_tokens -> captured runner
        self.use_graphs = False

    def enable_graphs(self, max_tokens: int) -> float:
        """Build and capture the piecewise graphs (once); returns the capture seconds."""
        if self.tp_group is not None:
            raise ValueError("CUDA graphs are not used with TP (the all-reduce would be captured)")
        t0 = time.perf_counter()
        if max_tokens not in self._runners:
            dev = self.embed.device
            self._runners[max_tokens] = PiecewiseCudaGraphs(
                self.segments(), lambda b: (torch.zeros(b, dtype=torch.long, device=dev),
                                            torch.zeros(b, dtype=torch.long, device=dev)),
                default_buckets(max_tokens), dev)
            self._runners[max_tokens].capture()
        self.graphs = self._runners[max_tokens]
        self.use_graphs = True
        return time.perf_counter() - t0

    def segments(self) -> list:
        """forward() cut at its attention calls (engine/cuda_graphs.py contract; carry = x, cos, sin)."""
        hd, s = self.d.head_dim, self.heads.tp_shard

        def qkv(p, x, cos, sin):
            t = x.shape[0]
            q, k, v = F.linear(self._norm(x, p["n1"]), p["qkv"]).split(
                [s.num_q * hd, s.num_kv * hd, s.num_kv * hd], -1)
            return (self._rope(q.view(t, s.num_q, hd), cos, sin), self._rope(k.view(t, s.num_kv, hd), cos, sin),
                    v.view(t, s.num_kv, hd))

        def finish(p, a, x):
            x = x + F.linear(a.reshape(a.shape[0], s.num_q * hd), p["o"])
            gate, up = F.linear(self._norm(x, p["n2"]), p["gu"]).split(self.inter, -1)
            return x + F.linear(F.silu(gate) * up, p["down"])

        def head(ids, pos):
            x = self.embed[ids]
            cos, sin = self._cos_sin(pos, x.dtype)
            return (*qkv(self.layers[0], x, cos, sin), x, cos, sin)

        def middle(i):
            def seg(a, x, cos, sin):
                x = finish(self.layers[i - 1], a, x)
                return (*qkv(self.layers[i], x, cos, sin), x, cos, sin)
            return seg

        def tail(a, x, cos, sin):
            return (finish(self.layers[-1], a, x),)

        return [head, *(middle(i) for i in range(1, len(self.layers))), tail]

    def _cos_sin(self, pos, dtype):
        f = pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((f, f), -1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def linear_bytes(self) -> int:
        """Bytes of every weight a decode step reads (linears + norms + lm_head)."""
        per = sum(t.numel() * t.element_size() for t in self.layers[0].values())
        return per * len(self.layers) + self.lm_head.numel() * self.lm_head.element_size()

    def linear_params(self) -> int:
        return sum(self.layers[0][k].numel() for k in ("qkv", "o", "gu", "down")) * len(self.layers)

    @staticmethod
    def _norm(x, wt, eps=1e-5):
        xf = x.float()
        return wt * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    @staticmethod
    def _rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _reduce(self, x):
        if self.tp_group is not None:
            dist.all_reduce(x, group=self.tp_group)
        return x

    @torch.inference_mode()
    def forward(self, ids, pos, attn, meta, sample_rows):
        # ids, pos: [T]; returns logits [S, V] of sample_rows
        if self.use_graphs:  # shared linears replayed from CUDA graphs, attention eager
            (x,) = self.graphs.run((ids, pos), lambda i, q, k, v: attn(i, q, k, v, meta))
            return F.linear(x[sample_rows], self.lm_head).float()
        hd, s = self.d.head_dim, self.heads.tp_shard
        x = self.embed[ids]  # [T, hidden]
        cos, sin = self._cos_sin(pos, x.dtype)
        t = ids.shape[0]
        for i, p in enumerate(self.layers):
            h = self._norm(x, p["n1"])
            q, k, v = F.linear(h, p["qkv"]).split([s.num_q * hd, s.num_kv * hd, s.num_kv * hd], -1)
            q = self._rope(q.view(t, s.num_q, hd), cos, sin)
            k = self._rope(k.view(t, s.num_kv, hd), cos, sin)
            o = attn(i, q, k, v.view(t, s.num_kv, hd), meta)  # [T, hq, D]
            x = x + self._reduce(F.linear(o.reshape(t, s.num_q * hd), p["o"]))
            h = self._norm(x, p["n2"])
            gate, up = F.linear(h, p["gu"]).split(self.inter, -1)
            x = x + self._reduce(F.linear(F.silu(gate) * up, p["down"]))
        return F.linear(x[sample_rows], self.lm_head).float()


# ---- one XP instance inside the benchmark ------------------------------------------------
class Instance:
    """N logical ranks x tp devices (this process is one device) running StepPlans in a mode."""

    def __init__(self, ctx, mode: XPMode, num_ranks: int, tp: int, groups: XPGroups, pool_tokens: int,
                 decode_sms: int | None = None) -> None:
        self.ctx, self.mode, self.n, self.groups = ctx, mode, num_ranks, groups
        d = ctx.dims
        self.heads = DeviceHeads.build(d.heads, d.kv_heads, num_ranks, tp, groups.rank, groups.tp_rank)
        self.model = ctx.model(self.heads, groups, tp)
        bs = ctx.sizes.block_size
        blocks = pool_tokens // bs + 64
        self.kv = XPKVCache(d.layers, blocks, bs, self.heads.num_kv, self.heads.sp_shard.num_kv, d.head_dim,
                            ctx.dtype, ctx.device)
        self.attn = XPAttention(self.heads, self.kv, groups, d.head_dim ** -0.5, mode, decode_sms)
        self.green = self.attn._green is not None  # the GreenContext was really created

    def add_resident_decodes(self, rids_per_rank: list[list[str]], ctx_len: int) -> None:
        """Decodes whose KV already exists (zeros: timing only) in the mode's layout."""
        for r, rids in enumerate(rids_per_rank):
            for rid in rids:
                if self.mode == XPMode.UNIFORM_SP:  # head-sharded on every rank
                    self.kv.reserve_prefill(rid, ctx_len)
                    self.kv.advance(rid, ctx_len, prefill=True)
                elif r == self.groups.rank:
                    self.kv.reserve_decode(rid, ctx_len)
                    self.kv.advance(rid, ctx_len, prefill=False)

    def _run(self, plan: StepPlan) -> None:
        usp = self.mode == XPMode.UNIFORM_SP
        sp_pos = {rid: self.kv.prefill_len(rid) for ids in plan.decode for rid in ids} if usp else None
        meta = build_step_meta(plan, self.groups.rank, usp, sp_pos)
        self.attn.begin_step(meta)
        if plan.is_empty():
            self.attn.end_step(meta)
            return
        pos = [p for s in plan.prefill if s.rank == self.groups.rank for p in range(s.start, s.end)]
        n_pre = len(pos)
        for rid in plan.decode[self.groups.rank]:
            pos.append(self.kv.prefill_len(rid) if usp else self.kv.decode_len(rid))
        dev = self.ctx.device
        ids = torch.randint(0, self.ctx.dims.vocab, (len(pos),), device=dev)
        rows = list(range(n_pre, len(pos)))
        if n_pre:
            rows.append(n_pre - 1)
        self.model.forward(ids, torch.tensor(pos, device=dev), self.attn, meta,
                           torch.tensor(rows, dtype=torch.long, device=dev))
        self.attn.end_step(meta)

    def step(self, plan: StepPlan, world_group) -> float:
        """Run one iteration; seconds of the slowest device (no-cobatch: prefill + decode pass)."""
        sync(self.ctx)
        t0 = time.perf_counter()
        if self.mode == XPMode.NO_COBATCH and plan.prefill and any(plan.decode):
            self._run(StepPlan(plan.step, plan.prefill, [[] for _ in plan.decode], plan.transitions, plan.finished))
            self._run(StepPlan(plan.step, [], plan.decode))
        else:
            self._run(plan)
        sync(self.ctx)
        return slowest(time.perf_counter() - t0, world_group, self.ctx)


@dataclass
class Ctx:
    dims: Dims
    sizes: Sizes
    device: torch.device
    dtype: torch.dtype
    world: int
    rank: int
    green_sms: tuple[int, ...] = ()  # also run xp with decode attention in GreenContexts of these SM counts
    repeats: int = 1  # measured runs per configuration (medians reported)
    region_decodes: tuple[int, ...] = (8, 16, 24, 32)  # attention-region sweep: decodes per GPU
    profile: str | None = None  # file to append torch.profiler kernel tables to (rank 0)
    graphs: int = 0  # >0: scenarios replay the shared linears from CUDA graphs up to this many tokens
    green_auto: bool = False  # calibrate the decode GreenContext size (paper §6.1) and run xp with it
    _models: dict = field(default_factory=dict)  # tp -> Model (random weights; kept: graphs stay captured)

    @property
    def _model(self) -> tuple | None:
        """(tp, Model) of the most recently built model (the decode/graphs phases use it)."""
        return next(reversed(self._models.items())) if self._models else None

    def model(self, heads: DeviceHeads, groups: XPGroups, tp: int) -> Model:
        if tp not in self._models:
            self._models[tp] = Model(self.dims, heads, groups.tp_rank, tp, groups.tp, self.device, self.dtype)
        return self._models[tp]


def sync(ctx: Ctx) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def profile_into(ctx: Ctx, title: str, fn, rows: int = 25) -> None:
    """Run ``fn`` under torch.profiler and append its top CUDA kernels to ``ctx.profile`` (rank 0)."""
    if not ctx.profile or ctx.device.type != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(ctx)
    if ctx.rank == 0:
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)
        with open(ctx.profile, "a") as f:
            f.write(f"\n==== {title}\n{table}\n")


def slowest(t: float, group, ctx: Ctx) -> float:
    if group is None:
        return t
    x = torch.tensor([t], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return float(x.item())


def release(ctx: Ctx) -> None:
    """Return freed KV pools to the device (call after dropping the last Instance reference)."""
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


# ---- scenarios ---------------------------------------------------------------------------
def prefill_under_decodes(ctx: Ctx, inst: Instance, prefills: list[int], world_group, chunk: int) -> dict:
    """Decodes on every logical rank + prefills chunked under the TBT budget; completion times.

    ``chunk``: prefill tokens per rank in the first iteration; afterwards the budget rule. Returns
    ``steady_chunk``: the rule's chunk after the last iteration that used every rank's budget (the
    next run starts there, so a measured run has no ramp-up from a cold guess).
    """
    sz, n = ctx.sizes, inst.n
    dec = [[f"d{r}_{i}" for i in range(sz.decodes_per_gpu * (ctx.world // n if n == 1 and
                                                              inst.mode == XPMode.UNIFORM_TP else 1))]
           for r in range(n)]
    inst.add_resident_decodes(dec, sz.decode_ctx)
    todo = [[f"p{i}", length, 0] for i, length in enumerate(prefills)]  # rid, length, computed
    t_now, done, times, step, finished, steady = 0.0, {}, [], 0, [], chunk
    while todo:
        plan = StepPlan(step, decode=[list(d) for d in dec], finished=finished)
        finished = []
        budget = [chunk] * n
        for req in todo:
            for r in range(n):
                take = min(budget[r], req[1] - req[2])
                if take > 0:
                    plan.prefill.append(PrefillSlice(req[0], r, req[2], req[2] + take))
                    req[2] += take
                    budget[r] -= take
            if req[2] == req[1]:
                plan.transitions.append(DecodeTransition(req[0], step % n))
        dt = inst.step(plan, world_group)
        times.append(dt)
        t_now += dt
        for req in [q for q in todo if q[2] == q[1]]:
            done[req[0]] = t_now
            finished.append(req[0])
            todo.remove(req)
        chunk = max(sz.min_chunk, int(chunk * min(2.0, sz.budget_s / dt) * 0.97) // 16 * 16)
        if not any(budget):
            steady = chunk
        step += 1
    inst.step(StepPlan(step, decode=[[] for _ in range(n)], finished=finished), world_group)
    return {"completion_s": {str(length): round(done[f"p{i}"], 4) for i, length in enumerate(prefills)},
            "iterations": len(times), "mean_iter_ms": round(1e3 * statistics.mean(times), 2),
            "max_iter_ms": round(1e3 * max(times), 2), "steady_chunk": steady}


def decode_roofline(ctx: Ctx) -> dict:
    sz, d = ctx.sizes, ctx.dims
    inst = Instance(ctx, XPMode.XP, 1, 1, XPGroups.single(), sz.roofline_batch * (sz.roofline_ctx + 64))
    rids = [f"d{i}" for i in range(sz.roofline_batch)]
    inst.add_resident_decodes([rids], sz.roofline_ctx)
    times = [inst.step(StepPlan(i, decode=[list(rids)]), None) for i in range(13)][3:]
    t = statistics.median(times)
    profile_into(ctx, f"decode step, batch {sz.roofline_batch} at {sz.roofline_ctx}, {d.layers} layers",
                 lambda: inst.step(StepPlan(13, decode=[list(rids)]), None))
    elem = torch.empty((), dtype=ctx.dtype).element_size()
    kv_bytes = sz.roofline_batch * sz.roofline_ctx * d.layers * 2 * d.kv_heads * d.head_dim * elem
    total = inst.model.linear_bytes() + kv_bytes
    roof = total / (HBM_TBPS * 1e12)
    return {"batch": sz.roofline_batch, "context": sz.roofline_ctx, "iter_ms": round(t * 1e3, 3),
            "bytes_gb": round(total / 1e9, 2), "roofline_ms": round(roof * 1e3, 3),
            "ratio_to_roofline": round(t / roof, 3), "target_ratio": 1.25}


def prefill_mfu(ctx: Ctx) -> dict:
    sz, d = ctx.sizes, ctx.dims
    n_tok = sz.mfu_prompt
    inst = Instance(ctx, XPMode.XP, 1, 1, XPGroups.single(), n_tok + 64)
    times = []
    for i in range(4):  # the first is a warm-up
        times.append(inst.step(StepPlan(2 * i, prefill=[PrefillSlice(f"p{i}", 0, 0, n_tok)], decode=[[]]), None))
        inst.step(StepPlan(2 * i + 1, decode=[[]], finished=[f"p{i}"]), None)
    t = statistics.median(times[1:])

    def one():
        inst.step(StepPlan(8, prefill=[PrefillSlice("pp", 0, 0, n_tok)], decode=[[]]), None)
        inst.step(StepPlan(9, decode=[[]], finished=["pp"]), None)

    profile_into(ctx, f"prefill of {n_tok} tokens, {d.layers} layers", one)
    flops = 2 * inst.model.linear_params() * n_tok + 2 * d.hidden * d.vocab  # linears + one lm_head row
    flops += d.layers * 2 * n_tok * n_tok * d.heads * d.head_dim  # causal QK^T and PV (half of 4 T^2 D H)
    return {"prompt": n_tok, "time_ms": round(t * 1e3, 2), "tflops": round(flops / t / 1e12, 1),
            "mfu": round(flops / t / 1e12 / PEAK_TFLOPS, 3), "peak_tflops": PEAK_TFLOPS, "target_mfu": 0.60}


def _pool_tokens(sz: Sizes) -> int:
    """Decodes' KV + head-sharded prefill KV + the decode copy made at a transition."""
    return sz.decodes_per_gpu * (sz.decode_ctx + 256) + 2 * sum(sz.prefills) + 4096


def run_scenario(ctx: Ctx, mode: XPMode, n: int, tp: int, groups: XPGroups, prefills: list[int],
                 world_group, decode_sms: int | None = None) -> dict:
    """The whole scenario once as a warm-up (kernels compiled, allocator and NCCL warm, chunk rule
    converged), then the measured run on the same instance starting from the converged chunk."""
    pool = _pool_tokens(ctx.sizes) * (tp if mode == XPMode.UNIFORM_TP else 1)
    inst = Instance(ctx, mode, n, tp, groups, pool, decode_sms)
    use_graphs(ctx, inst.model, tp)
    warm = prefill_under_decodes(ctx, inst, prefills, world_group, ctx.sizes.first_chunk)
    out = prefill_under_decodes(ctx, inst, prefills, world_group, warm["steady_chunk"])
    if decode_sms:
        out["green_context"] = inst.green
    return out


def use_graphs(ctx: Ctx, model: Model, tp: int) -> None:
    """Piecewise CUDA graphs of the shared linears (``ctx.graphs`` tokens) where they apply (no TP)."""
    if ctx.graphs and tp == 1 and ctx.device.type == "cuda":
        model.enable_graphs(ctx.graphs)
    else:
        model.use_graphs = False


def median_runs(runs: list[dict]) -> dict:
    """Per prompt length: median completion over runs, plus every run."""
    keys = runs[0]["completion_s"]
    return {"completion_s": {k: round(statistics.median(r["completion_s"][k] for r in runs), 4) for k in keys},
            "min_s": {k: min(r["completion_s"][k] for r in runs) for k in keys},
            "max_s": {k: max(r["completion_s"][k] for r in runs) for k in keys}, "runs": runs}


def single_gpu_phase(ctx: Ctx) -> dict:
    out = {"decode": decode_roofline(ctx)}
    if ctx.graphs:  # the same decode step with the shared linears replayed from CUDA graphs
        ctx._model[1].enable_graphs(ctx.graphs)
        out["decode_graphs"] = decode_roofline(ctx)
        ctx._model[1].use_graphs = False
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
    del inst
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
        del inst
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


def graphs_phase(ctx: Ctx, max_tokens: int, big_tokens: int = 0, repeats: int = 1) -> dict:
    """Eager vs piecewise CUDA graphs in one run: decode roofline (rank 0) and fig13 ``xp``."""
    sz, w, out = ctx.sizes, ctx.world, {}
    if ctx.rank == 0:
        eager = decode_roofline(ctx)
        out["capture_s"] = round(ctx._model[1].enable_graphs(max_tokens), 2)
        graphed = decode_roofline(ctx)
        ctx._model[1].use_graphs = False
        out["decode"] = {"eager": eager, "graphs": graphed}
        print(f"  [decode] eager {eager['iter_ms']} ms, graphs {graphed['iter_ms']} ms "
              f"(roofline {eager['roofline_ms']} ms; capture {out['capture_s']} s)", flush=True)
        release(ctx)
    world = dist.group.WORLD if w > 1 else None
    groups = XPGroups(ctx.rank, 0, w, 1, sp=world) if w > 1 else XPGroups.single()
    if w > 1:
        dist.barrier()
        run_scenario(ctx, XPMode.XP, w, 1, groups, list(sz.prefills), world)  # discarded (one-time costs)
    model = ctx._model[1]
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


def main() -> None:
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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
