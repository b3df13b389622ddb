#!/usr/bin/env python
"""Where a burst's time goes, step by step: the offline engine with the product's defaults.

    python -m benchmarks.steps trace                       # llama-3.1-8b, all visible GPUs, 64 x 2048/128
    python -m benchmarks.steps trace --policy fcfs --budget 4096 --out $OUT/trace.json
    python -m benchmarks.steps trace --requests 22 --prompt 3400 --output 200 --late-prompt 24000 --late-at 40
                                        # a long prompt arrives while 22 requests decode: mixed steps

The engine is built as ``conflux serve`` builds an instance (EngineConfig defaults for the device,
estimator profile 'auto' resolved on the built executor: cached, else profiled now; warm-up), then
the burst runs through ``EngineCore.step`` with nothing else in the process. Per step: prefill
tokens, decodes, wall time (a step returns after its sampled tokens reach the host) and the
estimator's prediction. The summary gives the step-time coefficient of variation of same-shaped
steps (``step_time_cv``: host jitter) and splits the steps into prefill-carrying and decode-only and
sets each against its roofline: prefill-carrying steps against 2 x parameters FLOPs per token at
--peak-tflops per GPU (rank with the most tokens), decode-only steps against the weights plus the
KV they read at --hbm-tbps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from conflux_cluster.bench.roofline import param_count, roofline_limit
from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.scheduler.estimator import plan_batch_load


def build(args: argparse.Namespace) -> EngineCore:
    from conflux_cluster.engine.profiling.store import local_hardware_name, resolve_estimator_profile
    from conflux_cluster.engine.runtime.warmup import warm_up
    from conflux_cluster.engine.runtime.executor import instance_executor
    from conflux_cluster.engine.config import xp_topology

    sched = {k: v for k, v in (("policy", args.policy), ("max_num_batched_tokens", args.budget),
                               ("ttft_slo", args.ttft_slo), ("tbt_slo", args.tbt_slo)) if v is not None}
    # steps one at a time (not pipelined): each step's wall and execute time are its own
    extra = {"xp_mode": args.xp_mode} if args.xp_mode else {}
    cfg = EngineConfig(model=args.model, device=args.device, num_ranks=args.ranks, load_progress=False,
                       async_scheduling=False, **extra)
    cfg = xp_topology(cfg.model_copy(update={"scheduler": cfg.scheduler.model_copy(update=sched)}))
    src = resolve_model(cfg.model)
    executor = instance_executor(cfg, src)
    profile = resolve_estimator_profile(cfg, executor, local_hardware_name(cfg.device))
    cfg = cfg.model_copy(update={"scheduler": cfg.scheduler.model_copy(update={"estimator_profile": profile})})
    core = EngineCore(cfg, executor, source=src)
    print(cfg.describe(src.config, core.blocks_per_rank, core.max_model_len), flush=True)
    warm_up(core)
    return core


def predicted_s(core: EngineCore) -> float:
    load = plan_batch_load(core.last_plan, core.last_decode_context, core.config.num_ranks)
    return core.scheduler.estimator.estimate(load).total


class _TimedExecutor:
    """The engine's executor, timing each ``execute`` (the rest of a step is host work: schedule,
    update, detokenize)."""

    overlaps = False
    launches_ahead = False

    def __init__(self, inner) -> None:
        self.inner, self.last_s = inner, 0.0
        self.blocks_per_rank = inner.blocks_per_rank

    def execute(self, step_input):
        t0 = time.perf_counter()
        try:
            return self.inner.execute(step_input)
        finally:
            self.last_s = time.perf_counter() - t0

    def shutdown(self) -> None:
        self.inner.shutdown()


def profiled_step(core: EngineCore, args: argparse.Namespace, index: int) -> list:
    """One step under torch.profiler (this process's CUDA work: one-rank instances); its kernel
    table goes to ``--profile-out``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        outs = core.step()
        if cuda:
            torch.cuda.synchronize()
    plan = core.last_plan
    head = (f"== step {index}: prefill tokens {plan.prefill_tokens_per_rank()}, decodes "
            f"{plan.decode_tokens_per_rank()}, decode context {list(core.last_decode_context)}\n")
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=30, max_name_column_width=60)
    with open(args.profile_out, "a") as f:
        f.write(head + table + "\n")
    return outs


