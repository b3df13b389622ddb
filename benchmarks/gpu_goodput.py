#!/usr/bin/env python
"""Real goodput of ConfluxServe and the in-engine baselines through ``conflux serve``, side by side
with the simulator on the same arrivals (issue 11, items 3-5).

    python -m benchmarks.gpu_goodput --workloads conversation --rates 1,2,4,8      # every default system
    python -m benchmarks.gpu_goodput --systems conflux,chunked-sp++ --workloads toolagent,synthetic
    python -m benchmarks.gpu_goodput --systems router --ranks 1 --workloads conversation   # 2 x 1 GPU, routers
    python -m benchmarks.gpu_goodput --quick --device cpu                           # smoke run on CPU

For each system (``conflux_cluster/bench/served_systems.py``: conflux = xp + slo; chunked-sp /
chunked-tp / no-cobatch = xp_mode uniform-sp / uniform-tp / no-cobatch under fcfs, "++" under srpt;
router-<policy> = 2 instances of 1 rank behind that routing policy) one ``conflux serve``
subprocess is started, and each workload is replayed at each rate of ``--rates`` in increasing
order (a workload stops after a rate below ``--stop-below``). Workloads (conflux_cluster/sim/
workloads.py): the Mooncake ``conversation`` and ``synthetic`` traces (their first
``--num-requests``) and ``toolagent``, the GENERATED toolagent-like workload (paper Table 3
statistics; the real trace is not available). Arrivals keep the trace's pattern, gaps scaled to
the rate (paper §8.1); lengths are scaled by ``--prompt-scale``/``--output-scale`` and capped to
the server's context; at ``--prompt-scale`` 1 a trace's prompts are built from its ``hash_ids``
(same id, same 512 tokens: its prefix reuse is real, which ``conflux-pc`` with the prefix cache
turns into skipped prefill). Goodput = the highest rate with >= 95 % of requests meeting every per-token
deadline (conflux_cluster/slo.py).

The simulator runs the same requests at the same rates: the engine's Scheduler under the same
limits (``EngineLimits`` from the server's engine config), timed by ``--profile``: a fitted
EstimatorProfile JSON, ``auto`` (the engine's profile for this hardware, model and ranks, as the
server resolves it; the roofline of ``--sim-hardware`` where there is none) or ``roofline``.
Reported per system: goodput error and TTFT/TBT p50/p99 errors, sim vs real.

Output: ``--out`` JSON (default ``$OUT/gpu_goodput.json``), written after every point, and a
table: per workload, per system, real / simulated goodput, ConfluxServe ÷ best baseline.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from pathlib import Path

from conflux_cluster.bench.goodput_compare import (bench_requests, compare, goodput, misses, next_search_rate,
                                                   ratio_table, real_point, server_latency, server_prefix,
                                                   shape_workload, sim_point, workload_spec)
from conflux_cluster.bench.served_systems import ServedSystem, pick
from conflux_cluster.bench.server import (ClientSettings, ServedModel, ServerProcess, ServerSpec, add_server_arguments,
                                          default_ranks, finish_args, go_higher, log, measuring, quick_defaults, resolve_device,
                                          run_record)
from conflux_cluster.bench.workload import request_prompts
from conflux_cluster.sim.prefix import reuse_bound

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("conversation", "conversation-sessions", "synthetic", "toolagent")  # conflux_cluster/sim/workloads.py


# ---- the simulator's setting for the served engine --------------------------------------------------


def engine_config(args: argparse.Namespace, system: ServedSystem):
    """The EngineConfig the server's instance builds from the same flags (actors/xp_deployment.py)."""
    from conflux_cluster.actors.xp_deployment import engine_config as build
    from conflux_cluster.cli import build_parser
    from conflux_cluster.commands.serve import config_from_args

    argv = ["serve", "--model", args.model, "--device", str(args.device), *slo_flags(args),
            *system.server_args(args.ranks), *args.server_arg]
    return build(config_from_args(build_parser().parse_args(argv)), system.num_ranks(args.ranks), args.device)


