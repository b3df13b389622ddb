"""The most a prefix cache can raise a throughput-bound goodput on a trace (CPU, seconds).

Σ work without a cache ÷ with an unbounded one (``conflux_cluster/sim/goodput_bound.py:
cache_work_ratio``): prefill FLOPs at the GPU's peak, decode KV reads at its HBM bandwidth, cached
prefix tokens free of their GEMMs. A simulated or served ratio above it comes from TTFT (a hit turns
a late long prompt into an on-time one), not from throughput.

    python benchmarks/prefix_work_bound.py --workload conversation --num-requests 2400,12031
"""
from __future__ import annotations

import argparse

from conflux_cluster.sim.goodput_bound import cache_work_ratio
from conflux_cluster.sim.prefix import reuse_bound
from conflux_cluster.sim.hardware import get_model
from conflux_cluster.sim.workloads import make_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="conversation", help="conversation | conversation-sessions | synthetic")
    ap.add_argument("--num-requests", default="2400", help="comma list of slice sizes")
    ap.add_argument("--seed", type=int, default=1, 
                    help="conversation-sessions: the sample (gpu_goodput.py's default: 1)")
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--tflops", type=float, default=790.0, help="dense bf16 TFLOP/s per GPU (H200: 790)")
    ap.add_argument("--hbm-tbs", type=float, default=4.3, help="HBM TB/s per GPU (H200: 4.3)")
    args = ap.parse_args()
    model = get_model(args.model)
    for n in (int(x) for x in args.num_requests.split(",")):
        wl = make_workload(args.workload, n, seed=args.seed)
        reuse = reuse_bound(wl)
        ratio = cache_work_ratio(wl, model, args.tflops * 1e12, args.hbm_tbs * 1e12)
        print(f"{args.workload} first {len(wl)} requests: reuse {100 * reuse:.1f} % of prompt tokens, "
              f"work ratio without / with the cache {ratio:.3f}")


if __name__ == "__main__":
    main()
