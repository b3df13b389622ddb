#!/usr/bin/env python
"""What a served step log says about speed and steadiness (``conflux serve --step-log``; CPU, no server).

    python -m benchmarks.step_logs stats docs/results/steps/h200x1_conversation_conflux_2117utc.jsonl.gz

Prints, per log:

* prefill throughput: prompt tokens per second of the steps that carried prefill, overall and by the
  history its chunks ran over (10K-token bands; a step's time is shared among its chunks by tokens);
* step-time spread: decode-only steps grouped by decode batch and total context (``--context-bin``
  tokens), groups of at least ``--min-group`` steps; the coefficient of variation per group, its
  median and its step-weighted mean (issue 11's "identical iterations vary <= 5 %");
* late decode steps: decode-only steps over ``--late-factor`` times the estimate they were planned with,
  counted by the step after them (one carrying prefill, or decode-only): ranks that launch a step before
  they read the one before it can hold a decode step's tokens behind the next step's launch;
* launch host time (logs of ranks that launch ahead, which record ``launch_s``): per step family the
  median launch and how many launches took at least half their step's time (a launch that long waited
  on the device: it cannot run ahead of it), and the estimator's MAPE on those steps and on the others.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

from conflux_cluster.engine.scheduler.fitting.fit import BatchSample
from conflux_cluster.engine.scheduler.fitting.step_log import read_logged_steps
from conflux_cluster.engine.util.json_file import read_text_file

BAND = 10_000  # history band width (tokens) of the prefill throughput table


def prefill_rates(samples: list[BatchSample]) -> tuple[float, dict[int, tuple[int, float, int]]]:
    """(tokens/s over all prefill-carrying steps, {band: (tokens, seconds, chunks)})."""
    tokens = seconds = 0.0
    bands: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    for s in samples:
        total = sum(s.load.prefill_tokens)
        if not total:
            continue
        tokens += total
        seconds += s.seconds
        for length, history in s.load.prefill_chunks:
            b = bands[history // BAND]
            b[0] += length
            b[1] += s.seconds * length / total
            b[2] += 1
    return tokens / seconds if seconds else 0.0, {k: tuple(v) for k, v in sorted(bands.items())}


def decode_spread(samples: list[BatchSample], context_bin: int, min_group: int) -> list[tuple[float, int]]:
    """(coefficient of variation, steps) per group of decode-only steps of one batch and context bin."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for s in samples:
        if not any(s.load.prefill_tokens):
            groups[(s.load.decode_tokens, tuple(c // context_bin for c in s.load.decode_context))].append(s.seconds)
    return [(statistics.pstdev(v) / statistics.mean(v), len(v)) for v in groups.values() if len(v) >= min_group]


def late_decode_steps(logged: list[tuple[BatchSample, float | None]], factor: float
                      ) -> dict[str, tuple[int, int, float | None]]:
    """Decode-only steps with an estimate, by the step after them ("prefill": it carries prefill; "decode": it
    does not): (steps, those over ``factor`` x their estimate, the median measured / estimated ratio)."""
    ratios: dict[str, list[float]] = {"prefill": [], "decode": []}
    for (s, est), (after, _) in zip(logged, logged[1:]):
        if any(s.load.prefill_tokens) or not est:
            continue
        ratios["prefill" if any(after.load.prefill_tokens) else "decode"].append(s.seconds / est)
    return {k: (len(v), sum(r > factor for r in v), statistics.median(v) if v else None) for k, v in ratios.items()}


Launches = dict[str, list[tuple[float, float, float | None]]]  # family -> (launch s, step s, estimated s)


def launch_times(by: Launches, share: float = 0.5) -> dict[str, tuple[int, float, float, int]]:
    """Per family of ``launch_rows``: (steps, median launch seconds, median step seconds, launches of at least
    ``share`` of their step)."""
    return {k: (len(v), statistics.median(x for x, _, _ in v), statistics.median(s for _, s, _ in v),
                sum(x >= share * s for x, s, _ in v)) for k, v in by.items() if v}


def launch_mape(by: Launches, share: float = 0.5) -> dict[str, tuple[float | None, float | None]]:
    """By family, the estimator's MAPE (%) on the steps whose launch took at least ``share`` of the step and on
    the others (None: no such step with an estimate): a launch that waited on the device makes its step as
    long as the wait, which no latency model of the step's work predicts."""
    def mape(rows: list[tuple[float, float, float | None]]) -> float | None:
        errs = [abs(e - s) / s for _, s, e in rows if e is not None]
        return 100 * statistics.mean(errs) if errs else None

    return {k: (mape([r for r in v if r[0] >= share * r[1]]), mape([r for r in v if r[0] < share * r[1]]))
            for k, v in by.items() if v}


def launch_rows(path: str) -> Launches:
    """(launch seconds, step seconds, estimated seconds) of the steps that logged ``launch_s``, by family
    ("prefill": the step carries prefill, "decode": it does not)."""
    by: Launches = {"prefill": [], "decode": []}
    for text in read_text_file(path).splitlines():
        try:
            d = json.loads(text)
        except ValueError:  # a torn last line; read_logged_steps names any other
            continue
        if d.get("launch_s") is None or not d.get("seconds"):
            continue
        by["prefill" if any(d.get("prefill_tokens") or ()) else "decode"].append(
            (d["launch_s"], d["seconds"], d.get("estimated_s")))
    return by


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", help="step logs (.jsonl)")
    p.add_argument("--context-bin", type=int, default=2048, help="decode-context bin of a spread group (tokens)")
    p.add_argument("--min-group", type=int, default=5, help="fewest steps of a spread group")
    p.add_argument("--late-factor", type=float, default=3.0, help="a decode step over this x its estimate is late")
    a = p.parse_args(argv)
    for path in a.logs:
        logged = read_logged_steps(path)
        samples = [s for s, _ in logged]
        rate, bands = prefill_rates(samples)
        print(f"{path}: {len(samples)} steps, {sum(x.seconds for x in samples):.1f} s of them; prefill {rate:,.0f} "
              "prompt tokens/s over the steps that carried it")
        for band, (tokens, seconds, chunks) in bands.items():
            print(f"  history {band * BAND // 1000:>3}K-{(band + 1) * BAND // 1000}K: {chunks:4d} chunks, "
                  f"mean {tokens / chunks:6.0f} tokens, {tokens / seconds:8,.0f} tokens/s")
        spread = decode_spread(samples, a.context_bin, a.min_group)
        if spread:
            steps = sum(n for _, n in spread)
            weighted = sum(cv * n for cv, n in spread) / steps
            cvs = sorted(cv for cv, _ in spread)
            print(f"  decode-only spread: {len(spread)} groups, {steps} steps; CV weighted {100 * weighted:.1f} %, "
                  f"median {100 * statistics.median(cvs):.1f} %, worst {100 * cvs[-1]:.1f} %")
        for after, (steps, late, median) in late_decode_steps(logged, a.late_factor).items():
            if steps:
                print(f"  decode-only steps followed by a {after} step: {steps}, {late} ({100 * late / steps:.0f} %) "
                      f"over {a.late_factor:g}x their estimate, median measured / estimated {median:.2f}")
        launches = launch_rows(path)
        mapes = launch_mape(launches)
        for family, (steps, launch, step, long) in launch_times(launches).items():
            waited, others = mapes[family]
            err = "" if waited is None and others is None else "; estimator MAPE " + " and ".join(
                f"{m:.1f} % on {what}" for m, what in ((waited, "those"), (others, "the others")) if m is not None)
            print(f"  {family} steps' launches: {steps}, median {1e3 * launch:.1f} ms of a median {1e3 * step:.1f} ms "
                  f"step; {long} ({100 * long / steps:.0f} %) took at least half their step (waited on the device)"
                  f"{err}")
    return 0

