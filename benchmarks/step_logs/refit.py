#!/usr/bin/env python
"""The online refit (engine/scheduler/fitting/online.py) replayed on served step logs (CPU, no server).

    python -m benchmarks.step_logs refit steps-conflux.0.jsonl \\
        --profile engine/scheduler/profiles/h200-llama-3.1-8b-n1.json

Each logged step is estimated by the profile the scheduler would hold at that point (the shipped one
until a refit is accepted), then observed; refits run inline, every ``--every`` steps, on the
profiler's samples (``raw-<profile>`` beside it, when there) plus the latest ``--window`` steps. Prints
the MAPE of those estimates (every step; and after ``--after`` steps, once refits had data) beside the
fixed profile's on the same steps: the error the scheduler plans with, on steps it had not seen. A log
written by a server that refitted already has its own ``estimated_s``; that is printed too.
"""

from __future__ import annotations

import argparse
import json
import statistics

from conflux_cluster.engine.util.json_file import read_text_file
from conflux_cluster.engine.scheduler.estimator import EstimatorProfile, LatencyEstimator
from conflux_cluster.engine.scheduler.fitting.online import OnlineRefit, profiler_samples
from conflux_cluster.engine.scheduler.fitting.step_log import read_step_log


def replay(log: str, profile: EstimatorProfile, base: list, every: int, window: int) -> tuple[list[float], list[float], OnlineRefit]:
    """(online absolute relative errors, fixed-profile ones, the refit) over the log's steps in order."""
    refit = OnlineRefit(profile, base, every, window, background=False)
    fixed = LatencyEstimator(profile)
    online, still = [], []
    for s in read_step_log(log):
        online.append(abs(LatencyEstimator(refit.current).estimate(s.load).total - s.seconds) / s.seconds)
        still.append(abs(fixed.estimate(s.load).total - s.seconds) / s.seconds)
        refit.observe(s.load, s.seconds)
        refit.poll()
    return online, still, refit


def logged_errors(log: str) -> list[float]:
    """|estimated_s - seconds| / seconds of the log's own lines: what the serving scheduler estimated."""
    out = []
    for text in read_text_file(log).splitlines():
        try:
            d = json.loads(text)
            est, sec = float(d["estimated_s"]), float(d["seconds"])
        except (ValueError, KeyError, TypeError):
            continue
        if est > 0 and sec > 0:
            out.append(abs(est - sec) / sec)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", help="served step logs (steps-<system>.<i>.jsonl[.gz])")
    p.add_argument("--profile", required=True, help="the profile the server started with")
    p.add_argument("--every", type=int, default=64, help="refit every this many steps (SchedulerConfig.refit_every)")
    p.add_argument("--window", type=int, default=512, help="latest steps a refit uses (refit_window)")
    p.add_argument("--after", type=int, default=256, help="also report the MAPE of the steps after this many")
    a = p.parse_args(argv)
    profile = EstimatorProfile.from_json(a.profile)
    base = profiler_samples(a.profile)
    print(f"profile {a.profile}; profiler samples {len(base)}; refit every {a.every} over {a.window} steps")
    for log in a.logs:
        online, still, refit = replay(log, profile, base, a.every, a.window)
        served = logged_errors(log)
        pct = lambda xs: f"{100 * statistics.fmean(xs):5.2f} %" if xs else "    –"  # noqa: E731
        print(f"{log}: {len(online)} steps, refits accepted {refit.refits}, refused {refit.rejected}\n"
              f"  MAPE online {pct(online)}  fixed profile {pct(still)}  (the server's own estimates {pct(served)})\n"
              f"  after step {a.after}: online {pct(online[a.after:])}  fixed {pct(still[a.after:])}")
    return 0

