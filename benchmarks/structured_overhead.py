"""Decode TPOT of grammar-constrained (``json_schema``) requests against free-form requests of the same shapes.

``batch`` requests (random prompts of ``prompt_len`` tokens, ``max_tokens`` outputs, greedy) run together
through one engine instance, twice: free-form (EOS ignored) and with a ``json_schema`` whose output cannot
complete within ``max_tokens`` (an array of at least 10,000 small objects: strings, integers, enums), so
both runs decode the same batch for the same number of steps. TPOT is the wall time of the engine steps
that decode exactly ``batch`` requests and prefill nothing (mean and median); the ratio is the cost of
structured decoding (bitmask fill on the host during the forward, its copy and its application).

``--profile-steps N`` then runs each mode once more with N of those steps under torch.profiler and
reports where a step goes, per step: the host time of the worker's phases (``grammar.fill``: the matchers
take the last tokens and fill the mask, while the forward runs; ``sample``: the sampler, which waits for
the forward), the device's busy time (all kernels) against the step's wall time, and the kernels whose
time differs most between the modes.

Random-weight presets use the byte tokenizer (258 ids described to xgrammar, whatever the model's
vocabulary): its masks are cheaper than a real tokenizer's. Point ``--model`` at a Hugging Face
directory (its tokenizer comes with it) for the figure that counts.

    python3 benchmarks/structured_overhead.py --device cuda --model llama-3.1-8b --batch 64 --profile-steps 8
    .venv/bin/python benchmarks/structured_overhead.py --device cpu --model tiny-llama --batch 8 --max-tokens 32 --profile-steps 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.structured.spec import StructuredOutput
from conflux_cluster.engine.runtime.executor import instance_executor

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 10000, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "id": {"type": "integer"},
                                     "kind": {"enum": ["alpha", "beta", "gamma"]}},
    "required": ["name", "id", "kind"]}}}, "required": ["items"]}
PHASES = ("engine.step", "grammar.fill", "sample")  # record_function ranges (the worker names the last two)


def decode_step_times(core: EngineCore, prompts: list[list[int]], params: SamplingParams, tag: str,
                      prof: profile | None = None) -> list[float]:
    """Run every prompt to its end; the wall times of the steps that decode all of them and prefill nothing.
    With ``prof`` (a scheduled profiler): from the third such step on, each step is one of its steps."""
    for i, p in enumerate(prompts):
        core.add_request(GenerateRequest(f"{tag}-{i}", p, params))
    times: list[float] = []
    while core.has_unfinished():
        on = prof is not None and len(times) >= 2
        t0 = time.perf_counter()
        with record_function("engine.step") if on else nullcontext():
            core.step()
        dt = time.perf_counter() - t0
        if on:
            prof.step()
        plan = core.last_plan
        if plan is not None and not plan.prefill and sum(len(d) for d in plan.decode) == len(prompts):
            times.append(dt)
    return times


def breakdown(prof: profile, steps: int) -> dict:
    """Per step (ms): host time of each phase, device busy time, and device time per kernel."""
    phases, kernels = {}, {}
    for e in prof.key_averages():
        if e.key in PHASES:
            phases[e.key] = e.cpu_time_total / 1e3 / steps
        dev = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if dev and e.device_type != torch.autograd.DeviceType.CPU:
            kernels[e.key] = dev / 1e3 / steps
    return {"host_ms": phases, "device_busy_ms": sum(kernels.values()), "kernels_ms": kernels}


def report(times: dict[str, list[float]], prof: dict[str, dict]) -> dict:
    out: dict = {"tpot_ms": {m: {"mean": statistics.mean(t) * 1e3, "median": statistics.median(t) * 1e3,
                                 "steps": len(t)} for m, t in times.items()}}
    for mode, r in out["tpot_ms"].items():
        print(f"  {mode:12s} decode TPOT mean {r['mean']:8.2f} ms  median {r['median']:8.2f} ms  ({r['steps']} steps)")
    mean, med = ({m: r[k] for m, r in out["tpot_ms"].items()} for k in ("mean", "median"))
    out["ratio"] = {"mean": mean["json_schema"] / mean["free-form"], "median": med["json_schema"] / med["free-form"]}
    print(f"  ratio json_schema / free-form: mean {out['ratio']['mean']:.3f}  median {out['ratio']['median']:.3f}")
    if prof:
        out["profile"] = prof
        print("  profiled steps, ms per step (host: the phase's wall on the step's thread; device: kernels)")
        for mode, b in prof.items():
            host = "  ".join(f"{k} {v:.3f}" for k, v in b["host_ms"].items())
            print(f"  {mode:12s} host: {host}  | device busy {b['device_busy_ms']:.3f}")
        free, js = prof.get("free-form", {}).get("kernels_ms", {}), prof.get("json_schema", {}).get("kernels_ms", {})
        diff = sorted(((js.get(k, 0.0) - free.get(k, 0.0), k) for k in set(free) | set(js)), reverse=True)
        for d, k in [x for x in diff if abs(x[0]) >= 0.005][:12]:
            print(f"    kernel {k[:70]:70s} json - free {d:+.3f} ms  (json {js.get(k, 0.0):.3f})")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="tiny-llama", help="a preset, a built-in name or an HF directory")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating (the first warms up)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--profile-steps", type=int, default=0, help="decode steps per mode to run under torch.profiler")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)

    source = resolve_model(args.model)
    blocks = args.batch * (-(-(args.prompt_len + args.max_tokens) // 16) + 1) + 16
    config = EngineConfig(model=args.model, device=args.device, num_kv_blocks=blocks, load_progress=False,
                          num_threads=args.threads)
    core = EngineCore(config, instance_executor(config, source), source=source)
    rng = random.Random(0)
    top = min(source.config.vocab_size, 256 if source.kind == "preset" else source.config.vocab_size)
    prompts = [[rng.randrange(3, top) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    modes = {"free-form": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
             "json_schema": SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                           structured=StructuredOutput.json_schema(SCHEMA))}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode, params in modes.items():
            t = decode_step_times(core, prompts, params, f"{mode}-{r}")
            if r or args.repeats == 1:
                times[mode] += t
    profiles = {}
    if args.profile_steps:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        for mode, params in modes.items():  # one warm-up step (the profiler's own start-up), then N
            with profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=args.profile_steps, repeat=1)) as prof:
                decode_step_times(core, prompts, params, f"{mode}-profiled", prof)
            profiles[mode] = breakdown(prof, args.profile_steps)
    print(f"{args.model} on {args.device}: batch {args.batch}, prompt {args.prompt_len}, {args.max_tokens} tokens")
    out = report(times, profiles)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), **out}, f, indent=1)


if __name__ == "__main__":
    main()
