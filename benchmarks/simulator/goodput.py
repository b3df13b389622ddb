"""Goodput of ConfluxServe and the baselines (paper §8.2 / Fig. 12 settings) in the simulator.

    .venv/bin/python -m benchmarks.simulator goodput                 # full matrix: 35 min wall on the shared, loaded 2-core machine
    .venv/bin/python -m benchmarks.simulator goodput --cluster        # + routing policies at cluster scale

Settings (paper §8.1): Llama-8B 4 GPUs TTFT 1 s / TBT 50 ms; Qwen3-14B 4 GPUs 2 s / 100 ms;
Qwen3-32B 8 GPUs base TP2, 2 s / 100 ms. Workloads: Mooncake synthetic and conversation (slices
of ``--requests``), and the GENERATED toolagent-like workload (Table 3 statistics; the real
trace is not available here). Hardware: the engine's H200 roofline preset, plus any fitted H200
profile JSON given with ``--profile`` (per rank, base TP1, for Llama-8B). Writes
``<out>/goodput.json``, one PNG per (model, workload) and prints the tables and the ratios
ConfluxServe ÷ strongest baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from conflux_cluster.engine.scheduler.estimator import EstimatorProfile
from conflux_cluster.sim.cluster import compare_routers, format_cluster
from conflux_cluster.sim.evaluate import evaluate, format_table, plot, to_json
from conflux_cluster.sim.hardware import get_hardware, get_model
from conflux_cluster.slo import SLO
from conflux_cluster.sim.registry import ALL_SYSTEMS, Setting
from conflux_cluster.sim.workloads import cap_lengths, make_workload

SETTINGS = {  # name: (model, GPUs, base TP, TTFT, TBT)
    "llama-8b": ("llama-8b", 4, 1, 1.0, 0.05),
    "qwen-14b": ("qwen-14b", 4, 1, 2.0, 0.1),
    "qwen-32b": ("qwen-32b", 8, 2, 2.0, 0.1),
}
WORKLOADS = ("toolagent", "synthetic", "conversation")


def setting(name: str, hw: str, profile: EstimatorProfile | None = None) -> Setting:
    m, g, tp, ttft, tbt = SETTINGS[name]
    return Setting(get_model(m), get_hardware(hw), g, tp, SLO(ttft, tbt), profile)


def run_matrix(args, out: Path) -> dict:
    results = {}
    for sname in args.models:
        for wname in args.workloads:
            s = setting(sname, args.hardware)
            wl = cap_lengths(make_workload(wname, args.requests, seed=args.seed), s.model.max_context)
            t0 = time.perf_counter()
            res = evaluate(s, wl, args.systems, quick=args.quick, progress=not args.no_progress)
            key = f"{sname}/{wname}"
            results[key] = {"setting": {"model": s.model.name, "gpus": s.num_gpus, "base_tp": s.base_tp,
                                        "ttft": s.slo.ttft_s, "tbt": s.slo.tbt_s, "costs": s.costs().source,
                                        "workload": wl.name, "stats": wl.stats()},
                            **to_json(res), "wall_s": time.perf_counter() - t0}
            print(f"\n== {key}  ({wl.name}, {len(wl)} requests, {s.costs().source}, "
                  f"{time.perf_counter() - t0:.0f} s)\n{format_table(res)}", flush=True)
            if set(ALL_SYSTEMS) <= set(args.systems):
                plot(res, f"{s.model.name} {s.num_gpus}x{s.hw.name}, {wl.name}, SLO {s.slo.ttft_s}s/"
                          f"{s.slo.tbt_s * 1e3:.0f}ms", out / f"{sname}-{wname}.png")
    return results


def run_profile(args, out: Path) -> dict:
    """Llama-8B with a fitted H200 profile (XP from the profile; baselines derived from it)."""
    prof = EstimatorProfile.from_json(args.profile)
    results = {}
    for wname in args.workloads:
        s = setting("llama-8b", args.hardware, prof)
        if args.tbt or args.ttft:
            s = Setting(s.model, s.hw, s.num_gpus, s.base_tp, SLO(args.ttft or s.slo.ttft_s, args.tbt or s.slo.tbt_s), prof)
        wl = cap_lengths(make_workload(wname, args.requests, seed=args.seed), s.model.max_context)
        res = evaluate(s, wl, list(ALL_SYSTEMS), quick=args.quick, progress=not args.no_progress)
        results[f"llama-8b/{wname}/profile"] = {"profile": args.profile, "ttft": s.slo.ttft_s, "tbt": s.slo.tbt_s,
                                                **to_json(res)}
        print(f"\n== llama-8b/{wname} with fitted profile {args.profile}\n{format_table(res)}", flush=True)
    return results


def run_cluster(args) -> dict:
    """Conversation trace scaled up: K instances of ConfluxServe (Llama-8B, 4 GPUs each)."""
    s = setting("llama-8b", args.hardware)
    out = {}
    for k in args.scales:
        n = min(12031, max(args.requests, 150 * k))
        wl = cap_lengths(make_workload("conversation", n), s.model.max_context)
        if k <= args.search_up_to:
            res = compare_routers(s, wl, "conflux", k, args.routers, progress=not args.no_progress)
        else:
            rate = k * args.per_instance_rate
            res = compare_routers(s, wl, "conflux", k, args.routers, rates=[rate], progress=not args.no_progress)
        out[str(k)] = res
        print(f"\n== cluster: {k} instances x 4 GPUs, conversation ({n} requests)\n{format_cluster(res)}", flush=True)
    return out


PLUS_BASELINES = ("chunked++", "distserve++", "loongserve++", "muxwise++")


def markdown(doc: dict) -> str:
    """Goodput tables (req/s) from a goodput.json: one row per (model, workload).

    "strongest ++" is over every swept configuration; "paper configs" leaves out chunked prefill
    under uniform SP (the paper's Chunked baseline is vLLM with TP over the instance).
    """
    names = ("conflux", "conflux-fcfs", "chunked", "chunked++", "distserve", "distserve++", "loongserve",
             "loongserve++", "muxwise", "muxwise++")
    head = "| setting / workload | " + " | ".join(names) + " | ÷ strongest ++ | ÷ strongest ++ (paper configs) |"
    lines = [head, "|" + "---|" * (len(names) + 3)]
    for key, r in doc["matrix"].items():
        sy = r["systems"]
        best = max(sy[n]["goodput"] for n in PLUS_BASELINES)
        paper = max(max((g for lbl, g in sy[n]["tried"].items() if "sp=" not in lbl), default=0.0)
                    for n in PLUS_BASELINES)
        ours = sy["conflux"]["goodput"]
        ratio = f"{ours / best:.2f}x" if best else "n/a"
        ratio_p = f"{ours / paper:.2f}x" if paper else "n/a"
        lines.append(f"| {key} | " + " | ".join(f"{sy[n]['goodput']:.2f}" for n in names) + f" | {ratio} | {ratio_p} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--hardware", default="h200")
    p.add_argument("--requests", type=int, default=300, help="requests per workload slice")
    p.add_argument("--seed", type=int, default=1, help="seed of the generated toolagent-like workload")
    p.add_argument("--quick", action="store_true", help="paper's configurations only (no sweeps)")
    p.add_argument("--profile", default=None, help="fitted H200 EstimatorProfile JSON for Llama-8B (base TP1)")
    p.add_argument("--profile-only", action="store_true", help="only the --profile runs")
    p.add_argument("--tbt", type=float, default=None, help="override the TBT SLO of the --profile runs")
    p.add_argument("--ttft", type=float, default=None, help="override the TTFT SLO of the --profile runs")
    p.add_argument("--cluster", action="store_true", help="also compare routing policies at cluster scale")
    p.add_argument("--cluster-only", action="store_true")
    p.add_argument("--scales", nargs="+", type=int, default=[1, 4, 16, 64])
    p.add_argument("--search-up-to", type=int, default=4, help="goodput search up to this many instances")
    p.add_argument("--per-instance-rate", type=float, default=3.0, help="req/s per instance above --search-up-to")
    p.add_argument("--routers", nargs="+", default=["lowest_load", "round_robin", "power_of_two", "random"])
    p.add_argument("--out", default="docs/sim")
    p.add_argument("--json", default="goodput.json", help="file name of the results in --out")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--systems", nargs="+", default=list(ALL_SYSTEMS), help="systems of the matrix")
    p.add_argument("--markdown", default=None, help="only print the markdown tables of an existing goodput.json")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    doc: dict = {"command": " ".join(sys.argv), "requests": args.requests}
    if args.profile_only:
        doc["profile"] = run_profile(args, out)
    elif not args.cluster_only:
        doc["matrix"] = run_matrix(args, out)
        if args.profile:
            doc["profile"] = run_profile(args, out)
        if set(ALL_SYSTEMS) <= set(args.systems):
            print("\n" + markdown(doc))
    if args.cluster or args.cluster_only:
        doc["cluster"] = run_cluster(args)
    doc["wall_s"] = time.perf_counter() - t0
    name = "cluster.json" if args.cluster_only else args.json
    (out / name).write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {out / name} ({doc['wall_s']:.0f} s)")
    return 0

