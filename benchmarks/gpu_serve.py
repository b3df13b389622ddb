#!/usr/bin/env python
"""``conflux serve`` on GPUs, measured as a user would: through HTTP with the token-accurate client.

    python -m benchmarks.gpu_serve                                   # llama-3.1-8b on all visible GPUs
    python -m benchmarks.gpu_serve --compare-policy fcfs             # + the sweep under another policy
    python -m benchmarks.gpu_serve --server-arg=--max-num-batched-tokens=2048 --rates 8,16
    python -m benchmarks.gpu_serve --quick --device cpu              # smoke run: tiny-llama on 2 CPU ranks

Phases (one run; each server is a ``conflux serve`` subprocess on a port the OS picks):

  first       one 512/16 request right after /v1/models answers, and the same shape again after the
              burst: first-request TTFT vs steady state ("ready means ready")
  burst       N requests of P random prompt tokens and O output tokens (ignore_eos), all at once,
              streaming (conflux_cluster.bench): output tok/s, TTFT p50/p99, TBT (per-token ITL) p50/p99
  long        one prompt of the model's whole context (128K tokens for llama-3.1-8b), its TTFT
  sweep       Poisson arrivals of P/O at each --rates point for --duration s: per-token SLO
              attainment (conflux_cluster.slo; TTFT 1 s / TBT 100 ms by default) and goodput = the
              highest rate with >= 95 % attainment
  offline     the same burst (same prompts, same engine config) through ``conflux_cluster.LLM``
              (no Ray, no HTTP) after the server stopped: the served/offline ratio
  roofline    the burst's limit from the model config: prefill FLOPs (2 x parameters x prompt tokens
              + causal attention) at --peak-tflops per GPU, then each decode step reading the weights
              and the KV at --hbm-tbps; the measured/limit ratio
  compare     with --compare-policy P: a second server with ``--policy P`` runs the burst and sweep

A short table is printed last; everything goes to ``--out`` as JSON (default ``$OUT/gpu_serve.json``).
Extra ``conflux serve`` flags go through ``--server-arg`` (repeatable, passed verbatim), so flags
this script does not know are still usable. The server (and the offline engine) get the benchmark's
SLOs (``--ttft-slo/--tbt-slo``) unless a --server-arg overrides them.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from conflux_cluster.bench.goodput_compare import server_latency
from conflux_cluster.bench.roofline import roofline_limit
from conflux_cluster.bench.server import (ClientSettings, ServedModel, ServerProcess, ServerSpec, add_server_arguments,
                                          default_ranks, finish_args, go_higher, log, measuring, quick_defaults, resolve_device,
                                          run_record, wait_gpus_free)
from conflux_cluster.bench.workload import BenchRequest, prompt_ids, synthetic
from conflux_cluster.engine.models.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]
LONG_CONTEXT = 131072  # "a 128K-token prompt"


# ---- phases through HTTP -------------------------------------------------------------------------


class Bench(ServedModel):
    """Client side of one server, with this benchmark's arguments."""

    def __init__(self, args: argparse.Namespace, base_url: str, vocab: int) -> None:
        super().__init__(base_url, ClientSettings(args.api_key, vocab, args.seed, args.request_timeout,
                                                  args.ttft_slo, args.tbt_slo))
        self.args, self.vocab = args, vocab

    def single(self, prompt_len: int, output_len: int, seed: int, timeout_s: float | None = None) -> dict:
        ids = prompt_ids(prompt_len, self.vocab, random.Random(seed))
        results, duration = self.run([BenchRequest(0.0, prompt_len, output_len)], [ids], deadline_s=timeout_s)
        r = results[0]
        return {"prompt_tokens": prompt_len, "output_tokens": r.output_tokens, "completed": r.ok,
                "ttft_s": r.ttft if r.ok else None, "e2e_s": r.e2e, "error": r.error}


