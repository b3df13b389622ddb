"""How close a served goodput is to what any scheduler could reach on one instance (CPU, no server).

For ``benchmarks/gpu_goodput.py`` results, rebuilds each workload as the run sent it (same requests,
lengths, seed, server context) and prints ``conflux_cluster/sim/goodput_bound.py``'s bound under a
fitted profile: the attainment no schedule can exceed at each rate, the highest rate where it still
reaches 95 %, and each system's real goodput as a fraction of that bound. With ``--step-logs`` the
profile's slopes are first scaled by how much dearer the served steps were than their slope work:
what a scheduler on this engine could reach (an estimate, no longer a strict bound). A system near the bound
leaves no room for another scheduler to beat it by much; a baseline near it caps any ratio over it.

    python -m benchmarks.simulator bound docs/results/gpu_goodput_h200x1_toolagent_n120_baseline_0939utc.json \
        --profile engine/scheduler/profiles/h200-llama-3.1-8b-n1.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from conflux_cluster.bench.goodput_compare import shape_workload, workload_spec
from conflux_cluster.engine.scheduler.estimator import EstimatorProfile
from conflux_cluster.engine.scheduler.fitting.step_log import read_step_log
from conflux_cluster.sim.goodput_bound import (attainment_bound, geometric_rates, goodput_bound, scaled_profile,
                                               served_work_scale)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="gpu_goodput.py JSON files")
    ap.add_argument("--profile", required=True, help="EstimatorProfile JSON (the one the servers ran with)")
    ap.add_argument("--per-doubling", type=int, default=8, help="bound grid (1/16 to 256 req/s): rates per doubling")
    ap.add_argument("--step-logs", nargs="+", metavar="LOG",
                    help="served step logs: scale the profile's slopes by their measured time over their slope "
                         "work (an engine-efficiency bound, no longer strict)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    profile = EstimatorProfile.from_json(args.profile)
    if args.step_logs:
        k = served_work_scale([s for log in args.step_logs for s in read_step_log(log)], profile)
        print(f"served steps take {k:.3f}x their slope work: the bound's slopes scaled by it")
        profile = scaled_profile(profile, k)
    grid = geometric_rates(1 / 16, 256, args.per_doubling)
    rows = []
    for path in args.results:
        run = json.loads(Path(path).read_text())
        a = run["args"]
        for system, sres in run["systems"].items():
            for spec, w in sres["workloads"].items():
                kind, scale = workload_spec(spec, a["prompt_scale"])
                wl = shape_workload(kind, a["num_requests"], sres["max_model_len"], scale, a["output_scale"],
                                    a["max_output"], seed=a["seed"])
                real = [p["rate"] for p in w["real"]]
                best = goodput_bound(wl, grid, profile, a["ttft_slo"])
                at_real = {r: attainment_bound(wl, r, profile, a["ttft_slo"]).attainment_bound for r in real}
                rows.append({"file": Path(path).name, "system": system, "workload": spec,
                             "requests": len(wl), "goodput_real": w["goodput_real"], "goodput_bound": best,
                             "real_over_bound": w["goodput_real"] / best if best else None,
                             "points": [{"rate": p["rate"], "attainment_real": p["attainment"],
                                         "attainment_bound": at_real[p["rate"]]} for p in w["real"]]})
    print(f"{'system':<20}{'workload':<24}{'n':>5}{'real':>8}{'bound':>8}{'real/bound':>12}   attainment real / bound")
    for r in rows:
        pts = ", ".join(f"{p['rate']:g}: {100 * p['attainment_real']:.1f}/{100 * p['attainment_bound']:.1f}"
                        for p in r["points"])
        ratio = f"{r['real_over_bound']:.2f}" if r["real_over_bound"] is not None else "–"
        print(f"{r['system']:<20}{r['workload']:<24}{r['requests']:>5}{r['goodput_real']:>8.3f}"
              f"{r['goodput_bound']:>8.3f}{ratio:>12}   {pts}")
    if args.out:
        Path(args.out).write_text(json.dumps({"profile": args.profile, "step_logs": args.step_logs, "rows": rows},
                                             indent=1))