def run_burst(core: EngineCore, args: argparse.Namespace) -> list[dict]:
    gen = torch.Generator().manual_seed(args.seed)
    vocab = core.source.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    for i in range(args.requests):
        n = args.prompts[i % len(args.prompts)] if args.prompts else args.prompt
        core.add_request(GenerateRequest(f"b{i}", torch.randint(0, vocab, (n,), generator=gen).tolist(), params))
    timed = _TimedExecutor(core.executor)
    core.executor = timed
    steps, t_start = [], time.perf_counter()
    while core.has_unfinished():
        if len(steps) == args.late_at and args.late_prompt:  # one long prompt joins the running decodes
            core.add_request(GenerateRequest("late",
                                             torch.randint(0, vocab, (args.late_prompt,), generator=gen).tolist(),
                                             SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
        t0 = time.perf_counter()
        if len(steps) in args.profile_steps:
            outs = profiled_step(core, args, len(steps))
        else:
            outs = core.step()
        dt = time.perf_counter() - t0
        plan = core.last_plan
        steps.append({"t": t0 - t_start, "wall_s": dt, "execute_s": timed.last_s, "predicted_s": predicted_s(core),
                      "prefill": plan.prefill_tokens_per_rank(), "decode": plan.decode_tokens_per_rank(),
                      "decode_context": list(core.last_decode_context),
                      "tokens_out": sum(len(o.new_token_ids) for o in outs)})
    return steps


def summarize(steps: list[dict], core: EngineCore, args: argparse.Namespace) -> dict:
    mc = core.source.config
    n = len(steps[0]["prefill"])
    p, e = param_count(mc), 2  # bf16
    kv_token = 2 * mc.num_hidden_layers * mc.kv_size * e
    peak, bw = args.peak_tflops * 1e12, args.hbm_tbps * 1e12
    mixed = [s for s in steps if sum(s["prefill"])]
    dec = [s for s in steps if not sum(s["prefill"]) and sum(s["decode"])]

    def ideal(s: dict) -> float:
        tok = max(a + b for a, b in zip(s["prefill"], s["decode"]))
        return max(2 * p * tok / peak, (p * e + max(s["decode_context"], default=0) * kv_token) / bw)

    def part(ss: list[dict]) -> dict:
        if not ss:
            return {"steps": 0}
        wall = sum(s["wall_s"] for s in ss)
        ape = [abs(s["predicted_s"] - s["wall_s"]) / s["wall_s"] for s in ss]
        return {"steps": len(ss), "wall_s": wall, "ideal_s": sum(ideal(s) for s in ss),
                "host_s": wall - sum(s["execute_s"] for s in ss),  # outside execute: the GPU waits
                "median_step_ms": 1e3 * statistics.median(s["wall_s"] for s in ss),
                "median_execute_ms": 1e3 * statistics.median(s["execute_s"] for s in ss),
                "median_prefill_tokens": statistics.median(max(s["prefill"]) for s in ss),
                "median_decodes": statistics.median(sum(s["decode"]) for s in ss),
                "estimator_mape_percent": 100 * statistics.mean(ape)}

    total = sum(s["wall_s"] for s in steps)
    plain = [s for i, s in enumerate(steps) if i not in args.profile_steps]  # a profiled step is slower
    out_tokens = sum(s["tokens_out"] for s in steps)
    roof = roofline_limit(mc, args.requests, args.prompt, args.output, n, e, peak, bw)
    return {"total_s": total, "output_tok_s": out_tokens / total, "roofline_s": roof["total_s"],
            "measured_over_roofline": roof["total_s"] / total, "prefill_steps": part(mixed),
            "decode_only_steps": part(dec), "num_ranks": n, "step_time_cv": step_time_cv(plain)}


def engine_state(core: EngineCore) -> dict:
    """What can silently slow a step, read after the run (one in-process rank): the CUDA caching
    allocator's retries (each frees cached blocks, a device-wide synchronization) and whether the
    Triton paged decode kernel passed its first-use check (else decode attention gathers a padded copy)."""
    out: dict = {}
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        out["cuda_alloc_retries"] = stats.get("num_alloc_retries", 0)
        out["cuda_reserved_gib"] = stats.get("reserved_bytes.all.peak", 0) / 2**30
    executor = getattr(core.executor, "inner", core.executor)  # run_burst's timing wrapper
    attention = getattr(getattr(executor, "worker", None), "attention", None)
    if attention is not None and hasattr(attention, "_use_kernel"):
        out["paged_decode_kernel"] = attention._use_kernel
    return out


def step_time_cv(steps: list[dict], context_bucket: int = 1024, min_steps: int = 3) -> dict:
    """Jitter of identical iterations: steps grouped by shape (prefill tokens and decodes per rank,
    the longest decode context within ``context_bucket`` tokens), the coefficient of variation
    (stdev / mean) of each group's wall time; groups of at least ``min_steps`` steps."""
    groups: dict[tuple, list[float]] = {}
    for s in steps:
        key = (tuple(s["prefill"]), tuple(s["decode"]), max(s["decode_context"], default=0) // context_bucket)
        groups.setdefault(key, []).append(s["wall_s"])
    cvs = [(len(w), statistics.pstdev(w) / statistics.mean(w)) for w in groups.values() if len(w) >= min_steps]
    if not cvs:
        return {"groups": 0}
    n = sum(k for k, _ in cvs)
    return {"groups": len(cvs), "steps": n, "max_percent": 100 * max(c for _, c in cvs),
            "median_percent": 100 * statistics.median(c for _, c in cvs),
            "step_weighted_percent": 100 * sum(k * c for k, c in cvs) / n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ranks", type=int, default=max(1, torch.cuda.device_count()))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--policy", default=None, help="default: the engine's (slo)")
    ap.add_argument("--budget", type=int, default=None, help="max_num_batched_tokens (default: the engine's)")
    ap.add_argument("--xp-mode", default=None, help="default: the engine's (xp)")
    ap.add_argument("--prompts", default=None,
                    help="comma list of prompt lengths, cycled over the requests (uneven decode contexts, as "
                         "served); default: --prompt for all. The roofline line still assumes --prompt")
    ap.add_argument("--late-prompt", type=int, default=0, help="tokens of one prompt added at step --late-at")
    ap.add_argument("--late-at", type=int, default=40)
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="as benchmarks/gpu_serve.py gives the server")
    ap.add_argument("--tbt-slo", type=float, default=0.1)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--hbm-tbps", type=float, default=4.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON with every step")
    ap.add_argument("--profile-steps", default="", help="comma-separated step indices to run under torch.profiler")
    ap.add_argument("--profile-out", default="step_profile.txt", help="their kernel tables (appended)")
    args = ap.parse_args(argv)
    args.profile_steps = {int(x) for x in args.profile_steps.split(",") if x.strip()}
    args.prompts = [int(x) for x in args.prompts.split(",") if x.strip()] if args.prompts else None
    core = build(args)
    try:
        steps = run_burst(core, args)
    finally:
        core.executor.shutdown()
    summary = summarize(steps, core, args)
    summary["engine_state"] = engine_state(core)
    print(json.dumps(summary, indent=1), flush=True)
    if args.out:
        args.profile_steps = sorted(args.profile_steps)
        Path(args.out).write_text(json.dumps({"args": vars(args), "summary": summary, "steps": steps}))
    return 0