def resolve_sim_profile(args: argparse.Namespace, ecfg) -> tuple[object | None, str]:
    """(EstimatorProfile or None for the roofline, where it came from)."""
    from conflux_cluster.engine.scheduler.estimator import EstimatorProfile

    if args.profile == "roofline":
        return None, f"roofline ({args.sim_hardware})"
    path = args.profile
    if path == "auto":
        from conflux_cluster.engine.profiling.store import local_hardware_name, resolve_profile

        found = resolve_profile(ecfg.model, local_hardware_name(ecfg.device), ecfg.num_ranks, ecfg.tp_size,
                                ecfg.dtype, xp_mode="xp")
        if found is None:
            return None, f"roofline ({args.sim_hardware}): no fitted profile for this engine"
        path = str(found)
    from conflux_cluster.bench.server import in_repo

    return EstimatorProfile.from_json(path), str(in_repo(path, REPO))


def sim_setting(args: argparse.Namespace, system: ServedSystem, ecfg, profile):
    from conflux_cluster.engine.models.config import PRESETS
    from conflux_cluster.sim.hardware import ModelSpec, get_hardware
    from conflux_cluster.sim.limits import EngineLimits
    from conflux_cluster.slo import SLO
    from conflux_cluster.sim.registry import Setting

    mc = PRESETS[args.model] if args.model in PRESETS else _model_config(args.model)
    spec = ModelSpec.from_config(args.model, mc, ecfg.torch_dtype().itemsize)
    gpus = ecfg.num_ranks * ecfg.tp_size  # uniform-tp: 1 rank x TP over all
    return Setting(spec, get_hardware(args.sim_hardware), gpus, 1, SLO(args.ttft_slo, args.tbt_slo), profile,
                   EngineLimits.from_engine(ecfg, pipelined=ecfg.async_scheduling))  # served ranks overlap steps


def _model_config(name: str):
    from conflux_cluster.engine.loader import resolve_model

    return resolve_model(name).config


# ---- one system: server, workloads, rates -------------------------------------------------------------


def run_system(args: argparse.Namespace, system: ServedSystem, vocab: int, save) -> dict:
    """Start the system's server, replay every workload at every rate, simulate the same."""
    ecfg = engine_config(args, system)
    res: dict = {"server_args": system.server_args(args.ranks) + list(args.server_arg), "gpus": system.gpus(args.ranks),
                 "workloads": {}}
    step_log = []
    if args.step_logs:  # served steps as estimator samples (benchmarks/step_logs/estimator.py)
        res["step_log"] = str(args.out.parent / f"steps-{system.file_name}.jsonl")
        step_log = ["--step-log", res["step_log"]]
    spec = ServerSpec(args.model, args.device, system.num_ranks(args.ranks), args.api_key,
                      tuple(slo_flags(args) + res["server_args"] + step_log))
    server = ServerProcess(spec, system.file_name, args.out.parent)  # its log comes back from the device too
    with measuring(server, args.device, res, system.name):
        t0 = time.time()
        served = ServedModel(server.start(args.start_timeout), ClientSettings(
            args.api_key, vocab, args.seed, args.request_timeout, args.ttft_slo, args.tbt_slo))
        res["startup_s"], res["max_model_len"] = time.time() - t0, served.max_model_len
        # after the start: a server with 'auto' has cached the profile it fitted at start-up
        profile, res["sim_costs"] = resolve_sim_profile(args, ecfg)
        setting = sim_setting(args, system, ecfg, profile)
        res["limits"] = vars(setting.limits)
        for wname in args.workloads:
            res["workloads"][wname] = run_workload(args, system, served, setting, wname, vocab,
                                                   lambda part: save({**res, "partial": part}))
            save(res)
    return res


