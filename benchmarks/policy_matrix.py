#!/usr/bin/env python
"""The policy matrix (issue 39): ``--policy slo`` against ``--policy fcfs`` through ``conflux serve``, at the
same SLOs, over four workload shapes at rates from 50 % to 150 % of each shape's knee, several seeds; the
same points through the simulator with ``--sim`` (no server).

    # one H200, Llama-3.1-8B (random-weight preset), one policy and shape per command (~6.5 min each:
    # a server start, then 9 points of 15 s of arrivals, each drained until decided); then --combine
    python benchmarks/policy_matrix.py --policies slo --shapes uniform --factors 0.75,1,1.25 --seeds 1,2,3 \
        --duration 15 --out $OUT/pm_slo_uniform.json
    python benchmarks/policy_matrix.py --policies fcfs --shapes uniform --factors 0.75,1,1.25 --seeds 1,2,3 \
        --duration 15 --out $OUT/pm_fcfs_uniform.json
    # the simulator's matrix (CPU, ~10 min on 2 cores): every shape, 5 factors, 3 seeds, both policies
    python benchmarks/policy_matrix.py --sim --duration 60 --out docs/results/policy_matrix_sim.json
    # a CPU smoke run of the served matrix (tiny-llama, tiny lengths and rates)
    python benchmarks/policy_matrix.py --quick --device cpu
    # the run-to-run spread near the knees: each seed's arrivals three times (--sim: the served steps'
    # measured / modelled times drawn in another order each run)
    python benchmarks/policy_matrix.py --sim --repeats 3 --factors 1,1.25 --duration 60 \
        --step-log docs/results/steps/h200x1_toolagent_n120_conflux_0939utc.jsonl.gz --out pm_spread.json
    # one table and verdict over several runs' points (e.g. one command per policy and shape)
    python benchmarks/policy_matrix.py --combine slo_uniform.json fcfs_uniform.json --out matrix.json

Shapes (``conflux_cluster/bench/policy_matrix.py``: ``SHAPES``): uniform 2K/128 Poisson; conversation-like
(prompts ~1K, outputs ~250); bursty prefill-heavy (prompts ~2K, outputs ~28, gamma arrivals, burstiness
0.25); longmix (10 % 32K prompts). Each point is ``--duration`` seconds of arrivals of one seed's requests
(the same for both policies); a served point then drains until every request's attainment is decided.
Per point: per-token attainment, TTFT p50 / p99, TBT p99; per shape: goodput (highest rate with mean
attainment >= 95 %); with ``--repeats``, the run-to-run spread (mean over seeds of the max - min
attainment of that seed's runs). Printed: a markdown table (slo next to fcfs, measured in the same run)
and the targets (slo >= fcfs - 2 points everywhere, goodput >= fcfs, TTFT p99 <= 2x fcfs; with repeats,
which points spread wider under slo). Output: ``--out`` JSON, written after every point.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from pathlib import Path

from conflux_cluster.bench import policy_matrix as pm
from conflux_cluster.bench.goodput_compare import real_point
from conflux_cluster.bench.server import (ClientSettings, ServedModel, ServerProcess, ServerSpec, add_server_arguments,
                                          default_ranks, finish_args, log, measuring, quick_defaults, resolve_device,
                                          run_record)
from conflux_cluster.bench.workload import BenchRequest, request_prompts

REPO = Path(__file__).resolve().parents[1]


def points_of(args: argparse.Namespace) -> list[tuple[pm.Shape, float, float, int, int]]:
    """(shape, factor, rate, seed, repeat) of every point, in the order they run: each seed's arrivals
    ``--repeats`` times in a row."""
    return [(pm.SHAPES[name], f, f * args.knees[name], seed, r)
            for name in args.shapes for f in args.factors for seed in args.seeds for r in range(args.repeats)]


def duration_of(args: argparse.Namespace, shape: str) -> float:
    """Seconds of arrivals of a point of ``shape``: its ``--duration-of``, else ``--duration``."""
    return args.durations.get(shape, args.duration)


def run_sim(args: argparse.Namespace, save) -> list[dict]:
    """Every point through the simulator; a repeat draws the served step-time ratios in another order."""
    setting = pm.sim_setting(str(args.profile), args.ttft_slo, args.tbt_slo, step_logs=tuple(args.step_log))
    settings = [pm.rerun(setting, r) for r in range(args.repeats)]
    factories = [{p: pm.sim_factory(st, p, args.scheduler) for p in args.policies} for st in settings]
    out = []
    for shape, factor, rate, seed, repeat in points_of(args):
        wl = pm.shape_workload(shape, rate, duration_of(args, shape.name), seed, args.length_scale)
        for policy in args.policies:
            p = {"shape": shape.name, "factor": factor, "rate": rate, "seed": seed, "repeat": repeat,
                 "policy": policy, **pm.sim_point(factories[repeat][policy], wl, settings[repeat].slo)}
            out.append(p)
            log(f"sim {shape.name} {factor:g}x ({rate:.3g} req/s) seed {seed} run {repeat} {policy}: "
                f"{100 * p['attainment']:.1f} %, TTFT p99 {p['ttft_p99']:.2f} s")
        save(out)
    return out


def run_served(args: argparse.Namespace, policy: str, vocab: int, save) -> list[dict]:
    """One server with ``--policy policy`` at the SLOs, every point of the matrix against it."""
    flags = ("--policy", policy, "--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo),
             *(x for name, value in args.scheduler for x in (f"--{name.replace('_', '-')}", value)), *args.server_arg)
    server = ServerProcess(ServerSpec(args.model, args.device, args.ranks, args.api_key, flags), policy, args.out.parent)
    res: dict = {"server_args": list(flags)}
    out: list[dict] = []
    with measuring(server, args.device, res, policy):
        served = ServedModel(server.start(args.start_timeout), ClientSettings(
            args.api_key, vocab, 0, args.request_timeout, args.ttft_slo, args.tbt_slo))
        for k, (shape, factor, rate, seed, repeat) in enumerate(points_of(args)):
            wl = pm.shape_workload(shape, rate, duration_of(args, shape.name), seed, args.length_scale,
                                   served.max_model_len)
            reqs = [BenchRequest(r.arrival, r.prompt_len, r.output_len) for r in wl.requests]
            prompts = request_prompts(reqs, vocab, random.Random(seed), salt=k)  # a repeat hits no cached prefix
            results, duration = served.run(reqs, prompts, served.slo_deadline(reqs, None), decide_by_slo=True)
            stats = served.instance_stats()
            p = {"shape": shape.name, "factor": factor, "seed": seed, "repeat": repeat, "policy": policy,
                 **real_point(rate, served.summary(results, duration), results),
                 "admission": [s.get("admission") for s in stats]}
            out.append(p)
            save(out)
            log(f"{policy} {shape.name} {factor:g}x ({rate:.3g} req/s) seed {seed} run {repeat}: "
                f"{100 * p['attainment']:.1f} %, "
                f"TTFT p99 {p['ttft_p99']:.2f} s, TBT p99 {1e3 * p['tbt_p99']:.0f} ms")
            time.sleep(args.settle_s)
    if "error" in res:
        out.append({"policy": policy, "error": res["error"]})
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(p, "policy_matrix.json")
    p.add_argument("--sim", action="store_true", help="run the matrix through the simulator (no server)")
    p.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                   help="no run: the table and targets over the points of these result files")
    p.add_argument("--policies", default="slo,fcfs", help="comma list of scheduler policies")
    p.add_argument("--shapes", default=",".join(pm.SHAPES), help="comma list of " + ", ".join(pm.SHAPES))
    p.add_argument("--factors", default=",".join(f"{f:g}" for f in pm.FACTORS), help="rates as multiples of the knee")
    p.add_argument("--knee", action="append", default=[], metavar="SHAPE=RATE",
                   help="a shape's knee in req/s (default: SHAPES' simulated H200 knees); repeatable")
    p.add_argument("--seeds", default="1,2,3", help="comma list: each seed is its own draw of requests")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each seed's arrivals (the run-to-run spread near a knee); --sim: needs --step-log, "
                        "each run drawing the served step-time ratios in another order")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per point")
    p.add_argument("--duration-of", action="append", default=[], metavar="SHAPE=SECONDS",
                   help="seconds of arrivals for one shape's points (e.g. more for a low-rate shape); repeatable")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt and output lengths")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="s")
    p.add_argument("--tbt-slo", type=float, default=0.1, help="s (token i due by arrival + TTFT + (i-1) TBT)")
    p.add_argument("--settle-s", type=float, default=2.0, help="pause between served points")
    p.add_argument("--profile", default=str(pm.DEFAULT_PROFILE), help="--sim: the EstimatorProfile that times the steps")
    p.add_argument("--step-log", action="append", default=[], metavar="JSONL",
                   help="--sim: a served step log (conflux serve --step-log); each simulated step's time is then "
                        "scaled by a served step's measured / modelled ratio (repeatable)")
    p.add_argument("--scheduler", action="append", default=[], metavar="FIELD=VALUE",
                   help="a SchedulerConfig field for both policies (served: conflux serve --FIELD VALUE; --sim: "
                        "the simulated scheduler's), e.g. deferred_wait_factor=3; repeatable")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-llama, tiny lengths and rates (CPU works)")
    args = p.parse_args(argv)
    args.device = resolve_device("cuda" if args.sim else args.device)
    if args.quick:
        quick_defaults(args, argv, (("--model", "model", "tiny-llama"), ("--shapes", "shapes", "uniform"),
                                    ("--factors", "factors", "1"), ("--seeds", "seeds", "1"),
                                    ("--duration", "duration", 3.0), ("--length-scale", "length_scale", 0.02),
                                    ("--knee", "knee", ["uniform=2"]), ("--ttft-slo", "ttft_slo", 5.0),
                                    ("--tbt-slo", "tbt_slo", 1.0), ("--settle-s", "settle_s", 0.5)))
    args.model = args.model or "llama-3.1-8b"
    args.ranks = args.ranks or default_ranks(args.device)
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    args.shapes = [x.strip() for x in str(args.shapes).split(",") if x.strip()]
    args.factors = [float(x) for x in str(args.factors).split(",") if x.strip()]
    args.seeds = [int(x) for x in str(args.seeds).split(",") if x.strip()]
    args.durations = {}
    for item in args.duration_of:
        name, _, sec = item.partition("=")
        if name not in pm.SHAPES or not sec:
            p.error(f"--duration-of {item!r}: want SHAPE=SECONDS with SHAPE one of {', '.join(pm.SHAPES)}")
        args.durations[name] = float(sec)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.sim and args.repeats > 1 and not args.step_log:
        p.error("--sim --repeats > 1 needs --step-log: without served step times every run is the same")
    bad = [s for s in args.shapes if s not in pm.SHAPES]
    if bad or not args.factors or not args.seeds or min(args.factors) <= 0:
        p.error(f"unknown shapes {bad}" if bad else "--factors (> 0) and --seeds must not be empty")
    args.scheduler = pm.scheduler_overrides(p, args.scheduler)
    args.knees = {name: s.knee for name, s in pm.SHAPES.items()}
    for item in args.knee:
        name, _, rate = item.partition("=")
        if name not in pm.SHAPES:
            p.error(f"--knee {item!r}: unknown shape {name!r}")
        args.knees[name] = float(rate)
    return finish_args(args, "policy_matrix.json")


def combine(args: argparse.Namespace, doc: dict) -> int:
    """The table and the targets over the points of several result files (their runs listed)."""
    runs = [json.loads(Path(f).read_text()) for f in args.combine]
    points = [p for r in runs for p in r.get("points", []) if "error" not in p]
    rows = pm.aggregate(points)
    doc.update(mode="combined", runs=[{k: r.get(k) for k in ("date", "command", "git_commit", "hardware", "mode")}
                                      for r in runs], points=points, rows=rows, verdict=pm.verdict(rows),
               table=pm.markdown(rows))
    args.out.write_text(json.dumps(doc, indent=1, default=str))
    print(doc["table"] + "\n\n" + json.dumps(doc["verdict"], indent=1), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc: dict = {**run_record(args, argv, REPO), "mode": "sim" if args.sim else "served", "points": []}
    if args.combine:
        return combine(args, doc)

    def save(points: list[dict], done: list[dict] | None = None) -> None:
        doc["points"] = (done or []) + points
        args.out.write_text(json.dumps(doc, indent=1, default=str))

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout: unwind, the server is stopped
    if args.sim:
        points = run_sim(args, save)
    else:
        from conflux_cluster.engine.models.config import PRESETS

        vocab = PRESETS[args.model].vocab_size
        points = []
        for policy in args.policies:
            points += run_served(args, policy, vocab, lambda ps, done=list(points): save(ps, done))
    rows = pm.aggregate([p for p in points if "error" not in p])
    doc.update(points=points, rows=rows, verdict=pm.verdict(rows), table=pm.markdown(rows))
    args.out.write_text(json.dumps(doc, indent=1, default=str))
    print(doc["table"] + "\n\n" + json.dumps(doc["verdict"], indent=1), flush=True)
    log(f"results: {args.out}")
    return 0 if all("error" not in p for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
