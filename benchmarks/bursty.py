#!/usr/bin/env python
"""A bursty open workload that makes real steps, and what the served steps and requests got.

    python benchmarks/bursty.py trace --out /tmp/b0.jsonl --seed 0        # 240 requests, burstiness 0.25
    python benchmarks/bursty.py serve --trace /tmp/b0.jsonl /tmp/b1.jsonl --rates 3,4,5 --out-dir $OUT
                                      # conflux serve (llama-3.1-8b, cuda, defaults) + --step-log, every
                                      # trace (arrival draw) at every rate, then report
    python benchmarks/bursty.py report --trace /tmp/bursty.jsonl --results r3.json r4.json \
        --step-log steps.0.jsonl                                          # table + JSON of saved results
    python benchmarks/bursty.py sim --trace /tmp/b0.jsonl --rates 16,24,32 --profile P.json \
        --step-log steps.0.jsonl [--scheduler deferred_wait_factor=3]     # the same points simulated (CPU)

``trace`` writes a Mooncake-format trace (``conflux bench --trace`` replays it at any mean rate):
gamma inter-arrivals of shape ``--burstiness`` (``conflux bench``'s; 0.25 is bursty), log-normal
prompts (median ``--prompt-median``, p99 ``--prompt-p99``) and outputs (median ``--output-median``).

``report`` reads the served step log (``conflux serve --step-log``) and the bench results:

* the estimator on served steps: MAPE over all steps (also against each step's device time, CUDA
  logs), the share of prefill steps holding >= 2 chunks, and per chunk-count bucket the mean measured
  and estimated time (bias);
* prefill rate: prompt tokens per second over the steps that carried prefill;
* per rate: the served SLO attainment against an ideal bound from the same arrivals: one server
  prefilling at the measured rate, shortest remaining prefill first (preemptive), decodes free; a
  request attains if its prefill ends within the TTFT SLO. No schedule on that engine does better.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
from collections import defaultdict
from pathlib import Path

from conflux_cluster.bench.report import percentile
from conflux_cluster.bench.workload import load_trace, request_prompts
from conflux_cluster.engine.scheduler.fitting.step_log import read_logged_steps
from conflux_cluster.engine.util.json_file import read_text_file

Z99 = 2.3263  # the standard normal's 99th percentile


def make_trace(n: int, burstiness: float, prompt_median: int, prompt_p99: int, output_median: int,
               max_prompt: int, seed: int) -> list[dict]:
    """Mooncake-format lines at a mean rate of 1 req/s (``conflux bench --request-rate`` rescales)."""
    rng = random.Random(seed)
    sigma_p = math.log(prompt_p99 / prompt_median) / Z99
    t, lines = 0.0, []
    for _ in range(n):
        prompt = min(max_prompt, max(16, round(prompt_median * math.exp(rng.gauss(0, sigma_p)))))
        output = max(1, round(output_median * math.exp(rng.gauss(0, 0.8))))
        lines.append({"timestamp": round(t * 1000, 3), "input_length": prompt, "output_length": output})
        t += rng.gammavariate(burstiness, 1.0 / burstiness)
    return lines


def srpt_attainment(arrivals: list[float], prompts: list[int], rate: float, ttft_slo: float) -> float:
    """Fraction of requests whose prefill ends within ``ttft_slo`` on one server of ``rate`` tok/s,
    shortest remaining prefill first (preemptive): an upper bound for any scheduler on that engine."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
    heap: list[tuple[float, int]] = []  # (remaining tokens, request)
    now, k, met = 0.0, 0, 0
    while k < len(order) or heap:
        if not heap:
            now = max(now, arrivals[order[k]])
        while k < len(order) and arrivals[order[k]] <= now:
            heapq.heappush(heap, (float(prompts[order[k]]), order[k]))
            k += 1
        rem, i = heapq.heappop(heap)
        next_arrival = arrivals[order[k]] if k < len(order) else math.inf
        run = min(rem / rate, next_arrival - now)
        now += run
        rem -= run * rate
        if rem > 1e-9:
            heapq.heappush(heap, (rem, i))
        elif now - arrivals[i] <= ttft_slo + 1e-9:
            met += 1
    return met / len(arrivals) if arrivals else 0.0


