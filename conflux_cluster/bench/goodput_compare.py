"""Real vs simulated goodput: the pure parts of ``benchmarks/gpu_goodput.py`` (no server, no Ray).

    workload_spec     "name" or "name:prompt_scale" (one workload, its own prompt scale)
    shape_workload    a simulator workload (Mooncake trace slice or the GENERATED toolagent-like one)
                      with lengths scaled and capped to the served engine's context
    bench_requests    that workload at a rate (``scale_to_rate``, the paper's §8.1 scaling) as
                      the HTTP client's requests: the simulator replays exactly the same arrivals
    real_point        one rate through ``conflux serve``: per-token SLO attainment, TTFT / TBT p50 / p99
    server_latency    the server's side of that rate: step-time and token-gap quantiles, steps over τ
    server_prefix     the server's side of its prefix-cache hits (every started prefill, finished or not)
    misses            the requests of that rate that missed the SLO: lengths, TTFT, first late token
    sim_point         the same rate in the simulator (a complete ``Simulation`` run): the same figures
    goodput           highest rate of a sweep with attainment >= 95 %
    next_search_rate  the next rate of a goodput search (doubling / halving, then bisecting)
    compare           per system: goodput error and latency errors sim vs real
    ratio_table       per workload: ConfluxServe ÷ best baseline, printed as a table

Latencies are in seconds everywhere here. The real TTFT / TBT percentiles are over every request that
got a first token, finished or cut off at the point's end, and TTFT also over those cut off before their
first token, at the wait they had (a lower bound; ``observed_latency``; vLLM's completed-only
figures are kept as ``*_completed``); TBT over the client's inter-token gaps (``itl``; tokens that
arrived in one chunk count a zero gap, as vLLM counts them); the simulator's over every token gap of
every request (it runs each to its end, so a cut-off request's later gaps are in its figures only).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from conflux_cluster.sim.core import Simulation
from conflux_cluster.sim.goodput import RUN_HORIZON_S, TARGET
from conflux_cluster.sim.metrics import Summary, summarize
from conflux_cluster.slo import SLO, token_deadline
from conflux_cluster.sim.prefix import prefix_hit_rate
from conflux_cluster.sim.workloads import TRACE_BLOCK_TOKENS, Workload, cap_lengths, make_workload, scale_to_rate
from conflux_cluster.tally import over_ms, quantile_ms, window

from .client import RequestResult
from .report import meets_token_deadlines, percentile
from .workload import BenchRequest

LATENCIES = ("ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99")


def workload_spec(spec: str, prompt_scale: float = 1.0) -> tuple[str, float]:
    """``"synthetic:0.5"`` -> ("synthetic", 0.5); a bare name keeps ``prompt_scale``. ValueError when the
    scale is not a number > 0."""
    name, sep, scale = spec.partition(":")
    if not sep:
        return name, prompt_scale
    try:
        value = float(scale)
    except ValueError:
        raise ValueError(f"workload {spec!r}: the prompt scale after ':' must be a number") from None
    if not value > 0:
        raise ValueError(f"workload {spec!r}: the prompt scale must be > 0")
    return name, value


def shape_workload(kind: str, num_requests: int, context: int, prompt_scale: float = 1.0,
                   output_scale: float = 1.0, max_output: int | None = None, seed: int = 1) -> Workload:
    """``make_workload(kind)`` with prompt and output lengths scaled (each >= 1), outputs capped at
    ``max_output``, then capped so prompt + output fit ``context`` (the server's max_model_len).
    A trace's ``hash_ids`` (its prompt blocks: shared prefixes) are kept only at ``prompt_scale`` 1,
    where they still describe the prompts; scaled prompts are random, for the server and simulator alike."""
    wl = make_workload(kind, num_requests, seed=seed)
    reqs = []
    for r in wl.requests:
        out = max(1, round(r.output_len * output_scale))
        reqs.append(replace(r, prompt_len=max(1, round(r.prompt_len * prompt_scale)),
                            output_len=min(out, max_output) if max_output else out,
                            hash_ids=r.hash_ids if prompt_scale == 1 else ()))
    return cap_lengths(Workload(wl.name, tuple(reqs)), context)


def bench_requests(workload: Workload, rate: float) -> list[BenchRequest]:
    """The workload's arrivals scaled to ``rate`` req/s, as the client sends them (with the trace's
    prompt blocks: ``workload.trace_prompt_ids`` builds equal prefixes for equal hash ids)."""
    return [BenchRequest(r.arrival, r.prompt_len, r.output_len, r.hash_ids, TRACE_BLOCK_TOKENS)
            for r in scale_to_rate(workload, rate).requests]


def real_point(rate: float, summary: dict, results: list[RequestResult] | None = None) -> dict:
    """The figures of one served rate from ``ServedModel.summary`` (its ms fields become seconds). With the
    point's ``results``, the TTFT / TBT percentiles are ``observed_latency``'s (unfinished requests
    included, as the simulator counts them); the completed requests' own (vLLM's) stay as ``*_completed``."""
    out = {"rate": rate, "attainment": summary["slo_attainment"], "completed": summary["completed"],
           "failed": summary["failed"], "ttft_p50": summary["median_ttft_ms"] / 1e3,
           "ttft_p99": summary["p99_ttft_ms"] / 1e3, "tbt_p50": summary["median_itl_ms"] / 1e3,
           "tbt_p99": summary["p99_itl_ms"] / 1e3, "output_tok_s": summary["output_throughput"],
           "cached_fraction": summary.get("total_cached_tokens", 0) / max(1, summary.get("total_input_tokens", 0)),
           "errors": summary.get("errors", [])}
    if results is not None:
        out.update({f"{k}_completed": out[k] for k in LATENCIES})
        out.update(observed_latency(results))
    return out


def observed_latency(results: list[RequestResult]) -> dict:
    """TTFT / TBT p50 / p99 over everything the client saw: every request that got a first token, finished
    or cut off when the point's window closed (its TTFT and its gaps so far were measured). vLLM's figures
    cover completed requests only, which leaves out exactly the latest first tokens (a 118K-token prompt
    whose first token came 29 s late and whose stream was then cut) while the simulator, which runs every
    request to its end, counts them. A request cut off before its first token counts with the wait it had
    when it was cut (``end_s - arrival_s``, a lower bound of its TTFT; ``ttft_censored`` says how many):
    left out, a policy that leaves its latest arrivals unstarted when the window closes would show a
    shorter tail than one that has started them. Refused or failed requests are left out. ``{}`` when no
    request got a token or was cut waiting for one."""
    ttfts = [r.ttft for r in results if r.chunk_times]
    censored = [r.end_s - r.arrival_s for r in results if r.cut and not r.chunk_times and r.end_s > r.arrival_s]
    ttfts = sorted(ttfts + censored)
    gaps = sorted(g for r in results if r.chunk_times for g in r.itls)
    if not ttfts:
        return {}
    out = {"ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99), "ttft_censored": len(censored)}
    if gaps:
        out.update(tbt_p50=percentile(gaps, 50), tbt_p99=percentile(gaps, 99))
    return out


def server_latency(before: list[dict], after: list[dict], tbt_s: float) -> dict:
    """Step wall times and token-delta gaps as the instances measured them between two
    ``/v1/conflux/stats`` snapshots (summed over instances; ms, bucket upper edges of
    ``conflux_cluster.tally``), and how many steps exceeded the TBT SLO. {} where the server has none."""
    step, itl = None, None
    for b, a in zip(before, after):
        if "step_ms_counts" not in a:
            return {}
        ws, wi = window(b.get("step_ms_counts"), a["step_ms_counts"]), window(b.get("itl_ms_counts"), a["itl_ms_counts"])
        step = ws if step is None else [x + y for x, y in zip(step, ws)]
        itl = wi if itl is None else [x + y for x, y in zip(itl, wi)]
    if step is None or itl is None:
        return {}
    return {"server_step_p50_ms": quantile_ms(step, 0.5), "server_step_p99_ms": quantile_ms(step, 0.99),
            "server_itl_p50_ms": quantile_ms(itl, 0.5), "server_itl_p99_ms": quantile_ms(itl, 0.99),
            "server_steps": sum(step), "server_steps_over_tbt": over_ms(step, 1e3 * tbt_s)}


def server_prefix(before: list[dict], after: list[dict]) -> dict:
    """The share of prompt tokens the instances' prefix caches served between two ``/v1/conflux/stats``
    snapshots, counted where each prefill started (vLLM's prefix_cache_hits / prefix_cache_queries), so a
    request still running when the point ended counts too; the client's ``cached_fraction`` sees only the
    finished ones' usage. {} where the server has no prefix cache."""
    queries = hits = 0
    for b, a in zip(before, after):
        if "prefix_cache_queries" not in a:
            return {}
        queries += a["prefix_cache_queries"] - b.get("prefix_cache_queries", 0)
        hits += a["prefix_cache_hits"] - b.get("prefix_cache_hits", 0)
    return {"server_cached_fraction": hits / queries} if queries else {}


def misses(results: list[RequestResult], ttft_s: float, tbt_s: float) -> list[dict]:
    """Each request that missed its per-token deadlines: prompt and output lengths, TTFT (None without a
    token), the first late token (1 = the first token) or None when none came late but it did not finish."""
    out = []
    for r in results:
        if r.ok and meets_token_deadlines(r, ttft_s, tbt_s):  # (the attainment's own rule)
            continue
        times = r.token_times
        late = next((i for i, t in enumerate(times, start=1)
                     if t > token_deadline(r.arrival_s, i, ttft_s, tbt_s)), None)
        out.append({"input_len": r.input_len, "output_len": r.output_len, "output_tokens": len(times),
                    "arrival_s": round(r.arrival_s, 3), "ttft_s": round(r.ttft, 3) if times else None,
                    "first_late_token": late, "error": r.error})
    return out


def sim_point(factory: Callable, workload: Workload, slo: SLO, rate: float, num_instances: int = 1,
              router=None) -> dict:
    """The simulator at ``rate`` (complete run, no early stop: its percentiles are over every request), with
    the share of prompt tokens its prefix caches served (``cached_fraction``, as the real point's)."""
    sim = Simulation(factory, scale_to_rate(workload, rate), slo, num_instances, router)
    summ: Summary = summarize(sim.run(horizon=RUN_HORIZON_S).records, slo)
    return {"rate": rate, "attainment": summ.attainment, "completed": summ.finished,
            "failed": summ.requests - summ.finished, "ttft_p50": summ.ttft["p50"], "ttft_p99": summ.ttft["p99"],
            "tbt_p50": summ.tbt["p50"], "tbt_p99": summ.tbt["p99"], "cached_fraction": prefix_hit_rate(sim.instances)}


def goodput(points: list[dict], target: float = TARGET) -> float:
    """Highest rate with attainment >= ``target`` (0.0 when none)."""
    passing = [p["rate"] for p in points if p["attainment"] >= target]
    return max(passing) if passing else 0.0


def next_search_rate(points: list[dict], lo: float, hi: float, target: float = TARGET,
                     max_points: int = 4) -> float | None:
    """The next rate of a search for one system's goodput, after the measured ``points`` (the first rate
    is the caller's): double while the highest rate passes, halve while nothing has, then the
    geometric midpoint of the highest pass and the lowest failure above it. A step past a bound of
    [``lo``, ``hi``] measures the bound instead. None when done: ``max_points`` measured, the bracket is
    within √2, or the bound in that direction is measured already. Rates already measured are not
    repeated."""
    if not points or len(points) >= max_points:
        return None
    passed = [p["rate"] for p in points if p["attainment"] >= target]
    best = max(passed, default=None)
    above = [p["rate"] for p in points if p["attainment"] < target and (best is None or p["rate"] > best)]
    if best is None:
        nxt = max(min(above) / 2, lo)
    elif not above:
        nxt = min(best * 2, hi)
    else:
        ceiling = min(above)
        if ceiling / best <= 2 ** 0.5 * (1 + 1e-9):
            return None
        nxt = (best * ceiling) ** 0.5
    seen = [p["rate"] for p in points]
    return None if any(abs(nxt - r) <= 1e-9 * max(r, 1e-9) for r in seen) else nxt


def rel_error(sim: float | None, real: float | None) -> float | None:
    """(sim − real) / real; None where undefined (no real value, or a zero one)."""
    if sim is None or real is None or real != real or sim != sim or real == 0:
        return None
    return (sim - real) / real


def compare(real: list[dict], sim: list[dict]) -> dict:
    """Goodput error over the rates both ran, and latency errors at each of them and at the reference
    rate (the real goodput, else the lowest rate run)."""
    rates = [p["rate"] for p in real]
    sim_at = {p["rate"]: p for p in sim}
    shared = [p for p in real if p["rate"] in sim_at]
    g_real, g_sim = goodput(shared), goodput([sim_at[p["rate"]] for p in shared])
    per_rate = [{"rate": p["rate"], **{k: rel_error(sim_at[p["rate"]][k], p[k]) for k in LATENCIES}} for p in shared]
    ref = g_real or (min(rates) if rates else None)
    at_ref = next((e for e in per_rate if e["rate"] == ref), None)
    g_err = rel_error(g_sim, g_real) if g_real else (0.0 if g_sim == 0 else None)
    return {"goodput_real": g_real, "goodput_sim": g_sim, "goodput_error": g_err, "reference_rate": ref,
            "latency_error_at_reference": at_ref, "latency_error_per_rate": per_rate}


def ratio_table(results: dict, gpus: dict[str, int]) -> tuple[str, dict]:
    """Per workload: each system's real (and simulated) goodput, ConfluxServe ÷ best baseline, and
    goodput per GPU; with ``conflux-pc`` also the prefix cache's gain (conflux-pc ÷ conflux, real).
    ``results[workload][system]`` carries ``compare``'s keys; ``gpus[system]`` its devices. Baselines
    are the systems that are neither ConfluxServe (``conflux``, ``conflux-pc``) nor a router setting."""
    systems = list(dict.fromkeys(s for per in results.values() for s in per))
    head = ["workload"] + systems + ["conflux ÷ best baseline (real)", "(sim)"]
    rows, ratios = [head], {}
    for wname, per in results.items():
        base = {s: v for s, v in per.items() if s not in ("conflux", "conflux-pc") and not s.startswith("router-")}
        r = {}
        for key in ("goodput_real", "goodput_sim"):
            best = max(base.items(), key=lambda kv: kv[1].get(key) or 0.0, default=(None, {}))
            ours = (per.get("conflux") or {}).get(key)
            b = best[1].get(key) if best[0] else None
            r[key] = {"best_baseline": best[0], "best": b, "ratio": ours / b if ours is not None and b else None}
        pc, plain = ((per.get(s) or {}).get("goodput_real") for s in ("conflux-pc", "conflux"))
        if pc is not None:
            r["prefix_cache_real"] = {"conflux-pc": pc, "conflux": plain, "ratio": pc / plain if plain else None}
        ratios[wname] = r
        cells = []
        for s in systems:
            v = per.get(s)
            if v is None:
                cells.append("—")
                continue
            g, gs = v.get("goodput_real"), v.get("goodput_sim")
            per_gpu = f" ({g / gpus[s]:.3g}/GPU)" if s.startswith("router-") and g is not None else ""
            cells.append(f"{_num(g)}{per_gpu} / sim {_num(gs)}")
        rr, rs = r["goodput_real"], r["goodput_sim"]
        rows.append([wname] + cells + [_ratio(rr), _ratio(rs)])
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    text = "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows)
    return text, ratios


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:g}"


def _ratio(r: dict) -> str:
    if r["ratio"] is None:
        return "n/a" if r["best_baseline"] is None else f"n/a (best {r['best_baseline']}: {_num(r['best'])})"
    return f"{r['ratio']:.2f}x vs {r['best_baseline']}"
