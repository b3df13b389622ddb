"""Prefix-cache hit rate and SLO attainment of one simulated instance at fixed rates, with and without
the in-flight prefix wait (docs/prefix-caching.md, "Waiting for a prefix that is being prefilled").

    .venv/bin/python benchmarks/prefix_hit_by_rate.py --num-requests 60 --seed 1 --rates 0.25,1,2,4,6

Prints, per rate, the hit rate of ``conflux-pc-eager`` (no wait) and ``conflux-pc`` against the
workload's reuse bound. Roofline costs (H200 preset), Llama-8B, one instance of ``--gpus`` ranks.
"""

from __future__ import annotations

import argparse

from conflux_cluster.sim import workloads as W
from conflux_cluster.sim.cluster import run_cluster
from conflux_cluster.sim.hardware import get_hardware, get_model
from conflux_cluster.sim.limits import EngineLimits
from conflux_cluster.sim.metrics import SLO
from conflux_cluster.sim.prefix import reuse_bound
from conflux_cluster.sim.registry import Setting


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="conversation-sessions")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--ttft", type=float, default=5.0)
    p.add_argument("--tbt", type=float, default=0.1)
    p.add_argument("--rates", default="0.25,1,2,4,6", help="comma-separated req/s")
    args = p.parse_args()
    model, hw = get_model("llama-8b"), get_hardware("h200")
    s = Setting(model, hw, args.gpus, 1, SLO(args.ttft, args.tbt), None, EngineLimits.from_engine())
    wl = W.cap_lengths(W.make_workload(args.workload, args.num_requests, seed=args.seed), model.max_context)
    print(f"{args.workload}, {len(wl)} requests (seed {args.seed}), {args.gpus} GPU(s): reuse bound "
          f"{100 * reuse_bound(wl):.1f} % of prompt tokens")
    print(f"{'rate':>6}  {'hit, no wait':>12}  {'hit, wait':>10}  {'attainment no wait / wait':>26}")
    for rate in (float(r) for r in args.rates.split(",")):
        eager = run_cluster(s, wl, "conflux-pc-eager", 1, "lowest_load", rate)
        wait = run_cluster(s, wl, "conflux-pc", 1, "lowest_load", rate)
        print(f"{rate:>6g}  {100 * eager['prefix_hit_rate']:>11.1f}%  {100 * wait['prefix_hit_rate']:>9.1f}%  "
              f"{100 * eager['attainment']:>12.1f}% / {100 * wait['attainment']:.1f}%")


if __name__ == "__main__":
    main()