def _rank_times(path: str) -> dict[str, list[tuple[float, float]]]:
    """Per time the ranks log, (that time, the estimate) of each logged step that has both: ``compute_s``, the
    slowest rank's time inside the step (without the host's lag between the step's end and its collection),
    and ``device_s``, its time on the device's timeline (CUDA; without the next step's launch, which with
    launches ahead the wall time between a step's tokens holds)."""
    pairs: dict[str, list[tuple[float, float]]] = {"compute_s": [], "device_s": []}
    for text in read_text_file(path).splitlines():
        try:
            d = json.loads(text)
        except ValueError:
            continue
        for key, rows in pairs.items():
            if d.get(key) and d.get("estimated_s"):
                rows.append((float(d[key]), float(d["estimated_s"])))
    return pairs


def _mape(pairs: list[tuple[float, float]]) -> float | None:
    """MAPE (%) of (measured, estimated) pairs; None without any."""
    return 100 * statistics.fmean(abs(e - m) / m for m, e in pairs) if pairs else None


def step_stats(path: str, full_tokens: int = 1024) -> dict:
    """The estimator's error on served steps, by number of prefill chunks, and the prefill rate."""
    logged = read_logged_steps(path)
    ranks = _rank_times(path)
    samples = [s for s, _ in logged]
    rows = [(s, e) for s, e in logged if e]
    ratios = sorted(s.seconds / e for s, e in rows)
    by_chunks: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for s, e in rows:
        by_chunks[len(s.load.prefill_chunks)].append((s.seconds, e))
    prefill = [s for s in samples if any(s.load.prefill_tokens)]
    multi = sum(1 for s in prefill if len(s.load.prefill_chunks) >= 2)
    tokens = sum(sum(s.load.prefill_tokens) for s in prefill)
    full = [s for s in prefill if sum(s.load.prefill_tokens) >= full_tokens]  # requests were waiting
    return {
        "steps": len(samples),
        "mape_percent": _mape([(s.seconds, e) for s, e in rows]),
        # measured / estimated at p5, p50, p95: a spread no term of the step's shape explains shows here
        "ratio_p5_p50_p95": [percentile(ratios, p) for p in (5, 50, 95)] if ratios else [],
        "engine_mape_percent": _mape(ranks["compute_s"]),
        "device_mape_percent": _mape(ranks["device_s"]),
        "prefill_steps": len(prefill),
        "multi_chunk_share": multi / len(prefill) if prefill else 0.0,
        "prefill_tok_s": tokens / sum(s.seconds for s in prefill) if prefill else 0.0,
        "full_steps": len(full),
        "prefill_tok_s_full": (sum(sum(s.load.prefill_tokens) for s in full) / sum(s.seconds for s in full)
                               if full else 0.0),
        "by_chunks": {k: {"steps": len(v), "measured_ms": 1e3 * statistics.fmean(m for m, _ in v),
                          "estimated_ms": 1e3 * statistics.fmean(e for _, e in v),
                          "bias_percent": 100 * (sum(e for _, e in v) / sum(m for m, _ in v) - 1)}
                      for k, v in sorted(by_chunks.items())},
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} %"


