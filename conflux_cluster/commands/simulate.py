"""``conflux simulate``: goodput of ConfluxServe and the baselines in the discrete-event simulator.

    conflux simulate --model llama-8b --gpus 4 --ttft 1 --tbt 0.05 --workload toolagent \
        --num-requests 300 --systems all --out sim_out/

prints a table (goodput, TTFT/TBT percentiles at goodput, best configuration, ConfluxServe ÷
strongest baseline) and writes ``<out>/<name>.json`` and, with the ``plots`` extra (matplotlib), a
Fig. 12-style ``<out>/<name>.png``.
``--rates 2,4,8`` evaluates fixed rates instead of searching; ``--instances K --router ...``
puts K instances behind the global router (cluster scale); ``--instances K --prefix-compare``
reports goodput without the prefix cache, with it, and with it plus prefix-aware routing (prompts
from the trace's ``hash_ids``; docs/prefix-caching.md). Exposes ``register(subparsers)`` for
the ``conflux`` dispatcher; also runs as ``python -m conflux_cluster.commands.simulate``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

from conflux_cluster.commands._checks import positive_floats, require_positive, require_writable_folder

SYSTEM_GROUPS = {"all": "ALL_SYSTEMS", "fcfs": "FCFS_SYSTEMS", "plus": "PLUS_SYSTEMS"}
WORKLOADS = ("conversation", "conversation-sessions", "synthetic", "toolagent", "file")
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def _time_unit(text: str) -> float:
    """``--time-unit``: a unit name (s, ms, us) or seconds per unit (``1e-3``)."""
    if text in TIME_UNITS:
        return TIME_UNITS[text]
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected s, ms, us or a finite positive number, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("setting")
    g.add_argument("--model", default="llama-8b", help="llama-8b | qwen-14b | qwen-32b (or full names)")
    g.add_argument("--hardware", default="h200", help="roofline preset: h200 | h100")
    g.add_argument("--profile", default=None, help="fitted EstimatorProfile JSON (per rank, base TP) instead of roofline")
    g.add_argument("--gpus", type=int, default=4, help="GPUs per instance (every system gets the same)")
    g.add_argument("--base-tp", type=int, default=1, help="TP degree of one XP rank / LoongServe instance")
    g.add_argument("--ttft", type=float, default=1.0, help="TTFT SLO (s)")
    g.add_argument("--tbt", type=float, default=0.05, help="TBT SLO (s)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="decode slots per instance (default: the engine's SchedulerConfig.max_num_seqs; every system "
                        "gets the same share per GPU)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="fixed token budget per rank and step of the chunked baselines' default configuration "
                        "(default: the engine's on a GPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="HBM share for weights, activations and KV (default: the engine's EngineConfig)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default=None, choices=WORKLOADS,
                   help="conversation | synthetic (Mooncake traces, a contiguous slice) | conversation-sessions "
                        "(whole conversations sampled with --seed: keeps the trace's prefix reuse) | toolagent "
                        "(GENERATED, Table 3) | file (default: file with --trace, else toolagent)")
    w.add_argument("--trace", default=None, help="jsonl/CSV trace to replay (implies --workload file)")
    w.add_argument("--columns", default="timestamp,input_length,output_length",
                   help="arrival,prompt,output column names of --trace (default: %(default)s)")
    w.add_argument("--time-unit", type=_time_unit, default=1e-3,
                   help="numeric arrivals of --trace (relative or epoch): s, ms, us or seconds per unit "
                        "(default: ms); ISO-8601 timestamps ('2023-11-16 18:15:46.68') are read as dates")
    w.add_argument("--num-requests", type=int, default=300, help="requests in the slice")
    w.add_argument("--offset", type=int, default=0, help="first request of the slice")
    w.add_argument("--arrivals", default="trace", choices=["trace", "poisson", "gamma"],
                   help="keep the trace's arrival pattern, or replace it")
    w.add_argument("--cv", type=float, default=2.0, help="coefficient of variation of gamma arrivals")
    w.add_argument("--seed", type=int, default=0, help="seed of generated workloads and arrivals")
    r = p.add_argument_group("run")
    r.add_argument("--systems", default="all",
                   help="all | fcfs | plus | comma list of: conflux, conflux-fcfs, chunked, chunked++, distserve, "
                        "distserve++, loongserve, loongserve++, muxwise, muxwise++, conflux++ (XP under SRPT), "
                        "no-cobatch, no-cobatch++ (XP without co-batching)")
    r.add_argument("--quick", action="store_true", help="only the paper's stated configuration of each baseline")
    r.add_argument("--rates", type=positive_floats, default=None,
                   help="comma list of rates (req/s, finite, > 0) to evaluate instead of a goodput search")
    r.add_argument("--instances", type=int, default=1, help="instances behind the global router")
    r.add_argument("--router", default="lowest_load",
                   help="comma list of routing policies: lowest_load, round_robin, power_of_two, random, "
                        "prefix_aware")
    r.add_argument("--prefix-compare", action="store_true",
                   help="with --instances: goodput of conflux (lowest_load) vs conflux-pc (prefix cache) with "
                        "lowest_load and with prefix_aware routing, hit rates vs the trace's reuse bound")
    r.add_argument("--prefix-weight", type=float, default=10.0,
                   help="prefix_aware: weight of the prefill seconds a cached prefix saves (router/prefix_aware.py)")
    r.add_argument("--prefix-variants", default=None,
                   help="with --prefix-compare: comma list of system:policy pairs (default: conflux:lowest_load,"
                        "conflux-pc:lowest_load,conflux-pc:prefix_aware)")
    r.add_argument("--out", default="sim_out", help="folder for the JSON and PNG")
    r.add_argument("--name", default=None, help="file name stem (default: model-workload)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")


def register(subparsers) -> argparse.ArgumentParser:
    from ._formatting import HelpFormatter

    p = subparsers.add_parser("simulate", help="simulate goodput of ConfluxServe and the baselines",
                              description=__doc__, formatter_class=HelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def workload_kind(args) -> str:
    """``--workload``, defaulting to ``file`` when ``--trace`` is given; a trace with another workload
    (which would ignore it) or ``file`` without a trace is a user error."""
    kind = args.workload or ("file" if args.trace else "toolagent")
    if args.trace and kind != "file":
        raise ValueError(f"--trace {args.trace} is only read with --workload file (got --workload {kind})")
    if kind == "file" and not args.trace:
        raise ValueError("--workload file needs --trace FILE")
    return kind


def _workload(args, model, kind: str):
    import numpy as np

    from conflux_cluster.sim import workloads as W

    cols = tuple(args.columns.split(","))
    if len(cols) != 3:
        raise ValueError(f"--columns needs three names (arrival,prompt,output), got {args.columns!r}")
    try:
        wl = W.make_workload(kind, args.num_requests, seed=args.seed, offset=args.offset, path=args.trace,
                             columns=cols, time_unit=args.time_unit)
    except FileNotFoundError:
        raise ValueError(f"--trace {args.trace}: no such file") from None
    if args.arrivals != "trace":
        rng = np.random.default_rng(args.seed)
        cv = 1.0 if args.arrivals == "poisson" else args.cv
        wl = W.with_arrivals(wl, W.gamma_arrivals(len(wl), 1.0, cv, rng), f"{wl.name}, {args.arrivals} arrivals")
    return W.cap_lengths(wl, model.max_context)


def _systems(spec: str) -> list[str]:
    from conflux_cluster.sim import registry

    if spec in SYSTEM_GROUPS:
        return list(getattr(registry, SYSTEM_GROUPS[spec]))
    names = [s.strip() for s in spec.split(",") if s.strip()]
    known = registry.ALL_SYSTEMS + registry.EXTRA_SYSTEMS
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown systems {bad}; known: {', '.join(known)}")
    return names


def check_args(args) -> None:
    """A ValueError naming the first flag out of its range, before anything is simulated."""
    require_positive({"--gpus": args.gpus, "--base-tp": args.base_tp, "--ttft": args.ttft, "--tbt": args.tbt,
                      "--num-requests": args.num_requests, "--instances": args.instances, "--cv": args.cv,
                      "--max-num-seqs": args.max_num_seqs, "--max-num-batched-tokens": args.max_num_batched_tokens,
                      "--gpu-memory-utilization": args.gpu_memory_utilization})
    if args.offset < 0:
        raise ValueError(f"--offset must be >= 0, got {args.offset}")
    if args.gpu_memory_utilization is not None and args.gpu_memory_utilization > 1:
        raise ValueError(f"--gpu-memory-utilization must be <= 1, got {args.gpu_memory_utilization}")
    if not (args.prefix_weight >= 0 and math.isfinite(args.prefix_weight)):
        raise ValueError(f"--prefix-weight must be a finite number >= 0, got {args.prefix_weight}")
    check_outputs(args)


def check_outputs(args) -> None:
    """``--out`` is a folder this process can write (or make) and ``--name`` a plain file name stem, so that
    the results of a long simulation are not lost when they are written."""
    require_writable_folder("--out", args.out)
    if args.name is not None:
        if args.name in ("", ".", "..") or Path(args.name).name != args.name:
            raise ValueError(f"--name must be a file name stem without folders (files go into --out), "
                             f"got {args.name!r}")
        if (Path(args.out) / f"{args.name}.json").is_dir():
            raise ValueError(f"--name {args.name}: {Path(args.out) / args.name}.json is a folder")


def run(args) -> int:
    from conflux_cluster.sim import evaluate as E
    from conflux_cluster.sim.cluster import (PREFIX_VARIANTS, compare_prefix, compare_routers, format_cluster,
                                             format_prefix)
    from conflux_cluster.sim.hardware import get_hardware, get_model
    from conflux_cluster.sim.limits import EngineLimits
    from conflux_cluster.slo import SLO
    from conflux_cluster.sim.registry import Setting

    check_args(args)
    kind = workload_kind(args)
    model, hw = get_model(args.model), get_hardware(args.hardware)  # ValueError: conflux simulate: error: ...
    if args.gpus % args.base_tp:
        raise ValueError(f"--gpus {args.gpus} is not a multiple of --base-tp {args.base_tp}")
    profile = _profile(args.profile) if args.profile else None
    limits = EngineLimits.from_engine(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                      gpu_memory_utilization=args.gpu_memory_utilization)
    s = Setting(model, hw, args.gpus, args.base_tp, SLO(args.ttft, args.tbt), profile, limits)
    wl = _workload(args, model, kind)
    systems = _systems(args.systems)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"{model.name}-{kind}"
    print(f"{model.name} on {args.gpus}x{hw.name} (base TP{args.base_tp}, costs: {s.costs().source}), "
          f"SLO {args.ttft}s/{args.tbt * 1e3:.0f}ms, workload {wl.name}: {len(wl)} requests {wl.stats()}")
    if args.prefix_compare:
        variants = (tuple(tuple(v.split(":")) for v in args.prefix_variants.split(","))
                    if args.prefix_variants else PREFIX_VARIANTS)
        res = compare_prefix(s, wl, args.instances, progress=not args.no_progress, variants=variants,
                             prefix_weight=args.prefix_weight)
        print(format_prefix(res))
        E.save_json(res, out / f"{stem}-prefix-x{args.instances}.json")
        return 0
    if args.instances > 1:
        res = compare_routers(s, wl, systems[0], args.instances, args.router.split(","),
                              rates=args.rates, progress=not args.no_progress)
        print(format_cluster(res))
        E.save_json(res, out / f"{stem}-x{args.instances}.json")
        return 0
    if args.rates:
        res = E.evaluate_rates(s, wl, systems, args.rates, args.quick, progress=not args.no_progress)
    else:
        res = E.evaluate(s, wl, systems, args.quick, progress=not args.no_progress)
    print(E.format_table(res))
    E.save_json({"setting": _describe(s, wl), **E.to_json(res)}, out / f"{stem}.json")
    print(f"wrote {out / (stem + '.json')}")
    if importlib.util.find_spec("matplotlib") is None:
        print("no plot: matplotlib is not installed (pip install 'conflux-cluster[plots]')")
        return 0
    E.plot(res, f"{model.name} {args.gpus}x{hw.name}, {wl.name}, SLO {args.ttft}s/{args.tbt * 1e3:.0f}ms",
           out / f"{stem}.png")
    print(f"wrote {out / (stem + '.png')}")
    return 0


def _profile(path: str):
    """``--profile``'s EstimatorProfile; a ValueError naming the flag, the file and what is wrong with it."""
    from conflux_cluster.engine.scheduler.estimator import EstimatorProfile

    try:
        return EstimatorProfile.from_json(path)
    except ValueError as e:
        raise ValueError(f"--profile {e}") from None


def _describe(s, wl) -> dict:
    return {"model": s.model.name, "hardware": s.hw.name, "gpus": s.num_gpus, "base_tp": s.base_tp,
            "ttft_slo": s.slo.ttft_s, "tbt_slo": s.slo.tbt_s, "costs": s.costs().source, "limits": vars(s.limits),
            "workload": wl.name,
            "workload_stats": wl.stats()}


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m conflux_cluster.commands.simulate [options]`` (same errors as
    ``conflux simulate``: one ``conflux simulate: error: ...`` line, exit status 2)."""
    from conflux_cluster.cli import main as cli_main

    return cli_main(["simulate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
