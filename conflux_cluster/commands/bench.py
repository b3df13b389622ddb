"""``conflux bench``: load-test an OpenAI-compatible server (``vllm bench serve``-style report).

Tokens are counted from the per-chunk ``token_ids`` the server returns (``return_token_ids``), not
from text, so random-weight models are measured right (conflux_cluster/bench/client.py).

    conflux bench --num-prompts 32 --input-len 128 --output-len 32 --request-rate 2
    conflux bench --trace mooncake-conversation --num-prompts 64 --request-rate 1 \\
                  --length-scale 0.05 --ttft-slo 2 --tbt-slo 0.2 --save-result out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from conflux_cluster.data import TRACES_DIR

TRACES = {"mooncake-synthetic": "mooncake_synthetic_trace.jsonl",
          "mooncake-conversation": "mooncake_conversation_trace.jsonl"}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="benchmark a running OpenAI-compatible server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-return-token-ids", dest="return_token_ids", action="store_false",
                   help="do not ask for per-chunk token ids (vLLM's 'return_token_ids'; for servers that reject "
                        "it): tokens are then counted from text chunks and the final usage")
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default=None,
                   help=f"trace file (Mooncake jsonl) or one of {', '.join(TRACES)}; default: random lengths")
    w.add_argument("--traces-dir", default=None, help="where the named traces live (default: the copies shipped in conflux_cluster/data/traces)")
    w.add_argument("--num-prompts", type=int, default=32)
    w.add_argument("--input-len", type=int, default=128, help="random workload: prompt tokens")
    w.add_argument("--output-len", type=int, default=32, help="random workload: output tokens")
    w.add_argument("--range-ratio", type=float, default=0.0, help="random workload: lengths uniform in ±ratio")
    w.add_argument("--request-rate", type=float, default=float("inf"),
                   help="req/s (random: Poisson; trace: rescale to this mean rate); inf = all at once")
    w.add_argument("--rate-scale", type=float, default=1.0, help="trace: multiply the trace's arrival rate")
    w.add_argument("--length-scale", type=float, default=1.0, help="trace: multiply its lengths")
    w.add_argument("--max-input-len", type=int, default=None)
    w.add_argument("--max-output-len", type=int, default=None)
    w.add_argument("--max-concurrency", type=int, default=None)
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("SLOs")
    s.add_argument("--ttft-slo", type=float, default=1.0, help="seconds (default: %(default)s)")
    s.add_argument("--tbt-slo", type=float, default=0.1, help="seconds between tokens (default: %(default)s)")
    p.add_argument("--save-result", default=None, help="write the report as JSON here")
    p.set_defaults(func=run_bench)


def _trace_path(name: str, traces_dir: str | None) -> Path:
    if name in TRACES:
        folder = Path(traces_dir) if traces_dir else TRACES_DIR
        path = folder / TRACES[name]
    else:
        path = Path(name)
    if not path.is_file():
        raise ValueError(f"trace {name!r}: {path} does not exist (use --traces-dir or a file path)")
    return path


def _server_model(args: argparse.Namespace) -> tuple[str, int | None]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {args.base_url}/v1/models: {e}") from None
    card = r.json()["data"][0]
    return args.model or card["id"], card.get("max_model_len")


def _vocab_size(model: str) -> int:
    try:
        from conflux_cluster.engine.loader import resolve_model

        return resolve_model(model).config.vocab_size
    except Exception:  # noqa: BLE001 - a remote model we cannot inspect: ordinary ids are safe
        return 30000


def build_workload(args: argparse.Namespace, max_model_len: int | None) -> list:
    from conflux_cluster.bench.workload import LengthPolicy, load_trace, synthetic

    if args.trace is None:
        return synthetic(args.num_prompts, args.input_len, args.output_len, args.request_rate,
                         args.range_ratio, args.seed)
    lengths = LengthPolicy(args.length_scale, args.max_input_len, args.max_output_len, max_model_len)
    rate = None if args.request_rate == float("inf") else args.request_rate
    return load_trace(_trace_path(args.trace, args.traces_dir), args.num_prompts, args.rate_scale, rate, lengths)


def run_bench(args: argparse.Namespace) -> int:
    from conflux_cluster.bench.client import ClientConfig, run_workload
    from conflux_cluster.bench.report import summarize, vllm_result

    model, max_len = _server_model(args)
    requests = build_workload(args, max_len)
    cfg = ClientConfig(args.base_url, model, args.api_key, _vocab_size(model), args.seed,
                       max_concurrency=args.max_concurrency, return_token_ids=args.return_token_ids)
    print(f"benchmarking {args.base_url} ({model}): {len(requests)} requests", flush=True)
    results, duration = asyncio.run(run_workload(cfg, requests))
    report = summarize(results, duration, args.ttft_slo, args.tbt_slo)
    print(report.format())
    if report.errors:
        print("errors:", *report.errors, sep="\n  ", file=sys.stderr)
    extra = _conflux_stats(args)
    if extra:
        for inst in extra.get("instances", []):
            print(f"control plane ({inst['kind']}): {100 * inst['share_of_iteration']:.2f}% of iteration time, "
                  f"{1e3 * inst['control_s'] / max(1, inst['calls']):.2f} ms/iteration over {inst['calls']} iterations")
    if args.save_result:
        saved = {**report.to_dict(), **vllm_result(report, results), "conflux_stats": extra}
        Path(args.save_result).write_text(json.dumps(saved, indent=2))
    return 0 if report.completed else 1


def _conflux_stats(args: argparse.Namespace) -> dict | None:
    """ConfluxServe's own counters (router decisions, control-plane share); None for other servers."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(f"{args.base_url}/v1/conflux/stats", headers=headers, timeout=30)
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


if __name__ == "__main__":  # pragma: no cover
    from conflux_cluster.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