def report(args: argparse.Namespace) -> dict:
    steps = step_stats(args.step_log, args.full_step_tokens) if args.step_log else None
    # the bound prefills at the engine's rate while requests wait (steps of >= --full-step-tokens), or faster;
    # without such steps (short prompts, light load) at its rate over every prefill step
    rate_tok_s = max(args.prefill_tok_s or 0.0, (steps or {}).get("prefill_tok_s_full") or 0.0) \
        or (steps or {}).get("prefill_tok_s") or 0.0
    points = []
    for path in args.results:
        r = json.load(open(path))
        rate = float(r["request_rate"])
        trace = r.get("trace") or args.trace[0]  # serve writes the trace each point replayed
        reqs = load_trace(trace, num_requests=r.get("num_requests"), request_rate=rate)
        bound = (srpt_attainment([q.arrival_s for q in reqs], [q.input_len for q in reqs], rate_tok_s, args.ttft_slo)
                 if rate_tok_s else None)  # no prefill step logged, no --prefill-tok-s: no bound
        att = float(r["slo_attainment"])
        points.append({"rate": rate, "trace": trace, "attainment": att, "bound": bound,
                       "of_bound": att / bound if bound else None, "result": path, "admission": r.get("admission")})
    out = {"steps": steps, "prefill_tok_s_for_bound": rate_tok_s, "points": points, "by_rate": by_rate(points)}
    if steps:
        engine = steps["engine_mape_percent"]
        print(f"steps {steps['steps']}, prefill steps {steps['prefill_steps']} "
              f"({100 * steps['multi_chunk_share']:.0f} % with >= 2 chunks), MAPE {steps['mape_percent']:.1f} % "
              f"(measured / estimated p5 p50 p95 {' '.join(f'{x:.2f}' for x in steps['ratio_p5_p50_p95'])}; "
              f"against the engine's own step time {_pct(engine)}, "
              f"against device time {_pct(steps['device_mape_percent'])}), "
              f"prefill {steps['prefill_tok_s']:.0f} tok/s over prefill steps, "
              f"{steps['prefill_tok_s_full']:.0f} tok/s over the {steps['full_steps']} of >= {args.full_step_tokens} tokens")
        print("chunks  steps  measured ms  estimated ms  bias")
        for k, b in steps["by_chunks"].items():
            print(f"{k:6d} {b['steps']:6d} {b['measured_ms']:12.1f} {b['estimated_ms']:13.1f} {b['bias_percent']:+6.1f} %")
    for p in points:
        fallback = [a for a in p["admission"] or [] if a and a.get("fallbacks")]
        bound = "no bound" if p["bound"] is None else f"ideal bound {100 * p['bound']:.1f} % ({p['of_bound'] or 0:.2f} of it)"
        print(f"rate {p['rate']:g} req/s ({Path(p['trace']).name}): attainment {100 * p['attainment']:.1f} %, {bound}"
              + (f"; admission fell back to FCFS {sum(a['fallbacks'] for a in fallback)} time(s) so far" if fallback
                 else ""))
    print_by_rate(out["by_rate"])
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)
    return out


def by_rate(points: list[dict]) -> dict:
    """Per offered rate, the mean and spread over the traces (arrival draws) run at it."""
    groups: dict[float, list[dict]] = defaultdict(list)
    for p in points:
        groups[p["rate"]].append(p)
    out = {}
    for rate, ps in sorted(groups.items()):
        att = [100 * p["attainment"] for p in ps]
        ofb = [p["of_bound"] for p in ps if p["of_bound"] is not None] or [0.0]
        out[f"{rate:g}"] = {"runs": len(ps), "attainment_mean": statistics.fmean(att), "attainment_min": min(att),
                            "attainment_max": max(att), "of_bound_mean": statistics.fmean(ofb),
                            "of_bound_min": min(ofb), "of_bound_max": max(ofb)}
    return out


def print_by_rate(rates: dict, prefix: str = "") -> None:
    for rate, b in rates.items():
        print(f"{prefix}rate {rate} req/s over {b['runs']} traces: attainment {b['attainment_mean']:.1f} % "
              f"({b['attainment_min']:.1f}-{b['attainment_max']:.1f}), of the bound {b['of_bound_mean']:.2f} "
              f"({b['of_bound_min']:.2f}-{b['of_bound_max']:.2f})")


