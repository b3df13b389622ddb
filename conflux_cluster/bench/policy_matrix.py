"""The policy matrix (issue 39): ``slo`` against ``fcfs`` at the same SLOs over four workload shapes, rates
from 50 % to 150 % of each shape's knee, several seeds. The pure parts (no server, no Ray), shared by
``benchmarks/policy_matrix.py`` (through ``conflux serve``) and its ``--sim`` mode (the simulator).

    SHAPES          the four workload shapes and their knees (req/s on one H200, Llama-3.1-8B)
    shape_workload  one shape at one rate and seed, ``duration_s`` of arrivals, lengths scaled
    sim_factory     the simulator's model of one policy under the served engine's defaults
    rerun           a setting for another run of the same arrivals (its served step times drawn anew)
    aggregate       per (shape, factor, policy): mean / min / max over seeds, goodput per shape, and the
                    run-to-run spread where each seed's arrivals ran several times (``repeat``)
    verdict         the targets at every point: slo >= fcfs - 2 points, goodput >= fcfs, TTFT p99 <= 2x
    markdown        the table docs/ carries

Every point's figures follow the rest of the benchmarks: per-token attainment (token i by arrival + TTFT +
(i-1) TBT), goodput = the highest measured rate whose mean attainment over seeds is >= 95 %.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

import numpy as np

import conflux_cluster.engine.scheduler as _scheduler_pkg
from conflux_cluster.sim.workloads import SimRequest, Workload, gamma_arrivals, lognormal_from_percentiles

POLICIES = ("slo", "fcfs")
# the shipped one-H200 Llama-3.1-8B profile (N = 1): what the simulator's steps take
DEFAULT_PROFILE = Path(_scheduler_pkg.__file__).parent / "profiles" / "h200-llama-3.1-8b-n1.json"
FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5)  # rates as multiples of the shape's knee
TARGET = 0.95  # goodput rule
ATTAINMENT_SLACK = 0.02  # slo may trail fcfs by this much (2 points) at a point
TTFT_P99_RATIO = 2.0  # slo's TTFT p99 at most this many times fcfs's


@dataclass(frozen=True)
class Shape:
    """A workload shape: lengths (log-normal by median and 95th percentile, or fixed where they are equal),
    arrivals (gamma, ``cv`` 1 = Poisson), an optional share of long prompts, and its knee."""

    name: str
    # req/s: about where fcfs's attainment falls below 95 % in the simulator (one H200, Llama-3.1-8B, the
    # shipped N = 1 profile, TTFT 1 s / TBT 100 ms, 60 s of arrivals); the real knee may differ: --knee
    knee: float
    prompt: tuple[int, int]  # (median, p95) prompt tokens
    output: tuple[int, int]  # (median, p95) output tokens
    cv: float = 1.0  # coefficient of variation of the inter-arrival gaps (burstiness b: cv = 1/sqrt(b))
    long_share: float = 0.0  # share of requests with a long prompt
    long_prompt: int = 0  # tokens of a long prompt
    max_output: int = 1024  # outputs capped here (a served point drains until its longest output is decided)
    description: str = ""


SHAPES = {s.name: s for s in (
    Shape("uniform", 12.5, (2048, 2048), (128, 128), description="2K prompt / 128 output, Poisson"),
    Shape("conversation", 19.0, (900, 2600), (230, 600),
          description="decode-heavy conversation-like: prompts ~1K, outputs ~250 (log-normal), Poisson"),
    Shape("bursty", 5.0, (1700, 6000), (24, 90), cv=2.0,
          description="prefill-heavy code-completion-like: prompts ~2K, outputs ~28, gamma burstiness 0.25"),
    Shape("longmix", 2.0, (1024, 1024), (128, 128), long_share=0.05, long_prompt=32768,
          description="long/short mix: 5 % 32K prompts, the rest 1K, outputs 128, Poisson"),
)}


def _lengths(rng: np.random.Generator, n: int, spec: tuple[int, int]) -> np.ndarray:
    p50, p95 = spec
    if p50 == p95:
        return np.full(n, p50)
    mu, sigma = lognormal_from_percentiles(p50, p95)
    return np.maximum(1, np.round(rng.lognormal(mu, sigma, n))).astype(int)


def shape_workload(shape: Shape, rate: float, duration_s: float, seed: int, length_scale: float = 1.0,
                   max_context: int | None = None) -> Workload:
    """``shape`` at ``rate`` req/s for ``duration_s`` of arrivals (seeded: the same requests for every
    policy); prompt and output lengths times ``length_scale`` (a tiny CPU model), capped to
    ``max_context`` (prompt + output)."""
    rng = np.random.default_rng(seed)
    n = max(2, round(rate * duration_s))
    arrivals = gamma_arrivals(n, rate, shape.cv, rng)
    prompts = _lengths(rng, n, shape.prompt)
    outputs = np.minimum(_lengths(rng, n, shape.output), shape.max_output)
    if shape.long_share:
        prompts = np.where(rng.random(n) < shape.long_share, shape.long_prompt, prompts)
    reqs = []
    for i in range(n):
        p = max(1, round(int(prompts[i]) * length_scale))
        o = max(1, round(int(outputs[i]) * length_scale))
        if max_context is not None:
            o = min(o, max(1, max_context // 4))
            p = min(p, max_context - o)
        reqs.append(SimRequest(f"{shape.name}-{seed}-{i}", float(arrivals[i]), p, o))
    return Workload(f"{shape.name} ({shape.description})", tuple(reqs))


# ---- aggregation and targets ---------------------------------------------------------------------------


def aggregate(points: list[dict]) -> list[dict]:
    """Per (shape, factor, policy): the runs' mean attainment with its min / max, mean TTFT p50 / p99 and
    TBT p99 (seconds), and where a seed's arrivals ran more than once (points with ``repeat``) the
    run-to-run spread: the mean over seeds of each seed's max - min attainment. ``points``: dicts with
    shape, factor, rate, policy, seed (optionally repeat) and the point's figures."""
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault((p["shape"], p["factor"], p["policy"]), []).append(p)
    rows = []
    for (shape, factor, policy), ps in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        att = [p["attainment"] for p in ps]
        rows.append({"shape": shape, "factor": factor, "rate": ps[0]["rate"], "policy": policy,
                     "seeds": len({p["seed"] for p in ps}), "runs": len(ps), "repeat_spread": repeat_spread(ps),
                     "attainment": mean(att), "attainment_min": min(att), "attainment_max": max(att),
                     **{k: mean(p[k] for p in ps if p.get(k) is not None) if any(p.get(k) is not None for p in ps)
                        else None for k in ("ttft_p50", "ttft_p99", "tbt_p99")}})
    return rows


