#!/usr/bin/env python
"""Offline: which step-time model explains the shipped N=1 H200 samples best (CPU only, no GPU).

    python benchmarks/estimator_models.py

Reads the profiler's raw samples (engine/scheduler/profiles/raw-h200-llama-3.1-8b-n1.json: its mixed
batches) and the steady-burst step trace (docs/results/step_trace_h200x1_16x2k_profiled_1524utc.json:
its unprofiled prefill-carrying steps; their chunk histories are not recorded and are taken as 0) and
prints the MAPE of: the shipped profile (with κ); Eq. 2's attention overlap max(β·T_P, α·T_D) and the
sum β·T_P + α·T_D, each without κ and with a host floor F for steps that carry prefill (max(T, F)).
Findings in docs/scheduler.md ("κ may be a profiling artifact").
"""

from __future__ import annotations

import json
from pathlib import Path

from conflux_cluster.engine.scheduler.estimator import (BatchLoad, EstimatorProfile, LatencyEstimator,
                                                        prefill_attn_work, prefill_kv_tokens)

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "engine/scheduler/profiles/h200-llama-3.1-8b-n1.json"
RAW = ROOT / "engine/scheduler/profiles/raw-h200-llama-3.1-8b-n1.json"
TRACE = ROOT / "docs/results/step_trace_h200x1_16x2k_profiled_1524utc.json"


def raw_batches() -> list[tuple[BatchLoad, float]]:
    def load(s: dict) -> BatchLoad:
        return BatchLoad(tuple(s["prefill_tokens"]), tuple(s["decode_tokens"]), tuple(s["decode_context"]),
                         tuple(tuple(c) for c in s["prefill_chunks"]))
    return [(load(s), s["seconds"]) for s in json.loads(RAW.read_text())["hetero"]]


def burst_steps() -> list[tuple[BatchLoad, float]]:
    doc = json.loads(TRACE.read_text())
    profiled = set(doc["args"]["profile_steps"])
    return [(BatchLoad(tuple(s["prefill"]), tuple(s["decode"]), tuple(s["decode_context"]), ((s["prefill"][0], 0),)),
             s["execute_s"]) for i, s in enumerate(doc["steps"]) if i not in profiled and s["prefill"][0]]


def step_time(p: EstimatorProfile, load: BatchLoad, attention: str, floor: float) -> float:
    """All layers: GEMM + the two attention paths (overlapped: max, or one after the other: sum), no κ;
    at least ``floor`` for a step that carries prefill."""
    n = max(a + b for a, b in zip(load.prefill_tokens, load.decode_tokens))
    ch = load.prefill_chunks
    t_p = (p.beta * (p.f_prefill_attn(prefill_attn_work(ch, p.query_tile)) + p.f_prefill_kv.slope * prefill_kv_tokens(ch))
           if ch else 0.0)
    t_d = p.alpha * p.f_decode_attn(max(load.decode_context)) if any(load.decode_tokens) else 0.0
    t = p.num_layers * ((p.f_gemm(n) if n else 0.0) + (t_p + t_d if attention == "sum" else max(t_p, t_d)))
    return max(t, floor) if sum(load.prefill_tokens) else t


def mape(pred, rows: list[tuple[BatchLoad, float]]) -> float:
    return 100 * sum(abs(pred(load) - y) / y for load, y in rows) / len(rows)


def main() -> int:
    prof = EstimatorProfile.from_json(str(PROFILE))
    shipped = LatencyEstimator(prof)
    sets = {"profiler mixed batches": raw_batches(), "burst steps": burst_steps()}
    print("model".ljust(34) + "".join(f"{k} ({len(v)})".rjust(30) for k, v in sets.items()))
    print("shipped (κ)".ljust(34) + "".join(f"{mape(lambda l: shipped.estimate(l).total, v):29.1f}%"
                                           for v in sets.values()))
    for attention in ("max", "sum"):
        for floor in (0.0, 0.025, 0.03, 0.035, 0.04):
            name = f"{attention}, no κ, floor {1e3 * floor:.0f} ms"
            print(name.ljust(34) + "".join(f"{mape(lambda l: step_time(prof, l, attention, floor), v):29.1f}%"
                                           for v in sets.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