def serve(args: argparse.Namespace) -> dict:
    """One ``conflux serve`` with the product defaults and ``--step-log``; every trace at every rate; report."""
    from conflux_cluster.bench.server import (ClientSettings, ServedModel, ServerProcess, ServerSpec, measuring,
                                              resolve_device)
    from conflux_cluster.engine.loader import resolve_model

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    step_log = out / "steps.jsonl"
    device = resolve_device(args.device)
    spec = ServerSpec(args.model, device, 1, "bench-key", ("--step-log", str(step_log), *args.server_arg))
    server, res, paths = ServerProcess(spec, "bursty", out), {}, []
    with measuring(server, device, res, "bursty"):
        served = ServedModel(server.start(args.start_timeout), ClientSettings(
            "bench-key", resolve_model(args.model).config.vocab_size, ttft_slo=args.ttft_slo, tbt_slo=args.tbt_slo))
        vocab = resolve_model(args.model).config.vocab_size
        points = [(t, rate) for t in args.trace for rate in args.rates]
        for i, (trace, rate) in enumerate(points):
            reqs = load_trace(trace, num_requests=args.num, request_rate=rate)
            prompts = request_prompts(reqs, vocab, random.Random(1000 + i))  # no prefix shared across points
            results, duration = served.run(reqs, prompts, deadline_s=served.slo_deadline(reqs, None))
            summary = {**served.summary(results, duration), "request_rate": rate, "trace": trace,
                       "num_requests": args.num,  # admission's accuracy and FCFS fallback so far (cumulative)
                       "admission": [x.get("admission") for x in served.instance_stats()]}
            paths.append(str(out / f"{Path(trace).stem}_rate{rate:g}.json"))
            json.dump(summary, open(paths[-1], "w"), indent=1)
            print(f"{Path(trace).name} rate {rate:g}: attainment {100 * summary['slo_attainment']:.1f} %", flush=True)
    logs = sorted(out.glob("steps*.jsonl"))
    args.results, args.step_log = paths, str(logs[0]) if logs else None
    args.out = str(out / "bursty.json")
    return {**report(args), **({"error": res["error"]} if "error" in res else {})}