def burst_prompts(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """One prompt set per ``--repeats`` burst: a repeat of the same prompts would be served from the
    prefix cache (on by default), which measures the cache, not the burst."""
    rngs = [random.Random(args.seed + 7919 * r) for r in range(args.repeats)]
    return [[prompt_ids(args.prompt_len, vocab, rng) for _ in range(args.burst)] for rng in rngs]


def run_burst(b: Bench, prompts: list[list[int]]) -> dict:
    a = b.args
    log(f"burst: {a.burst} x {a.prompt_len}/{a.output_len}, all at once")
    reqs = [BenchRequest(0.0, a.prompt_len, a.output_len) for _ in prompts]
    results, duration = b.run(reqs, prompts)
    out = b.summary(results, duration, arrays=True)
    log(f"burst: {out['completed']}/{len(reqs)} completed, {out['output_throughput']:.0f} output tok/s, "
        f"TTFT p50 {out['median_ttft_ms']:.0f} ms p99 {out['p99_ttft_ms']:.0f} ms, "
        f"TBT p50 {out['median_itl_ms']:.1f} ms p99 {out['p99_itl_ms']:.1f} ms")
    return out


def median_run(runs: list[dict]) -> dict:
    """The run of median output throughput (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["output_throughput"] if r.get("completed") else -1.0)[(len(runs) - 1) // 2]


def run_sweep(b: Bench, checkpoint=lambda part: None) -> dict:
    """Poisson points in increasing rate; stops after a point below ``--stop-below`` attainment."""
    a, points = b.args, []
    for k, rate in enumerate(a.rates):
        n = max(1, round(rate * a.duration))
        reqs = synthetic(n, a.prompt_len, a.output_len, request_rate=rate, seed=a.seed + 1 + k)
        log(f"sweep: {rate:g} req/s, {n} requests over {reqs[-1].arrival_s:.1f}s")
        # unfinished at the deadline: failed (the stream is closed: aborted)
        before = b.instance_stats()
        results, duration = b.run(reqs, deadline_s=b.slo_deadline(reqs, a.drain_s), decide_by_slo=True)
        s = b.summary(results, duration)
        server = server_latency(before, b.instance_stats(), a.tbt_slo)  # the server's side of the TBT figures
        points.append({"rate": rate, "num_requests": n, **s, **server})
        checkpoint({"points": points})
        log(f"sweep: {rate:g} req/s -> attainment {100 * s['slo_attainment']:.1f}%, completed {s['completed']}/{n}, "
            f"TTFT p99 {s['p99_ttft_ms']:.0f} ms, TBT p99 {s['p99_itl_ms']:.1f} ms"
            + (f" (server: step p99 <= {server['server_step_p99_ms']:g} ms, token gap p99 <= "
               f"{server['server_itl_p99_ms']:g} ms)" if server.get("server_steps") else "")
            + f", {s['output_throughput']:.0f} out tok/s")
        if not go_higher(s["slo_attainment"], a.settle_s, a.stop_below, "sweep"):
            break
    passing = [p["rate"] for p in points if p["slo_attainment"] >= 0.95]
    return {"ttft_slo_s": a.ttft_slo, "tbt_slo_s": a.tbt_slo, "points": points,
            "goodput_req_s": max(passing) if passing else 0.0,
            "skipped_rates": [r for r in a.rates if r not in {p["rate"] for p in points}]}


def long_prompt_len(args: argparse.Namespace, max_model_len: int | None) -> int | None:
    """The long prompt: the model's context (at most 128K) minus the outputs; None where the model or
    the server's context is shorter than 128K (except --quick, which uses whatever it has)."""
    ctx = max_model_len or 0
    if args.long_prompt is not None:
        return args.long_prompt
    if ctx >= LONG_CONTEXT or (args.quick and ctx > args.long_output):
        return min(ctx, LONG_CONTEXT) - args.long_output
    return None


def serve_phases(args: argparse.Namespace, extra: list[str], tag: str, out_dir: Path,
                 prompts: list[list[list[int]]], vocab: int, full: bool, save=lambda: None) -> dict:
    """One server: [first request], burst, [long prompt, steady request], sweep. ``save()`` after
    each phase writes what is there so far (``res`` is filled in place)."""
    server = ServerProcess(ServerSpec(args.model, args.device, args.ranks, args.api_key, tuple(extra)), tag, out_dir)
    res: dict = {"server_args": extra}
    save(res)
    with measuring(server, args.device, res, "phase"):
        t0 = time.time()
        b = Bench(args, server.start(args.start_timeout), vocab)
        res["startup_s"], res["max_model_len"] = time.time() - t0, b.max_model_len
        if full:
            res["first_request"] = b.single(min(512, args.prompt_len), 16, seed=10_001)
            log(f"first request after ready: TTFT {res['first_request']['ttft_s']}")
        runs = [run_burst(b, burst) for burst in prompts]
        res["burst_cached_tokens"] = [r.get("total_cached_tokens") for r in runs]
        res["burst"] = median_run(runs)
        res["burst_runs_tok_s"] = [r["output_throughput"] for r in runs]
        save(res)
        if full:
            res["steady_request"] = b.single(min(512, args.prompt_len), 16, seed=10_002)
            n = long_prompt_len(args, b.max_model_len)
            if n:  # --long-prompt 0 skips it
                log(f"long prompt: {n} tokens")
                res["long_prompt"] = b.single(n, args.long_output, seed=10_003, timeout_s=args.long_timeout)
                log(f"long prompt: {res['long_prompt']}")
            save(res)
        if args.rates:
            res["sweep"] = run_sweep(b, lambda part: save({**res, "sweep_partial": part}))
            save(res)
    return res


# ---- the offline engine -----------------------------------------------------------------------------


def offline_engine_kwargs(args: argparse.Namespace, extra: list[str]) -> dict:
    """The engine config the server's instance builds from the same flags (actors/xp_deployment.py)."""
    from conflux_cluster.actors.xp_deployment import engine_config
    from conflux_cluster.cli import build_parser
    from conflux_cluster.commands.serve import config_from_args

    argv = ["serve", "--model", args.model, "--device", str(args.device), "--ranks", str(args.ranks), *extra]
    ecfg = engine_config(config_from_args(build_parser().parse_args(argv)), args.ranks, args.device)
    return ecfg.model_dump()


def resolve_offline_profile(kw: dict) -> str:
    """The estimator profile the server's instance resolved for 'auto' (a shipped or cached file for
    this hardware, model and ranks; the server caches one it profiled), so the offline engine
    schedules with the same one; 'budget' where there is none (what the engine does with 'auto')."""
    wanted = kw["scheduler"]["estimator_profile"]
    if wanted != "auto":
        return wanted
    try:
        from conflux_cluster.engine.config import Device
        from conflux_cluster.engine.profiling.store import local_hardware_name, resolve_profile

        found = resolve_profile(kw["model"], local_hardware_name(Device.of(kw["device"])), kw["num_ranks"], kw["tp_size"],
                                kw["dtype"], xp_mode=kw["xp_mode"])
    except Exception as e:  # noqa: BLE001 - an older engine without profile_store: the engine's fallback
        log(f"offline: estimator profile 'auto' not resolved ({e}); 'budget'")
        found = None
    return str(found) if found is not None else "budget"


def warm_offline(llm, prompts: list[list[int]]) -> str:
    """The engine's own warm-up (what the server runs before it is ready), else two short requests."""
    from conflux_cluster import SamplingParams

    try:
        from conflux_cluster.engine.runtime.warmup import warm_up

        warm_up(llm.engine)
        return "engine warm_up"
    except ImportError:
        llm.generate([p[: min(512, len(p))] for p in prompts[:2]],
                     SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        return "two 512/16 requests"


def run_offline(args: argparse.Namespace, extra: list[str], prompts: list[list[list[int]]]) -> dict:
    from conflux_cluster import LLM, SamplingParams

    kw = offline_engine_kwargs(args, extra)
    kw["scheduler"]["estimator_profile"] = resolve_offline_profile(kw)
    model, device, dtype = kw.pop("model"), kw.pop("device"), kw.pop("dtype")
    log(f"offline: LLM(model={model}, device={device}, num_ranks={kw['num_ranks']}) with the server's engine "
        f"config (estimator profile {kw['scheduler']['estimator_profile']})")
    t0 = time.time()
    llm = LLM(model=model, device=device, dtype=dtype, **kw)
    try:
        startup = time.time() - t0
        warm = warm_offline(llm, prompts[0])
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        runs = []
        for burst in prompts:
            t1 = time.perf_counter()
            outs = llm.generate(burst, params)
            dt = time.perf_counter() - t1
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            log(f"offline: {tokens} tokens in {dt:.2f}s = {tokens / dt:.0f} output tok/s")
            runs.append({"duration": dt, "total_output_tokens": tokens, "output_throughput": tokens / dt,
                         "completed": True})
    finally:
        llm.shutdown()
    return {"startup_s": startup, "warm_up": warm, **median_run(runs),
            "runs_tok_s": [r["output_throughput"] for r in runs],
            "engine_config": {"model": model, "device": device, "dtype": dtype, **kw}}


# ---- main ----------------------------------------------------------------------------------------


def slo_args(args: argparse.Namespace) -> list[str]:
    """The benchmark's SLOs for the server's scheduler too (``--ttft-slo/--tbt-slo`` where conflux serve
    has them); put before --server-arg, which can override them (argparse: the last one wins)."""
    from conflux_cluster.cli import build_parser

    flags = ["--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo)]
    _, unknown = build_parser().parse_known_args(["serve", *flags])
    return [] if unknown else flags


def policy_args(policy: str) -> list[str]:
    """``--policy P`` when ``conflux serve`` has that flag, else a YAML file setting scheduler.policy."""
    from conflux_cluster.cli import build_parser

    _, unknown = build_parser().parse_known_args(["serve", "--policy", policy])
    if not unknown:
        return ["--policy", policy]
    f = Path(tempfile.mkdtemp()) / f"policy-{policy}.yaml"  # replaces a --config among --server-arg
    f.write_text(f"scheduler:\n  policy: {policy}\n")
    return ["--config", str(f)]


def model_config(name: str) -> ModelConfig:
    from conflux_cluster.engine.models.config import PRESETS

    if name in PRESETS:
        return PRESETS[name]
    from conflux_cluster.engine.loader import resolve_model

    return resolve_model(name).config


def ratios(res: dict) -> dict:
    burst = (res.get("served") or {}).get("burst") or {}
    tok_s = burst.get("output_throughput") if burst.get("completed") else None
    out = {"served_output_tok_s": tok_s, "roofline_output_tok_s": res["roofline"]["output_tok_s"]}
    out["measured_over_roofline"] = tok_s / out["roofline_output_tok_s"] if tok_s else None
    off = (res.get("offline") or {}).get("output_throughput")
    out["offline_output_tok_s"] = off
    out["served_over_offline"] = tok_s / off if tok_s and off else None
    first, steady = ((res.get("served") or {}).get(k) or {} for k in ("first_request", "steady_request"))
    if first.get("ttft_s") and steady.get("ttft_s"):
        out["first_over_steady_ttft"] = first["ttft_s"] / steady["ttft_s"]
    return out


def _fmt(v, spec: str = ".0f", unit: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{unit}"


def table(res: dict) -> str:
    r, s = res["ratios"], res.get("served") or {}
    b = s.get("burst") or {}
    a = res["args"]
    rows = [(f"burst {a['burst']} x {a['prompt_len']}/{a['output_len']}: completed", _fmt(b.get("completed"), "d")),
            ("  output tok/s", _fmt(r["served_output_tok_s"])),
            ("  TTFT p50 / p99 (ms)", f"{_fmt(b.get('median_ttft_ms'))} / {_fmt(b.get('p99_ttft_ms'))}"),
            ("  TBT p50 / p99 (ms)", f"{_fmt(b.get('median_itl_ms'), '.1f')} / {_fmt(b.get('p99_itl_ms'), '.1f')}"),
            ("roofline limit: output tok/s (s)", f"{_fmt(r['roofline_output_tok_s'])} "
                                                 f"({res['roofline']['total_s']:.2f} s)"),
            ("  measured / roofline", _fmt(r["measured_over_roofline"], ".1%")),
            ("offline engine: output tok/s", _fmt(r["offline_output_tok_s"])),
            *([(f"  offline, {' '.join(a['compare_arg'])}: output tok/s",
                _fmt(res["offline_compare"].get("output_throughput")))] if res.get("offline_compare") else []),
            ("  served / offline", _fmt(r["served_over_offline"], ".1%"))]
    if "first_over_steady_ttft" in r:
        rows.append(("first-request TTFT / steady", f"{r['first_over_steady_ttft']:.2f}x "
                     f"({s['first_request']['ttft_s']:.3f} / {s['steady_request']['ttft_s']:.3f} s)"))
    lp = s.get("long_prompt")
    if lp:
        rows.append((f"long prompt {lp['prompt_tokens']} tokens: TTFT (s)",
                     _fmt(lp["ttft_s"], ".2f") if lp["completed"] else f"failed: {(lp['error'] or '')[:60]}"))
    cmp = " ".join(([f"policy {a['compare_policy']}"] if a.get("compare_policy") else []) + a.get("compare_arg", []))
    cb = (res.get("compare") or {}).get("burst")
    if cb:
        rows.append((f"burst, {cmp}: output tok/s", _fmt(cb.get("output_throughput"))))
    for label, run in (("sweep", s), (f"sweep, {cmp}", res.get("compare") or {})):
        sw = run.get("sweep")
        if not sw:
            continue
        pts = ", ".join(f"{p['rate']:g}:{100 * p['slo_attainment']:.0f}%" for p in sw["points"])
        rows.append((f"{label} (rate:attainment)", pts))
        rows.append((f"  goodput (>=95%, TTFT {sw['ttft_slo_s']:g}s / TBT {1e3 * sw['tbt_slo_s']:g}ms)",
                     f"{sw['goodput_req_s']:g} req/s"))
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{v}" for k, v in rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(p, "gpu_serve.json")
    p.add_argument("--burst", type=int, default=64, help="requests in the burst")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rates", default="4,8,12,16,20,24", help="req/s of the Poisson sweep ('' skips it)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per sweep point")
    p.add_argument("--drain-s", type=float, default=None,
                   help="after the last arrival, wait this long at most (default: until the last token's deadline "
                        "of the longest output has passed, ending earlier once every request still running has "
                        "missed its SLO: the attainment is then exact)")
    p.add_argument("--settle-s", type=float, default=2.0, help="pause between sweep points")
    p.add_argument("--stop-below", type=float, default=0.5, help="stop the sweep after a point below this attainment")
    p.add_argument("--ttft-slo", type=float, default=1.0)
    p.add_argument("--tbt-slo", type=float, default=0.1)
    p.add_argument("--long-prompt", type=int, default=None, help="long-prompt tokens (default: the context, 128K max; 0 skips it)")
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--long-timeout", type=float, default=300.0, help="give up on the long prompt after this many s")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--compare-policy", default=None, help="also run burst + sweep with this scheduler policy")
    p.add_argument("--compare-arg", action="append", default=[],
                   help="also run burst + sweep with this extra conflux serve flag (repeat for more; with "
                        "--compare-policy: one server with both), e.g. --compare-arg=--no-async-scheduling")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="per GPU, for the roofline (H200 bf16 GEMM)")
    p.add_argument("--hbm-tbps", type=float, default=4.3, help="per GPU, for the roofline (H200 device copy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="bursts per server (and offline runs); the median "
                                                          "one is reported, every throughput is kept")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run (CPU works)")
    args = p.parse_args(argv)
    args.device = resolve_device(args.device)
    if args.quick:
        args.model = args.model or "tiny-llama"
        quick_defaults(args, argv, (("--burst", "burst", 8), ("--prompt-len", "prompt_len", 64),
                                    ("--output-len", "output_len", 16), ("--rates", "rates", "2,4"),
                                    ("--duration", "duration", 4.0)))
    args.model = args.model or "llama-3.1-8b"
    args.ranks = args.ranks or default_ranks(args.device)
    args.rates = [float(x) for x in str(args.rates).split(",") if x.strip()]
    return finish_args(args, "gpu_serve.json")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mcfg = model_config(args.model)
    vocab = mcfg.vocab_size
    extra = slo_args(args) + list(args.server_arg)
    dtype_bytes = 2 if args.device.default_dtype == "bfloat16" else 4  # the engine's "auto" dtype
    res: dict = {**run_record(args, argv, REPO),
                 "roofline": roofline_limit(mcfg, args.burst, args.prompt_len, args.output_len, args.ranks,
                                            dtype_bytes, args.peak_tflops * 1e12, args.hbm_tbps * 1e12)}
    log(f"{args.model} on {args.ranks} x {args.device} ({res['hardware']}); roofline limit of the burst "
        f"{res['roofline']['total_s']:.2f}s = {res['roofline']['output_tok_s']:.0f} output tok/s")
    prompts = burst_prompts(args, vocab)

    def save(key: str):
        def write(part: dict) -> None:
            res[key] = part
            res["ratios"] = ratios(res)
            args.out.write_text(json.dumps(res, indent=2, default=str))
        return write

    # a timeout's SIGTERM: unwind (the server subprocess is stopped in serve_phases' finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res["served"] = serve_phases(args, extra, "default", args.out.parent, prompts, vocab, full=True,
                                 save=save("served"))
    if not args.skip_offline:
        offline = [("offline", extra)] + ([("offline_compare", extra + list(args.compare_arg))] if args.compare_arg else [])
        for key, flags in offline:  # the offline engine with the server's flags (and the compared ones)
            try:
                res[key] = run_offline(args, flags, prompts)
            except Exception as e:  # noqa: BLE001 - report it with the rest
                res[key] = {"error": f"{type(e).__name__}: {e}"}
                log(f"{key} failed: {res[key]['error']}")
            wait_gpus_free(args.device)
    if args.compare_policy or args.compare_arg:
        other = (policy_args(args.compare_policy) if args.compare_policy else []) + list(args.compare_arg)
        res["compare"] = serve_phases(args, extra + other, args.compare_policy or "compare",
                                      args.out.parent, prompts, vocab, full=False, save=save("compare"))
    res["ratios"] = ratios(res)
    args.out.write_text(json.dumps(res, indent=2, default=str))
    log(f"results: {args.out}")
    print(table(res), flush=True)
    return 0 if (res["served"].get("burst") or {}).get("completed") else 1


if __name__ == "__main__":
    sys.exit(main())