def repeat_spread(points: list[dict]) -> float | None:
    """Mean over seeds of max - min attainment among the runs of that seed's arrivals; None where no seed
    ran more than once. Near a knee one run decides little: this is what a user sees change between two
    runs of the same traffic."""
    by_seed: dict[int, list[float]] = {}
    for p in points:
        by_seed.setdefault(p["seed"], []).append(p["attainment"])
    ranges = [max(a) - min(a) for a in by_seed.values() if len(a) > 1]
    return mean(ranges) if ranges else None


def goodputs(rows: list[dict]) -> dict[str, dict[str, float]]:
    """shape -> policy -> the highest rate whose mean attainment is >= 95 % (0.0 when none)."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        best = out.setdefault(r["shape"], {}).setdefault(r["policy"], 0.0)
        if r["attainment"] >= TARGET and r["rate"] > best:
            out[r["shape"]][r["policy"]] = r["rate"]
    return out


def verdict(rows: list[dict]) -> dict:
    """The issue's targets at every (shape, factor) both policies ran: each check's failing points."""
    by = {(r["shape"], r["factor"], r["policy"]): r for r in rows}
    att_fail, ttft_fail = [], []
    for (shape, factor, policy), s in by.items():
        f = by.get((shape, factor, "fcfs"))
        if policy != "slo" or f is None:
            continue
        if s["attainment"] < f["attainment"] - ATTAINMENT_SLACK - 1e-9:
            att_fail.append(f"{shape}@{factor:g}x: {100 * s['attainment']:.1f} vs {100 * f['attainment']:.1f} %")
        if s["ttft_p99"] is not None and f["ttft_p99"] is not None and s["ttft_p99"] > TTFT_P99_RATIO * f["ttft_p99"]:
            ttft_fail.append(f"{shape}@{factor:g}x: {s['ttft_p99']:.2f} vs {f['ttft_p99']:.2f} s")
    g = goodputs(rows)
    good_fail = [f"{shape}: {v.get('slo', 0):g} vs {v['fcfs']:g} req/s" for shape, v in g.items()
                 if "fcfs" in v and v.get("slo", 0.0) < v["fcfs"]]
    out = {"attainment_within_2_points": not att_fail, "attainment_failures": att_fail,
           "goodput_at_least_fcfs": not good_fail, "goodput_failures": good_fail,
           "ttft_p99_within_2x": not ttft_fail, "ttft_p99_failures": ttft_fail, "goodput": g}
    wider = [f"{shape}@{factor:g}x: {100 * s['repeat_spread']:.1f} vs {100 * f['repeat_spread']:.1f} points"
             for (shape, factor, policy), s in by.items() if policy == "slo"
             and (f := by.get((shape, factor, "fcfs"))) is not None
             and s.get("repeat_spread") is not None and f.get("repeat_spread") is not None
             and s["repeat_spread"] > f["repeat_spread"] + 1e-9]
    if any(r.get("repeat_spread") is not None for r in rows):
        out.update(spread_at_most_fcfs=not wider, spread_wider_than_fcfs=wider)
    return out


def _s(x: float | None, scale: float = 1.0, fmt: str = ".2f") -> str:
    return "—" if x is None else format(x * scale, fmt)


def _attainment(r: dict | None) -> str:
    if r is None:
        return "—"
    return f"{100 * r['attainment']:.1f} ({100 * r['attainment_min']:.0f}–{100 * r['attainment_max']:.0f})"


def _pair(s: dict | None, f: dict | None, key: str, scale: float = 1.0, fmt: str = ".2f") -> str:
    return f"{_s(s and s[key], scale, fmt)} / {_s(f and f[key], scale, fmt)}"


def markdown(rows: list[dict]) -> str:
    """One line per (shape, rate): slo and fcfs side by side; attainment as mean (min–max over seeds)."""
    by = {(r["shape"], r["factor"], r["policy"]): r for r in rows}
    head = ("| workload | × knee | req/s | attainment slo | attainment fcfs | TTFT p50 slo / fcfs (s) "
            "| TTFT p99 slo / fcfs (s) | TBT p99 slo / fcfs (ms) |")
    lines = [head, "| " + " | ".join(["---"] * 8) + " |"]
    for shape, factor in sorted({(r["shape"], r["factor"]) for r in rows}):
        s, f = by.get((shape, factor, "slo")), by.get((shape, factor, "fcfs"))
        rate = (s or f)["rate"]
        lines.append(f"| {shape} | {factor:g} | {rate:.3g} | {_attainment(s)} | {_attainment(f)} | "
                     f"{_pair(s, f, 'ttft_p50')} | {_pair(s, f, 'ttft_p99')} | {_pair(s, f, 'tbt_p99', 1e3, '.0f')} |")
    g = goodputs(rows)
    lines += ["", "| workload | goodput slo (req/s) | goodput fcfs (req/s) |", "| --- | --- | --- |"]
    lines += [f"| {shape} | {v.get('slo', 0):g} | {v.get('fcfs', 0):g} |" for shape, v in sorted(g.items())]
    spread = [r for r in rows if r.get("repeat_spread") is not None]
    if spread:
        lines += ["", "| workload | × knee | runs of each seed's arrivals | run-to-run spread slo / fcfs (points) |",
                  "| --- | --- | --- | --- |"]
        for shape, factor in sorted({(r["shape"], r["factor"]) for r in spread}):
            s, f = by.get((shape, factor, "slo")), by.get((shape, factor, "fcfs"))
            runs = (s or f)["runs"] // max(1, (s or f)["seeds"])
            lines.append(f"| {shape} | {factor:g} | {runs} | {_pair(s, f, 'repeat_spread', 100, '.1f')} |")
    return "\n".join(lines)


# ---- the simulator's side --------------------------------------------------------------------------------


def scheduler_overrides(parser: argparse.ArgumentParser, items: list[str]) -> tuple[tuple[str, str], ...]:
    """Every ``--scheduler`` FIELD=VALUE (benchmarks/policy_matrix.py, benchmarks/bursty.py), checked against
    ``SchedulerConfig`` now, not at the first point; a bad one is ``parser``'s usage error."""
    try:
        return tuple(_scheduler_override(item) for item in items)
    except ValueError as e:
        parser.error(str(e))