def simulate(args: argparse.Namespace) -> dict:
    """Every trace at every rate through the simulator (``policy_matrix``'s model of the served engine,
    steps timed by ``--profile``, scaled by the ``--step-log``'s measured / modelled ratios), per policy,
    against the same ideal bound as ``report``: what a scheduler change does to these points, before a GPU."""
    from conflux_cluster.bench import policy_matrix as pm
    from conflux_cluster.sim.workloads import SimRequest, Workload

    logs = tuple(args.step_log)
    rate_tok_s = args.prefill_tok_s or max((step_stats(x, args.full_step_tokens)["prefill_tok_s_full"]
                                            for x in logs), default=0.0)
    if not rate_tok_s:
        raise SystemExit("sim: the bound needs --prefill-tok-s or a --step-log with full prefill steps")
    setting = pm.sim_setting(args.profile, args.ttft_slo, args.tbt_slo, step_logs=logs)
    points = []
    for policy in args.policies:
        factory = pm.sim_factory(setting, policy, args.scheduler)
        for trace in args.trace:
            for rate in args.rates:
                reqs = load_trace(trace, num_requests=args.num, request_rate=rate)
                wl = Workload(Path(trace).stem, tuple(SimRequest(f"{Path(trace).stem}-{i}", q.arrival_s, q.input_len,
                                                                 q.output_len) for i, q in enumerate(reqs)))
                sim = pm.sim_point(factory, wl, setting.slo)
                bound = srpt_attainment([q.arrival_s for q in reqs], [q.input_len for q in reqs], rate_tok_s,
                                        args.ttft_slo)
                points.append({"policy": policy, "rate": rate, "trace": trace, "attainment": sim["attainment"],
                               "bound": bound, "of_bound": sim["attainment"] / bound if bound else None,
                               "ttft_p99": sim["ttft_p99"]})
                print(f"{policy} rate {rate:g} ({Path(trace).name}): attainment {100 * sim['attainment']:.1f} %, "
                      f"bound {100 * bound:.1f} % ({points[-1]['of_bound'] or 0:.2f} of it), "
                      f"TTFT p99 {sim['ttft_p99']:.2f} s", flush=True)
    out = {"prefill_tok_s_for_bound": rate_tok_s, "profile": args.profile, "step_logs": list(logs),
           "scheduler": dict(args.scheduler), "points": points,
           "by_policy": {p: by_rate([x for x in points if x["policy"] == p]) for p in args.policies}}
    for policy, rates in out["by_policy"].items():
        print_by_rate(rates, f"{policy} ")
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace", help="write the bursty trace")
    t.add_argument("--num", type=int, default=240)
    t.add_argument("--burstiness", type=float, default=0.25)
    t.add_argument("--prompt-median", type=int, default=1500)
    t.add_argument("--prompt-p99", type=int, default=7000)
    t.add_argument("--output-median", type=int, default=15)
    t.add_argument("--max-prompt", type=int, default=16000)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", required=True)
    r = sub.add_parser("report", help="step-log and attainment report")
    r.add_argument("--trace", nargs="+", required=True, help="the trace of a result that does not name its own")
    r.add_argument("--results", nargs="*", default=[])
    r.add_argument("--step-log", default=None)
    r.add_argument("--ttft-slo", type=float, default=1.0)
    r.add_argument("--prefill-tok-s", type=float, default=None,
                   help="the bound's prefill rate if faster than the one measured over full steps")
    r.add_argument("--full-step-tokens", type=int, default=1024,
                   help="steps of at least this many prompt tokens count as 'requests waited' (the bound's rate)")
    r.add_argument("--out", default=None)
    v = sub.add_parser("serve", help="serve the trace at several rates, then report")
    v.add_argument("--trace", nargs="+", required=True, help="traces (arrival draws): each is served at every rate")
    v.add_argument("--rates", default="3,4,5")
    v.add_argument("--num", type=int, default=None, help="first requests of the trace (default: all)")
    v.add_argument("--model", default="llama-3.1-8b")
    v.add_argument("--device", default="cuda", choices=["auto", "cpu", "cuda"])
    v.add_argument("--ttft-slo", type=float, default=1.0)
    v.add_argument("--tbt-slo", type=float, default=0.1)
    v.add_argument("--prefill-tok-s", type=float, default=None)
    v.add_argument("--full-step-tokens", type=int, default=1024)
    v.add_argument("--server-arg", action="append", default=[], help="extra conflux serve flag (repeatable)")
    v.add_argument("--start-timeout", type=float, default=420.0)
    v.add_argument("--out-dir", required=True)
    m = sub.add_parser("sim", help="the same points through the simulator (CPU, no server)")
    m.add_argument("--trace", nargs="+", required=True, help="traces (arrival draws): each at every rate")
    m.add_argument("--rates", default="3,4,5")
    m.add_argument("--num", type=int, default=None, help="first requests of the trace (default: all)")
    m.add_argument("--policies", default="slo", help="comma list (slo, fcfs)")
    m.add_argument("--profile", default=None, help="EstimatorProfile that times the steps (default: the shipped one)")
    m.add_argument("--step-log", action="append", default=[], help="served step log: its measured / modelled "
                   "ratios scale the simulated steps, and its full steps give the bound's rate (repeatable)")
    m.add_argument("--scheduler", action="append", default=[], metavar="FIELD=VALUE",
                   help="a SchedulerConfig field, as conflux serve --FIELD VALUE (repeatable)")
    m.add_argument("--ttft-slo", type=float, default=1.0)
    m.add_argument("--tbt-slo", type=float, default=0.1)
    m.add_argument("--prefill-tok-s", type=float, default=None, help="the bound's prefill rate")
    m.add_argument("--full-step-tokens", type=int, default=1024)
    m.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "sim":
        from conflux_cluster.bench import policy_matrix as pm

        args.rates = [float(x) for x in args.rates.split(",")]
        args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
        args.profile = args.profile or str(pm.DEFAULT_PROFILE)
        args.scheduler = pm.scheduler_overrides(m, args.scheduler)
        simulate(args)
    elif args.cmd == "serve":
        args.rates = [float(x) for x in args.rates.split(",")]
        serve(args)
    elif args.cmd == "trace":
        lines = make_trace(args.num, args.burstiness, args.prompt_median, args.prompt_p99, args.output_median,
                           args.max_prompt, args.seed)
        with open(args.out, "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)
    else:
        report(args)


if __name__ == "__main__":
    main()
