#!/usr/bin/env python
"""The latency estimator's error on served steps (``conflux serve --step-log``; CPU, no server).

    python -m benchmarks.step_logs estimator steps.0.jsonl --profile engine/scheduler/profiles/h200-llama-3.1-8b-n1.json
    python -m benchmarks.step_logs estimator steps.0.jsonl --profile P.json --refit raw-h200-llama-3.1-8b-n1.json

Prints the MAPE of ``--profile`` on every logged step, by family (decode-only, prefill-only, mixed)
and by the longest prefill history in the step, with the median measured / estimated ratio (the
scheduler's ``step_scale`` corrects the budget by about that). With ``--refit RAW``, the profile is
refitted on the profiler's RAW samples plus the even-numbered served steps and judged on the odd
ones: the held-out MAPE on real iterations that issue 11 asks for. With ``--judge-on OTHER.jsonl``,
the refit uses every step of the logs and is judged on OTHER (e.g. fit on one workload's steps, judge
on another's); ``--save-profile P.json`` writes the refitted profile (what `conflux serve
--estimator-profile` reads).

    python -m benchmarks.step_logs estimator synthetic.jsonl --profile P.json --refit RAW.json \
        --judge-on toolagent.jsonl --save-profile refit.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from conflux_cluster.engine.scheduler.fitting.samples import Measurements, fit_measurements
from conflux_cluster.engine.scheduler.estimator import EstimatorProfile, LatencyEstimator
from conflux_cluster.engine.scheduler.fitting.fit import BatchSample
from conflux_cluster.engine.scheduler.fitting.step_log import family, read_step_log

HISTORY_BANDS = ((0, "no history"), (1, "history < 8K"), (8192, "history 8K-32K"), (32768, "history >= 32K"))


def band(s: BatchSample) -> str:
    h = max((c for _, c in s.load.prefill_chunks), default=None)
    if h is None:
        return "no prefill"
    return [name for lo, name in HISTORY_BANDS if h >= lo][-1]


def errors(profile: EstimatorProfile, samples: list[BatchSample]) -> dict:
    """MAPE (%) and median measured / estimated, overall and per family and history band."""
    est = LatencyEstimator(profile)
    rows = [(s, est.estimate(s.load).total) for s in samples]

    def summary(group: list) -> dict:
        return {"steps": len(group), "mape_percent": 100 * statistics.fmean(abs(e - s.seconds) / s.seconds
                                                                            for s, e in group),
                "median_measured_over_estimated": statistics.median(s.seconds / e for s, e in group)}

    out = {"all": summary(rows)}
    for key in ("family", "band"):
        groups: dict[str, list] = {}
        for s, e in rows:
            groups.setdefault(family(s.load) if key == "family" else band(s), []).append((s, e))
        out.update({f"{key}: {k}": summary(v) for k, v in sorted(groups.items())})
    return out


def refit(raw: str, train: list[BatchSample], judged: list[BatchSample], profile: EstimatorProfile,
          train_name: str, query_tile: int | None = None) -> tuple[EstimatorProfile, dict]:
    """Fit on RAW + ``train``; MAPE on ``judged`` (``query_tile``: default the profile's)."""
    m = Measurements.load(raw) + Measurements.from_samples(train)
    fitted = fit_measurements(m, model=profile.model, hardware=profile.hardware, num_ranks=profile.num_ranks,
                              query_tile=query_tile or profile.query_tile,
                              num_layers=profile.num_layers, meta={"refit_of": [raw, train_name]})
    return fitted, errors(fitted, judged)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", help="step logs (.jsonl) of one engine configuration")
    p.add_argument("--profile", required=True, help="EstimatorProfile JSON to judge")
    p.add_argument("--refit", default=None, metavar="RAW", help="profiler raw JSON to refit with (see above)")
    p.add_argument("--judge-on", nargs="+", default=None, metavar="LOG",
                   help="with --refit: fit on every step of the logs, judge on these (default: even / odd steps)")
    p.add_argument("--save-profile", default=None, help="with --refit: write the refitted profile here")
    p.add_argument("--query-tile", type=int, default=None,
                   help="with --refit: the refit's query_tile (default: the judged profile's)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    a = p.parse_args(argv)
    if (a.judge_on or a.save_profile) and not a.refit:
        p.error("--judge-on and --save-profile need --refit")
    samples = [s for path in a.logs for s in read_step_log(path)]
    if not samples:
        p.error("the logs hold no steps")
    profile = EstimatorProfile.from_json(a.profile)
    result = {"logs": a.logs, "profile": a.profile, "judged": errors(profile, samples)}
    refit_title = ""
    if a.refit:
        if a.judge_on:
            judged = [s for path in a.judge_on for s in read_step_log(path)]
            if not judged:
                p.error("the --judge-on logs hold no steps")
            fitted, heldout = refit(a.refit, samples, judged, profile, "served steps: " + ", ".join(a.logs),
                                    a.query_tile)
            refit_title = f"refitted on the profiler's samples + every step, judged on {len(judged)} steps of --judge-on:"
        else:
            fitted, heldout = refit(a.refit, samples[0::2], samples[1::2], profile, "served steps (even)",
                                    a.query_tile)
            refit_title = "refitted on the profiler's samples + even steps, judged on the odd steps:"
        result["refit"] = {"profile": asdict(fitted), "heldout": heldout}
        if a.save_profile:
            fitted.to_json(a.save_profile)

    def show(title: str, figures: dict) -> None:
        print(title)
        for k, v in figures.items():
            print(f"  {k:28s} {v['steps']:6d} steps  MAPE {v['mape_percent']:5.1f} %  measured/estimated "
                  f"median {v['median_measured_over_estimated']:.3f}")
    show(f"{a.profile} on {len(samples)} served steps:", result["judged"])
    if a.refit:
        show(refit_title, result["refit"]["heldout"])
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0

