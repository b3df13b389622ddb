"""Control-plane cost of an XP instance on Ray: Compiled Graph vs plain actor calls.

Runs the real EngineCore over a RayExecutor (N CPU rank actors) on a fixed decode-heavy workload
and prints, per control plane, the mean control-plane time per iteration (wall of execute minus
the slowest rank's compute) and its share of the iteration time. Prints numbers; asserts nothing.

    .venv/bin/python benchmarks/bench_control_plane.py --model smollm2-135m-instruct --ranks 2
"""

from __future__ import annotations

import argparse
import time


def run_one(model: str, ranks: int, kind: str, requests: int, prompt_len: int, max_tokens: int) -> dict:
    import ray

    from conflux_cluster.actors.ray_executor import RayExecutor
    from conflux_cluster.engine.config import EngineConfig
    from conflux_cluster.engine.core import EngineCore
    from conflux_cluster.engine.loader import resolve_model
    from conflux_cluster.engine.sampling_params import SamplingParams

    cfg = EngineConfig(model=model, num_ranks=ranks, num_threads=1, load_progress=False, num_kv_blocks=256)
    src = resolve_model(model)
    ex = RayExecutor(cfg, cfg.blocks_per_rank(src.config), control_plane=kind)
    core = EngineCore(cfg, ex, source=src)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(requests):
            core.add_request(f"r{i}", [100 + (i + j) % 1000 for j in range(prompt_len)], params)
        step_s, t0 = 0.0, time.perf_counter()
        while core.has_unfinished():
            t = time.perf_counter()
            core.step()
            step_s += time.perf_counter() - t
        s = ex.stats
        return {"kind": s.kind, "iterations": s.calls, "ms_per_iter": 1e3 * step_s / max(1, s.calls),
                "control_ms_per_iter": 1e3 * s.control_s / max(1, s.calls), "share": s.control_s / step_s,
                "wall_s": time.perf_counter() - t0}
    finally:
        ex.shutdown()
        del ray


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="alternate the two kinds this many times")
    a = p.parse_args()
    import ray

    ray.init(num_cpus=a.ranks + 1, include_dashboard=False, log_to_driver=False)
    try:
        for r in range(a.rounds):
            for kind in ("compiled_graph", "actor_calls"):
                res = run_one(a.model, a.ranks, kind, a.requests, a.prompt_len, a.max_tokens)
                print(f"round {r} {res['kind']:>14}: {res['iterations']} iterations, {res['ms_per_iter']:.1f} ms/iter, "
                      f"control plane {res['control_ms_per_iter']:.2f} ms/iter = {100 * res['share']:.2f}% "
                      f"of iteration time", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
