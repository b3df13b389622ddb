"""One XP instance inside the GPU benchmark, and the scenarios it runs (benchmarks/steps/xp.py).

``Ctx`` is one process's view of the run (device, sizes, options, models by TP size); ``Instance``
runs StepPlans through the engine's XP attention and KV pool on this device; the scenario functions
measure the issue's figures (decode roofline, prefill MFU, prefill under decode load).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from conflux_cluster.engine.contracts.step import DecodeTransition, PrefillSlice, StepPlan
from conflux_cluster.engine.xp.attention import XPAttention
from conflux_cluster.engine.xp.comm import XPGroups
from conflux_cluster.engine.xp.heads import DeviceHeads
from conflux_cluster.engine.xp.kv import XPKVCache
from conflux_cluster.engine.xp.meta import build_step_meta
from conflux_cluster.engine.xp.modes import XPMode
from benchmarks.steps.xp_model import HBM_TBPS, PEAK_TFLOPS, Dims, Model, Sizes


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
    models: dict[int, Model] = field(default_factory=dict)  # TP size -> weights (kept: graphs stay captured)

    def model(self, heads: DeviceHeads, groups: XPGroups, tp: int) -> Model:
        if tp not in self.models:
            self.models[tp] = Model(self.dims, heads, groups.tp_rank, tp, groups.tp, self.device, self.dtype)
        return self.models[tp]


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