def _scheduler_override(item: str) -> tuple[str, str]:
    """One FIELD=VALUE; ValueError naming the flag."""
    from pydantic import ValidationError

    from conflux_cluster.engine.scheduler.config import SchedulerConfig

    name, sep, value = item.partition("=")
    if not sep or name not in SchedulerConfig.model_fields:
        raise ValueError(f"--scheduler {item!r}: want FIELD=VALUE with FIELD a SchedulerConfig field")
    try:
        SchedulerConfig(**{name: value})
    except ValidationError as e:
        raise ValueError(f"--scheduler {item!r}: {e.errors()[0]['msg']}") from None
    return name, value


def sim_setting(profile_path: str, ttft_slo: float, tbt_slo: float, model: str = "llama-3.1-8b",
                hardware: str = "h200", step_logs: tuple[str, ...] = ()):
    """One H200 serving ``model`` under the engine's GPU defaults (async scheduling: pipelined), steps timed
    by the fitted profile at ``profile_path``; with ``step_logs`` (served ``--step-log`` files) each step's
    time is multiplied by a served step's measured / modelled ratio of its family (``sim/step_noise.py``)."""
    from conflux_cluster.engine.config import EngineConfig
    from conflux_cluster.engine.models.config import PRESETS
    from conflux_cluster.engine.scheduler.estimator import EstimatorProfile
    from conflux_cluster.sim.hardware import ModelSpec, get_hardware
    from conflux_cluster.sim.limits import EngineLimits
    from conflux_cluster.slo import SLO
    from conflux_cluster.sim.registry import Setting

    from conflux_cluster.sim.step_noise import StepNoise

    ecfg = EngineConfig(device="cuda")
    spec = ModelSpec.from_config(model, PRESETS[model], ecfg.torch_dtype().itemsize)
    profile = EstimatorProfile.from_json(profile_path)
    noise = StepNoise.from_step_logs(list(step_logs), profile) if step_logs else None
    return Setting(spec, get_hardware(hardware), 1, 1, SLO(ttft_slo, tbt_slo), profile,
                   EngineLimits.from_engine(ecfg, pipelined=ecfg.async_scheduling), step_noise=noise)


