#!/usr/bin/env python
"""Re-run the simulator on the real points of ``benchmarks/gpu_goodput.py`` results (CPU, no server).

    python -m benchmarks.simulator resimulate docs/results/gpu_goodput_h200x1_*.json \\
        --profile engine/scheduler/profiles/h200-llama-3.1-8b-n1.json

For every system, workload and rate a result file measured through ``conflux serve``, the simulator
replays the same workload slice at the same rate (the run's own flags: systems, lengths, SLOs, seed)
with ``--profile`` (e.g. a refit, or the shipped profile after a change), and prints real vs simulated
per-token attainment and TTFT / TBT p50 / p99. A rate point of the real run that was invalid stays
in the file and is printed like the others: read the results' docs first.

With ``--systems`` it simulates other systems at the rates the run measured, e.g. the chunked
baselines at other token budgets (the paper sweeps the budget and keeps the best)::

    python -m benchmarks.simulator resimulate RESULT.json --profile P.json --systems chunked-sp++@512,chunked-sp++@1024

With ``--plan-profile SHIPPED --profile REFIT`` ConfluxServe plans with the profile the server used
while its steps take what a profile refitted on the server's own steps says (``benchmarks/step_logs/estimator.py
--refit``): the estimator's error and the step calibration that corrects it, modelled.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks import gpu_goodput as gg
from conflux_cluster.bench.goodput_compare import shape_workload, sim_point, workload_spec
from conflux_cluster.bench.served_systems import pick
from conflux_cluster.engine.scheduler.estimator import EstimatorProfile
from conflux_cluster.sim.step_noise import FAMILIES, StepNoise

FIELDS = ("attainment", "ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99")


def run_args(doc: dict, profile: str) -> argparse.Namespace:
    """The result's own gpu_goodput flags (its recorded command, without --out), on 'cuda' as it ran."""
    argv = shlex.split(doc["command"])[1:]
    if "--out" in argv:
        i = argv.index("--out")
        del argv[i:i + 2]
    return gg.parse_args([*argv, "--device", "cuda", "--profile", profile])


def resimulate(doc: dict, profile_path: str, systems: str | None = None,
               rates: list[float] | None = None, plan_profile: str | None = None,
               noise: StepNoise | None = None) -> list[dict]:
    """Rows of (system, workload, rate, real, sim). ``systems`` (a ``--systems`` list) simulates those
    instead of the run's own, at every rate any system of the run was measured at on that workload
    (or at ``rates``); ``real`` is the measured point where that very system ran at that rate, else None.
    ``plan_profile``: ConfluxServe's scheduler plans with it while ``profile_path`` times the steps.
    ``noise``: served steps' measured / modelled ratios replayed on every simulated step."""
    args = run_args(doc, profile_path)
    profile = EstimatorProfile.from_json(profile_path)
    measured = [r for r in doc["systems"].values() if r.get("workloads")]
    if not measured:
        return []
    workloads = list(dict.fromkeys(w for r in measured for w in r["workloads"]))
    context = measured[0]["max_model_len"]
    rows = []
    for system in (pick(systems) if systems else args.system_list):
        res = doc["systems"].get(system.name, {})
        ecfg = gg.engine_config(args, system)
        setting = gg.sim_setting(args, system, ecfg, profile)
        if plan_profile:
            setting = replace(setting, plan_profile=EstimatorProfile.from_json(plan_profile))
        if noise is not None:
            setting = replace(setting, step_noise=noise)
        factory = system.sim_config(setting.limits, args.ranks).build(setting)
        for wname in workloads:
            own = {p["rate"]: p for p in (res.get("workloads", {}).get(wname) or {}).get("real", [])}
            at = sorted(own) if not systems else sorted({p["rate"] for r in measured
                                                         for p in (r["workloads"].get(wname) or {}).get("real", [])})
            kind, prompt_scale = workload_spec(wname, args.prompt_scale)
            wl = shape_workload(kind, args.num_requests, res.get("max_model_len", context),
                                prompt_scale, args.output_scale, args.max_output, args.seed)
            for rate in (rates or at):
                sim = sim_point(factory, wl, setting.slo, rate, system.instances, None)
                real = own.get(rate)
                rows.append({"system": system.name, "workload": wname, "rate": rate,
                             "real": {k: real[k] for k in FIELDS} if real else None,
                             "sim": {k: sim[k] for k in FIELDS}})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="gpu_goodput.py JSON files")
    p.add_argument("--profile", required=True, help="EstimatorProfile JSON for the simulator")
    p.add_argument("--systems", default=None,
                   help="simulate these systems (gpu_goodput's names, e.g. chunked-sp++@512) at the rates the run "
                        "measured, instead of the run's own: what a budget sweep would have given")
    p.add_argument("--rates", default=None, help="comma list of req/s to simulate instead of the measured rates")
    p.add_argument("--plan-profile", default=None,
                   help="ConfluxServe's scheduler plans with this profile while --profile times the steps (e.g. "
                        "--profile refit on served steps, --plan-profile the shipped one the server planned with): "
                        "the engine's estimator error and its step calibration, modelled")
    p.add_argument("--step-logs", nargs="+", default=None, metavar="LOG",
                   help="served step logs (steps-<system>.<i>.jsonl): every simulated step of the engine-scheduler "
                        "systems takes its modelled time times a measured / modelled ratio of these steps (same "
                        "step family, seeded), so the simulator sees the served engine's spread of step times")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    noise = StepNoise.from_step_logs(a.step_logs, EstimatorProfile.from_json(a.profile)) if a.step_logs else None
    if noise is not None:
        print("step-time ratios (measured / modelled, median): " + ", ".join(
            f"{f} {noise.median(f):.3f} ({len(noise.ratios[f])} steps)" for f in FAMILIES if noise.ratios[f]))
    rates = sorted(float(x) for x in a.rates.split(",")) if a.rates else None
    if rates is not None and (not rates or rates[0] <= 0):
        p.error("--rates must be positive numbers")
    rows = []
    for path in a.results:
        rows += resimulate(json.loads(Path(path).read_text()), a.profile, a.systems, rates, a.plan_profile, noise)
    print(f"{'system':18s}{'workload':14s}{'rate':>6s}  attainment real/sim   TTFT p50, p99 real/sim (s)    "
          f"TBT p50, p99 real/sim (ms)")
    for r in rows:
        re, si = r["real"], r["sim"]
        real = (f"{100 * re['attainment']:5.1f}", f"{re['ttft_p50']:.2f}, {re['ttft_p99']:.1f}",
                f"{1e3 * re['tbt_p50']:.0f}, {1e3 * re['tbt_p99']:.0f}") if re else ("    –", "–", "–")
        print(f"{r['system']:18s}{r['workload']:14s}{r['rate']:6g}  {real[0]} / {100 * si['attainment']:5.1f} %      "
              f"{real[1]} / {si['ttft_p50']:.2f}, {si['ttft_p99']:.1f}        {real[2]} / "
              f"{1e3 * si['tbt_p50']:.0f}, {1e3 * si['tbt_p99']:.0f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"profile": a.profile, "rows": rows}, indent=1))
    return 0