def run_workload(args, system: ServedSystem, served: ServedModel, setting, wname: str, vocab: int, save) -> dict:
    from conflux_cluster.router.registry import make_policy

    kind, prompt_scale = workload_spec(wname, args.prompt_scale)
    wl = shape_workload(kind, args.num_requests, served.max_model_len, prompt_scale, args.output_scale,
                        args.max_output, args.seed)
    factory = system.sim_config(setting.limits, args.ranks).build(setting)

    def simulate(rate: float) -> dict:  # a fresh router per run (its state is per run)
        router = make_policy(system.router_policy, seed=0) if system.instances > 1 else None
        return sim_point(factory, wl, setting.slo, rate, system.instances, router)

    out: dict = {"workload": wl.name, "stats": wl.stats(), "real": [], "sim": [],
                 "reuse_bound": reuse_bound(wl, setting.limits.block_size)}  # share of prompt tokens a cache could serve
    rate, k = (args.search_start if args.search_start is not None else args.rates[0]), 0
    while rate is not None:
        reqs = bench_requests(wl, rate)
        rng = random.Random(args.seed + k)
        prompts = request_prompts(reqs, vocab, rng, salt=k)  # a rate point's prefixes are its own
        log(f"{system.name} / {wname}: {rate:g} req/s, {len(reqs)} requests over {reqs[-1].arrival_s:.1f}s")
        before = served.instance_stats()
        results, duration = served.run(reqs, prompts, served.slo_deadline(reqs, args.drain_s), decide_by_slo=True)
        real = real_point(rate, served.summary(results, duration), results)
        after = served.instance_stats()
        # each instance's measured / estimated step time so far (the scheduler's calibration; the sim has none)
        real["step_scale"] = [i.get("step_scale") for i in after]
        real.update(server_latency(before, after, args.tbt_slo))  # the server's side of the TBT figures
        real.update(server_prefix(before, after))  # hits of every started prefill (the client sees finished ones)
        real["misses"] = misses(results, args.ttft_slo, args.tbt_slo)
        sim = simulate(rate)
        out["real"].append(real)
        out["sim"].append(sim)
        save({wname: out})
        server = (f", server step / token gap p99 <= {real['server_step_p99_ms']:g} / {real['server_itl_p99_ms']:g}ms"
                  if real.get("server_steps") else "")
        cached_all = (f" (finished requests; {100 * real['server_cached_fraction']:.1f}% of every started prefill's)"
                      if "server_cached_fraction" in real else "")
        log(f"{system.name} / {wname}: {rate:g} req/s -> attainment real {100 * real['attainment']:.1f}% "
            f"(completed {real['completed']}/{len(reqs)}, TTFT p99 {real['ttft_p99']:.3f}s, TBT p99 "
            f"{1e3 * real['tbt_p99']:.1f}ms{server}, cached {100 * real['cached_fraction']:.1f}% of prompt tokens{cached_all}; "
            f"reuse bound {100 * out['reuse_bound']:.1f}%), sim {100 * sim['attainment']:.1f}% (cached {100 * sim['cached_fraction']:.1f}%)")
        k += 1
        if args.search_start is not None:  # the goodput search: the measured points decide the next rate
            time.sleep(args.settle_s)
            rate = next_search_rate(out["real"], min(args.rates), max(args.rates), max_points=args.max_points)
        elif go_higher(real["attainment"], args.settle_s, args.stop_below, f"{system.name} / {wname}"):
            rate = args.rates[k] if k < len(args.rates) else None
        else:
            rate = None
    measured = {p["rate"] for p in out["sim"]}
    sim_rest = [simulate(r) for r in args.rates if r not in measured]
    out["sim_only"] = sim_rest  # rates the real sweep skipped: the simulator's view of them
    out.update(compare(out["real"], out["sim"]))
    out["goodput_sim_all_rates"] = goodput(out["sim"] + sim_rest)
    return out


# ---- main -----------------------------------------------------------------------------------------------


START_ESTIMATE_S = 60.0  # one conflux serve start on 1-2 H200 with a cached profile (docs/gpu-serving.md: 37-83 s)


