"""Cluster scale: K instances behind the global router (``conflux_cluster.router.policies``).

Each arrival asks the router, which sees every instance's fresh ``InstanceLoad`` (the engine
scheduler's own report: queued prefill tokens, decode context, KV use, prefill capacity), so no
in-flight correction is needed here. Reported per policy: goodput (total and per GPU) and the
wall time of one routing decision.
"""

from __future__ import annotations

from tqdm import tqdm

from conflux_cluster.router.registry import make_policy
from conflux_cluster.router.prefix_aware import PrefixRouting

from .core import Simulation
from .evaluate import start_rate
from .goodput import TARGET, search_threshold
from .hardware import kv_tokens_per_group
from .prefix import prefix_hit_rate, reuse_bound
from .metrics import summarize
from .registry import Setting, sweep
from .workloads import TRACE_BLOCK_TOKENS, Workload, scale_to_rate


def prefix_routing(s: Setting, prefix_weight: float = PrefixRouting.prefix_weight) -> PrefixRouting:
    """``prefix_aware`` in the simulator: trace blocks as prefix blocks, an instance's KV as its memory."""
    return PrefixRouting(prefix_weight=prefix_weight, block_tokens=TRACE_BLOCK_TOKENS,
                         capacity_tokens=instance_kv_tokens(s))


def instance_kv_tokens(s: Setting) -> int:
    """KV tokens of one instance (all its ranks): the size of its prefix cache at most."""
    costs = s.costs()
    return kv_tokens_per_group(costs.model, costs.hw, costs.tp) * s.num_ranks


def run_cluster(s: Setting, workload: Workload, system: str, k: int, policy: str, rate: float,
                stop_below: float | None = None, prefix_weight: float = PrefixRouting.prefix_weight) -> dict:
    """One run of ``k`` instances at total ``rate``: attainment, router cost, prefix-cache hits."""
    cfg = sweep(system, s, quick=True)[0]
    router = make_policy(policy, seed=0, prefix=prefix_routing(s, prefix_weight)) if k > 1 else None
    sim = Simulation(cfg.build(s), scale_to_rate(workload, rate), s.slo, k, router)
    res = sim.run(stop_below=stop_below)
    summ = summarize(res.records, s.slo)
    return {"rate": rate, "attainment": summ.attainment, "stopped_early": res.stopped_early,
            "router_us": 1e6 * res.router_seconds / res.router_decisions if res.router_decisions else 0.0,
            "wall_s": res.wall_seconds, "prefix_hit_rate": prefix_hit_rate(sim.instances)}


def cluster_goodput(s: Setting, workload: Workload, system: str, k: int, policy: str,
                    rel_tol: float = 0.05, prefix_weight: float = PrefixRouting.prefix_weight) -> dict:
    points = []

    def passes(rate: float) -> bool:
        points.append(run_cluster(s, workload, system, k, policy, rate, stop_below=TARGET,
                                  prefix_weight=prefix_weight))
        return points[-1]["attainment"] >= TARGET

    g = search_threshold(passes, k * start_rate(s, workload), rel_tol)
    routed = [p["router_us"] for p in points if p["router_us"]]
    at = [p for p in points if p["attainment"] >= TARGET]  # the passing point nearest the goodput
    best = max(at, key=lambda p: p["rate"]) if at else None
    return {"instances": k, "policy": policy, "system": system, "goodput": g,
            "goodput_per_gpu": g / (k * s.num_gpus), "router_us": sum(routed) / len(routed) if routed else 0.0,
            "prefix_hit_rate": best["prefix_hit_rate"] if best else 0.0, "points": points}


PREFIX_VARIANTS = (("conflux", "lowest_load"), ("conflux-pc", "lowest_load"), ("conflux-pc", "prefix_aware"))