def rerun(setting, run: int):
    """``setting`` for run ``run`` of the same arrivals: its served step-time ratios drawn with seed ``run``
    (the same setting where it has none: the simulator is then exact, every run alike)."""
    from dataclasses import replace

    if setting.step_noise is None:
        return setting
    return replace(setting, step_noise=replace(setting.step_noise, seed=run))


def sim_factory(setting, policy: str, scheduler: tuple[tuple[str, str], ...] = ()):
    """The simulated instance of ``policy`` with the product defaults: slo plans on the estimator's
    waterfill, fcfs on the fixed per-rank budget (``token_budget`` auto). ``scheduler``: (field, value)
    pairs of ``SchedulerConfig`` set on top, as ``conflux serve --<field> <value>`` would."""
    from conflux_cluster.sim.registry import SystemConfig

    knobs = () if policy == "slo" else (("budget", setting.limits.max_num_batched_tokens),)
    if scheduler:
        knobs += (("scheduler", tuple(scheduler)),)
    return SystemConfig(policy, "conflux", policy, knobs).build(setting)


def sim_point(factory, workload: Workload, slo) -> dict:
    """One complete simulated run's figures (seconds)."""
    from conflux_cluster.sim.core import Simulation
    from conflux_cluster.sim.metrics import summarize

    summ = summarize(Simulation(factory, workload, slo).run(horizon=3600.0).records, slo)
    return {"attainment": summ.attainment, "completed": summ.finished, "requests": summ.requests,
            "ttft_p50": summ.ttft["p50"], "ttft_p99": summ.ttft["p99"], "tbt_p99": summ.tbt["p99"]}
