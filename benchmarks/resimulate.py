#!/usr/bin/env python
"""Re-run the simulator on the real points of ``benchmarks/gpu_goodput.py`` results (CPU, no server).

    python benchmarks/resimulate.py docs/results/gpu_goodput_h200x1_*.json \\
        --profile engine/scheduler/profiles/h200-llama-3.1-8b-n1.json

For every system, workload and rate a result file measured through ``conflux serve``, the simulator
replays the same workload slice at the same rate (the run's own flags: systems, lengths, SLOs, seed)
with ``--profile`` (e.g. a refit, or the shipped profile after a change), and prints real vs simulated
per-token attainment and TTFT / TBT p50 / p99. A rate point of the real run that was invalid stays
in the file and is printed like the others: read the results' docs first.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_goodput as gg  # noqa: E402

from conflux_cluster.bench.goodput_compare import shape_workload, sim_point, workload_spec  # noqa: E402
from conflux_cluster.engine.scheduler.estimator import EstimatorProfile  # noqa: E402

FIELDS = ("attainment", "ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99")


def run_args(doc: dict, profile: str) -> argparse.Namespace:
    """The result's own gpu_goodput flags (its recorded command, without --out), on 'cuda' as it ran."""
    argv = shlex.split(doc["command"])[1:]
    if "--out" in argv:
        i = argv.index("--out")
        del argv[i:i + 2]
    return gg.parse_args([*argv, "--device", "cuda", "--profile", profile])


def resimulate(doc: dict, profile_path: str) -> list[dict]:
    args = run_args(doc, profile_path)
    profile = EstimatorProfile.from_json(profile_path)
    rows = []
    for system in args.system_list:
        res = doc["systems"].get(system.name, {})
        ecfg = gg.engine_config(args, system)
        setting = gg.sim_setting(args, system, ecfg, profile)
        factory = system.sim_config(setting.limits).build(setting)
        for wname, w in res.get("workloads", {}).items():
            kind, prompt_scale = workload_spec(wname, args.prompt_scale)
            wl = shape_workload(kind, args.num_requests, res["max_model_len"],
                                prompt_scale, args.output_scale, args.max_output, args.seed)
            for real in w["real"]:
                sim = sim_point(factory, wl, setting.slo, real["rate"], system.instances, None)
                rows.append({"system": system.name, "workload": wname, "rate": real["rate"],
                             "real": {k: real[k] for k in FIELDS}, "sim": {k: sim[k] for k in FIELDS}})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="gpu_goodput.py JSON files")
    p.add_argument("--profile", required=True, help="EstimatorProfile JSON for the simulator")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    rows = []
    for path in a.results:
        rows += resimulate(json.loads(Path(path).read_text()), a.profile)
    print(f"{'system':14s}{'workload':14s}{'rate':>6s}  attainment real/sim   TTFT p50, p99 real/sim (s)    "
          f"TBT p50, p99 real/sim (ms)")
    for r in rows:
        re, si = r["real"], r["sim"]
        print(f"{r['system']:14s}{r['workload']:14s}{r['rate']:6g}  {100 * re['attainment']:5.1f} / "
              f"{100 * si['attainment']:5.1f} %      {re['ttft_p50']:.2f}, {re['ttft_p99']:.1f} / {si['ttft_p50']:.2f}, "
              f"{si['ttft_p99']:.1f}        {1e3 * re['tbt_p50']:.0f}, {1e3 * re['tbt_p99']:.0f} / "
              f"{1e3 * si['tbt_p50']:.0f}, {1e3 * si['tbt_p99']:.0f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"profile": a.profile, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