def wall_estimate_s(args: argparse.Namespace) -> float:
    """Upper bound of the run's wall time: server starts, every rate's arrivals, its drain and settle
    (a workload that stops early below --stop-below takes less)."""
    drain = args.drain_s if args.drain_s is not None else 30.0  # None: until decided (seldom longer)
    rates = args.rates
    if args.search_start is not None:  # at most max_points rates, none below the lowest bound
        rates = [min(args.rates)] * args.max_points
    per_rate = sum(args.num_requests / r + min(drain, 30.0) + args.settle_s for r in rates)
    return len(args.system_list) * (START_ESTIMATE_S + len(args.workloads) * per_rate)


def slo_flags(args: argparse.Namespace) -> list[str]:
    return ["--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo)]


def errors_table(doc: dict) -> str:
    """Per workload and system: goodput error, and latency errors at the reference rate."""
    lines = ["workload  system  goodput real/sim (error)  at rate: TTFT p50/p99, TBT p50/p99 error (sim vs real)"]
    for sname, sres in doc["systems"].items():
        for wname, w in (sres.get("workloads") or {}).items():
            e = w.get("latency_error_at_reference") or {}
            errs = ", ".join("—" if e.get(k) is None else f"{100 * e[k]:+.0f}%"
                             for k in ("ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99"))
            ge = w.get("goodput_error")
            lines.append(f"{wname}  {sname}  {w.get('goodput_real'):g} / {w.get('goodput_sim'):g} "
                         f"({'—' if ge is None else f'{100 * ge:+.0f}%'})  at {w.get('reference_rate')}: {errs}")
    return "\n".join(lines)


def summarize_doc(doc: dict) -> None:
    results = {w: {s: r["workloads"][w] for s, r in doc["systems"].items() if w in (r.get("workloads") or {})}
               for w in doc["args"]["workloads"]}
    text, ratios = ratio_table(results, {s: r["gpus"] for s, r in doc["systems"].items()})
    doc["ratios"], doc["table"] = ratios, text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(p, "gpu_goodput.json")
    p.add_argument("--systems", default="default", help="comma list, or default | router | all "
                   "(conflux, conflux-pc, chunked-sp[++], chunked-tp[++], no-cobatch[++], router-<policy>; a "
                   "baseline@TOKENS runs with that token budget, e.g. chunked-sp++@1024: the paper sweeps it)")
    p.add_argument("--workloads", default="conversation,synthetic,toolagent", help="comma list of " + ", ".join(WORKLOADS) +
                   "; NAME:SCALE gives one its own --prompt-scale (e.g. synthetic:0.5); conversation-sessions: "
                   "whole conversations sampled with --seed, which keeps the trace's prefix reuse (a slice does not)")
    p.add_argument("--num-requests", type=int, default=200, help="requests per workload slice")
    p.add_argument("--step-logs", action=argparse.BooleanOptionalAction, default=True,
                   help="each server logs its steps (conflux serve --step-log) next to --out as "
                        "steps-<system>.<instance>.jsonl ('+' spelled 'p', '@' '-b'): samples for benchmarks/step_logs/estimator.py")
    p.add_argument("--rates", default="1,2,4,8,12,16", help="req/s, increasing")
    p.add_argument("--prompt-scale", type=float, default=1.0, help="multiply prompt lengths (then capped to context)")
    p.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths")
    p.add_argument("--max-output", type=int, default=None, help="cap output lengths")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="s (paper §8, Llama-8B: 1 s)")
    p.add_argument("--tbt-slo", type=float, default=0.05, help="s (paper §8, Llama-8B: 50 ms)")
    p.add_argument("--drain-s", type=float, default=None,
                   help="after the last arrival, wait this long at most (default: until the last token's deadline "
                        "of the longest output has passed, ending earlier once every request still running has "
                        "missed its SLO: the attainment is then exact)")
    p.add_argument("--settle-s", type=float, default=2.0, help="pause between rates")
    p.add_argument("--stop-below", type=float, default=0.5, help="stop a workload after a rate below this attainment")
    p.add_argument("--search-start", type=float, default=None,
                   help="search each system's goodput instead of sweeping --rates: start at this rate, double "
                        "while it passes, halve while nothing has, then bisect (geometrically) once the goodput "
                        "is bracketed; min and max of --rates bound the search")
    p.add_argument("--max-points", type=int, default=4, help="rates measured per system and workload in a search")
    p.add_argument("--profile", default="auto", help="simulator costs: PATH of a fitted EstimatorProfile, auto, roofline")
    p.add_argument("--sim-hardware", default="h200", help="roofline preset of the simulator (h200 | h100)")
    p.add_argument("--seed", type=int, default=1, help="prompt ids, and the generated toolagent-like workload")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-llama, tiny lengths and rates (CPU works)")
    args = p.parse_args(argv)
    args.device = resolve_device(args.device)
    if args.quick:
        quick_defaults(args, argv, (("--model", "model", "tiny-llama"), ("--systems", "systems", "conflux,chunked-tp++"),
                                    ("--workloads", "workloads", "toolagent"), ("--num-requests", "num_requests", 6),
                                    ("--rates", "rates", "1"), ("--prompt-scale", "prompt_scale", 0.01),
                                    ("--max-output", "max_output", 8),
                                    ("--settle-s", "settle_s", 0.5), ("--ttft-slo", "ttft_slo", 5.0),
                                    ("--tbt-slo", "tbt_slo", 1.0), ("--start-timeout", "start_timeout", 300.0)))
    args.model = args.model or "llama-3.1-8b"
    args.ranks = args.ranks or default_ranks(args.device)
    args.rates = sorted(float(x) for x in str(args.rates).split(",") if x.strip())
    args.workloads = [w.strip() for w in str(args.workloads).split(",") if w.strip()]
    try:
        bad = [w for w in args.workloads if workload_spec(w, args.prompt_scale)[0] not in WORKLOADS]
    except ValueError as e:
        p.error(str(e))
    if bad or not args.rates:
        p.error(f"unknown workloads {bad}" if bad else "--rates is empty")
    if min(args.rates) <= 0:
        p.error(f"--rates must be > 0, got {min(args.rates):g}")
    if args.search_start is not None and not min(args.rates) <= args.search_start <= max(args.rates):
        p.error(f"--search-start {args.search_start:g} must lie within --rates' bounds "
                f"[{min(args.rates):g}, {max(args.rates):g}]")
    if args.max_points < 1:
        p.error(f"--max-points must be >= 1, got {args.max_points}")
    try:
        args.system_list = pick(args.systems)
    except ValueError as e:
        p.error(str(e))
    return finish_args(args, "gpu_goodput.json")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = _vocab(args.model)
    doc: dict = {**run_record(args, argv, REPO, skip=("api_key", "system_list")), "systems": {}}

    def save(name: str):
        def write(part: dict) -> None:
            doc["systems"][name] = part
            args.out.write_text(json.dumps(doc, indent=1, default=str))
        return write

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout: unwind, the server is stopped
    log(f"{args.model} on {args.ranks} x {args.device} ({doc['hardware']}): systems "
        f"{[s.name for s in args.system_list]}, workloads {args.workloads}, rates {args.rates}; at most "
        f"~{wall_estimate_s(args) / 60:.1f} min with {START_ESTIMATE_S:.0f} s per server start")
    for system in args.system_list:
        doc["systems"][system.name] = run_system(args, system, vocab, save(system.name))
        summarize_doc(doc)
        args.out.write_text(json.dumps(doc, indent=1, default=str))
    log(f"results: {args.out}")
    print(doc["table"] + "\n\n" + errors_table(doc), flush=True)
    ok = all("error" not in r for r in doc["systems"].values())
    return 0 if ok else 1


def _vocab(model: str) -> int:
    from conflux_cluster.engine.models.config import PRESETS

    return (PRESETS[model] if model in PRESETS else _model_config(model)).vocab_size


if __name__ == "__main__":
    sys.exit(main())