def compare_prefix(s: Setting, workload: Workload, k: int, rel_tol: float = 0.05, progress: bool = True,
                   variants: tuple[tuple[str, str], ...] = PREFIX_VARIANTS,
                   prefix_weight: float = PrefixRouting.prefix_weight) -> dict:
    """Goodput of ``k`` instances without the prefix cache (lowest_load), with it, and with it plus
    prefix-aware routing; the hit rate at each goodput next to the trace's reuse bound (an infinite
    cache shared by all instances, and an LRU of all instances' KV together)."""
    out = {"instances": k, "reuse_bound": reuse_bound(workload), "prefix_weight": prefix_weight,
           "reuse_bound_at_cache": reuse_bound(workload, capacity_tokens=k * instance_kv_tokens(s)),
           "variants": []}
    for system, policy in tqdm(variants, desc=f"prefix x{k}", disable=not progress, leave=False):
        out["variants"].append(cluster_goodput(s, workload, system, k, policy, rel_tol, prefix_weight))
    base = out["variants"][0]["goodput"]
    for v in out["variants"]:
        v["vs_first"] = v["goodput"] / base if base else float("inf")
    return out


def format_prefix(res: dict) -> str:
    lines = [f"{res['instances']} instances; trace reuse bound: {100 * res['reuse_bound']:.1f}% of prompt tokens "
             f"(infinite shared cache), {100 * res['reuse_bound_at_cache']:.1f}% (one LRU of all instances' KV); "
             f"prefix_aware prefix_weight {res['prefix_weight']:g}"]
    for v in res["variants"]:
        lines.append(f"{v['system']:11s} + {v['policy']:13s}: goodput {v['goodput']:.2f} req/s "
                     f"({v['vs_first']:.2f}x the first), prefix hit rate {100 * v['prefix_hit_rate']:.1f}%")
    return "\n".join(lines)


def compare_routers(s: Setting, workload: Workload, system: str, k: int, policies: list[str],
                    rates: list[float] | None = None, progress: bool = True) -> dict:
    """Per policy: a goodput search (``rates`` None) or runs at the given total rates."""
    out = {}
    for policy in tqdm(policies, desc=f"{k} instances", disable=not progress, leave=False):
        if rates:
            out[policy] = {"instances": k, "policy": policy,
                           "runs": [run_cluster(s, workload, system, k, policy, r) for r in rates]}
        else:
            out[policy] = cluster_goodput(s, workload, system, k, policy)
    return out


def format_cluster(res: dict) -> str:
    lines = []
    for policy, r in res.items():
        if "runs" in r:
            runs = ", ".join(f"{x['rate']:.1f}/s: {100 * x['attainment']:.1f}%" for x in r["runs"])
            us = max((x["router_us"] for x in r["runs"]), default=0.0)
            lines.append(f"{policy:13s} x{r['instances']}: {runs}  (router {us:.1f} us/decision)")
        else:
            lines.append(f"{policy:13s} x{r['instances']}: goodput {r['goodput']:.2f} req/s "
                         f"({r['goodput_per_gpu']:.3f} per GPU), router {r['router_us']:.1f} us/decision")
    return "\n".join(lines)


def router_decision_us(policy: str, k: int, repeats: int = 2000, seed: int = 0) -> float:
    """Microbenchmark: mean wall µs of one ``choose`` over ``k`` varied loads (no simulation around it)."""
    import random
    import time

    from conflux_cluster.engine.contracts.cluster import InstanceLoad

    rng = random.Random(seed)
    loads = [InstanceLoad(queued_prefill_tokens=rng.randrange(0, 50000), num_decoding=rng.randrange(0, 100),
                          decode_context_tokens=rng.randrange(0, 10**6), kv_utilization=rng.random(),
                          prefill_capacity=2e5, num_ranks=4) for _ in range(k)]
    router = make_policy(policy, seed=seed)
    best = float("inf")
    for _ in range(5):  # best of 5 batches: the machine is shared
        t = time.perf_counter()
        for _ in range(repeats // 5):
            router.choose(loads)
        best = min(best, (time.perf_counter() - t) / (repeats // 5))
    return 1e6 * best


if __name__ == "__main__":  # python -m conflux_cluster.sim.cluster: router decision time table
    policies = ("lowest_load", "round_robin", "power_of_two", "random")
    print("instances | " + " | ".join(policies))
    for k in (1, 4, 16, 64):
        print(f"{k} | " + " | ".join(f"{router_decision_us(p, k):.1f} us" for p in policies))
