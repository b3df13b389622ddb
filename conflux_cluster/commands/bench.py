"""``conflux bench``: load-test an OpenAI-compatible server (``vllm bench serve``-style report).

Tokens are counted from the per-chunk ``token_ids`` the server returns (``return_token_ids``), not
from text, so random-weight models are measured right (conflux_cluster/bench/client.py).

    conflux bench --num-prompts 32 --input-len 128 --output-len 32 --request-rate 2 --ignore-eos
    conflux bench --endpoint /v1/chat/completions --dataset-name sharegpt \\
                  --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json --num-prompts 200 \\
                  --request-rate 4 --burstiness 0.5 --goodput ttft:1000 tpot:100 --metric-percentiles 50,90,99
    conflux bench --trace mooncake-conversation --num-prompts 64 --request-rate 1 --ignore-eos \\
                  --length-scale 0.05 --ttft-slo 2 --tbt-slo 0.2 --save-result out.json

Options follow ``vllm bench serve`` where it has them (``--ignore-eos`` is off by default there and
here: without it, outputs may end early at the model's end-of-sequence token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from conflux_cluster.bench.endpoints import COMPLETIONS, ENDPOINTS
from conflux_cluster.bench.datasets import DATASETS
from conflux_cluster.commands._checks import require_positive, require_writable_file
from conflux_cluster.data import TRACES_DIR

TRACES = {"mooncake-synthetic": "mooncake_synthetic_trace.jsonl",
          "mooncake-conversation": "mooncake_conversation_trace.jsonl"}


def register(subparsers: Any) -> None:
    from ._formatting import HelpFormatter

    p = subparsers.add_parser("bench", help="benchmark a running OpenAI-compatible server",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", type=lambda url: url.rstrip("/"),
                   help="server to benchmark (routes are appended to it: a trailing '/' is dropped)")
    p.add_argument("--endpoint", default=COMPLETIONS, choices=ENDPOINTS,
                   help="API route: token-id or text prompts to completions, text prompts to chat completions")
    p.add_argument("--model", default=None, help="model name to send (unset: the first model the server lists)")
    p.add_argument("--tokenizer", default=None,
                   help="local model (name, HF directory or .gguf) whose tokenizer counts and builds text prompts "
                        "(unset: the served model's name, if it is a model available here)")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer <key>' (unset: the OPENAI_API_KEY variable if set, as vLLM)")
    p.add_argument("--no-return-token-ids", dest="return_token_ids", action="store_false",
                   help="do not ask for per-chunk token ids (vLLM's 'return_token_ids'; for servers that reject "
                        "it): tokens are then counted from text chunks and the final usage")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly each request's output length (vLLM's ignore_eos), past the end-of-sequence "
                        "token")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset-name", default="random", choices=DATASETS,
                   help="random: token ids of --input-len; sharegpt: a ShareGPT JSON file; custom: a jsonl of "
                        '{"prompt": ...} lines (both read from --dataset-path)')
    w.add_argument("--dataset-path", default=None, help="local file of the sharegpt or custom dataset")
    w.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: output tokens of every request (unset: the length of each conversation's reply)")
    w.add_argument("--custom-output-len", type=int, default=256, help="custom: output tokens of every request")
    w.add_argument("--trace", default=None,
                   help=f"replay a Mooncake jsonl trace (a file or one of {', '.join(TRACES)}) instead of a dataset")
    w.add_argument("--trace-sample", default="slice", choices=["slice", "sessions"],
                   help="trace: its first --num-prompts lines (slice), or whole sessions (requests whose first two "
                        "hash_ids agree) drawn with --seed over the trace, which keeps its prefix reuse")
    w.add_argument("--traces-dir", default=None,
                   help="where the named traces live (unset: the copies shipped in conflux_cluster/data/traces)")
    w.add_argument("--num-prompts", type=int, default=32, help="requests to send")
    w.add_argument("--input-len", type=int, default=128, help="random: prompt tokens")
    w.add_argument("--output-len", type=int, default=32, help="random: output tokens")
    w.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in ±ratio")
    w.add_argument("--request-rate", type=float, default=float("inf"),
                   help="req/s (datasets: gamma arrivals, see --burstiness; trace: rescale to this mean rate); "
                        "inf = all at once")
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="datasets: shape of the gamma inter-arrival times (1: Poisson, < 1 burstier, "
                        "> 1 more uniform), as vLLM")
    w.add_argument("--rate-scale", type=float, default=1.0, help="trace: multiply the trace's arrival rate")
    w.add_argument("--length-scale", type=float, default=1.0, help="trace: multiply its lengths")
    w.add_argument("--max-input-len", type=int, default=None, help="trace: cap on prompt tokens (unset: none)")
    w.add_argument("--max-output-len", type=int, default=None, help="trace: cap on output tokens (unset: none)")
    w.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (unset: none)")
    w.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths, arrivals and shuffling")
    s = p.add_argument_group("report")
    s.add_argument("--ttft-slo", type=float, default=1.0,
                   help="seconds: the first token's deadline of the per-token SLO attainment, and the TTFT bound "
                        "of request goodput unless --goodput sets one")
    s.add_argument("--tbt-slo", type=float, default=0.1,
                   help="seconds between tokens: the per-token deadlines' step, and the TPOT bound of request "
                        "goodput unless --goodput sets one")
    s.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="vLLM's request goodput bounds, e.g. 'ttft:500 tpot:50' (also e2el); "
                        "unset: ttft:<--ttft-slo> tpot:<--tbt-slo>")
    s.add_argument("--metric-percentiles", default="99",
                   help="comma list of percentiles reported for TTFT, TPOT, ITL and E2EL, e.g. 25,50,99")
    s.add_argument("--save-result", default=None,
                   help="write the report as JSON here (vLLM's flat keys plus ConfluxServe's); unset: not saved")
    s.add_argument("--print-json", action="store_true",
                   help="also print the saved JSON (one line, after the table): results that leave a pod in its log")
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
    """The model to send (``--model``, else the first the server lists) and its context, if the server says."""
    import httpx

    url = f"{args.base_url}/v1/models"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=30)
        r.raise_for_status()
    except (httpx.HTTPError, httpx.InvalidURL) as e:  # InvalidURL: a --base-url httpx cannot parse
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__  # httpx adds a help line
        hint = (" (--base-url is the server's root: leave out /v1)" if args.base_url.endswith("/v1")
                and isinstance(e, httpx.HTTPStatusError) and e.response.status_code == 404 else "")
        raise ValueError(f"cannot reach {url}: {reason}{hint}") from None
    try:
        card = r.json()["data"][0]
        return args.model or card["id"], card.get("max_model_len")
    except (ValueError, LookupError, TypeError, AttributeError):  # not JSON, no model, not a model card
        raise ValueError(f"{url} did not answer an OpenAI model list with a model in it (is --base-url an "
                         f"OpenAI-compatible server? it answered {r.text[:100]!r})") from None


def _tokenizer(name: str | None, required_for: str | None):
    """The tokenizer of a model available here (None if there is none and nothing needs one)."""
    try:
        from conflux_cluster.engine.loader import load_tokenizer, resolve_model

        source = resolve_model(name) if name else None
        return (load_tokenizer(source), source.config.vocab_size) if source else (None, 30000)
    except Exception as e:  # noqa: BLE001 - a remote model we cannot inspect
        if required_for:
            raise ValueError(f"{required_for} needs a tokenizer: pass --tokenizer <model available here> "
                             f"({name!r}: {e})") from None
        return None, 30000  # token-id prompts: ordinary ids below 30000 are safe for any vocabulary


def build_workload(args: argparse.Namespace, max_model_len: int | None,
                   model: str | None = None) -> tuple[list, list | None]:
    """The requests and their prompts (None: random token ids drawn by the client)."""
    from conflux_cluster.bench import datasets as D
    from conflux_cluster.bench.endpoints import CHAT
    from conflux_cluster.bench.workload import LengthPolicy, load_trace, prompt_ids, synthetic

    text = args.dataset_name != "random" or args.endpoint == CHAT
    if args.trace is not None:
        if args.dataset_name != "random" or args.endpoint == CHAT:
            raise ValueError("--trace replays token-id prompts: use it with --dataset-name random and "
                             f"--endpoint {COMPLETIONS}")
        lengths = LengthPolicy(args.length_scale, args.max_input_len, args.max_output_len, max_model_len)
        rate = None if args.request_rate == float("inf") else args.request_rate
        path = _trace_path(args.trace, args.traces_dir)
        seed = args.seed if args.trace_sample == "sessions" else None
        return load_trace(path, args.num_prompts, args.rate_scale, rate, lengths, sessions_seed=seed), None
    if args.dataset_name != "random" and not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} reads a local file: pass --dataset-path")
    need = (f"--dataset-name {args.dataset_name}" if args.dataset_name != "random"
            else f"--endpoint {args.endpoint} (text prompts)") if text else None
    tokenizer, vocab = _tokenizer(args.tokenizer or model, need)
    if args.dataset_name == "sharegpt":
        samples = D.sharegpt(args.dataset_path, args.num_prompts, tokenizer, args.seed, args.sharegpt_output_len)
    elif args.dataset_name == "custom":
        samples = D.custom(args.dataset_path, args.num_prompts, tokenizer, args.custom_output_len, args.seed)
    elif text:
        samples = D.random_text(args.num_prompts, args.input_len, args.output_len, tokenizer, vocab,
                                args.range_ratio, args.seed)
    else:
        requests = synthetic(args.num_prompts, args.input_len, args.output_len, args.request_rate,
                             args.range_ratio, args.seed, args.burstiness)
        import random

        rng = random.Random(args.seed)
        return requests, [prompt_ids(r.input_len, vocab, rng) for r in requests]
    return D.schedule(samples, args.request_rate, args.burstiness, args.seed)


def _percentiles(spec: str) -> tuple[float, ...]:
    try:
        ps = tuple(float(x) for x in spec.split(",") if x.strip())
    except ValueError:
        ps = ()
    if not ps or not all(0 <= p <= 100 for p in ps):
        raise ValueError(f"--metric-percentiles: a comma list of numbers in [0, 100], got {spec!r}")
    return ps


def run_bench(args: argparse.Namespace) -> int:
    from conflux_cluster.bench.client import ClientConfig, run_workload
    from conflux_cluster.bench.report import GoodputSLO, summarize, vllm_result

    check_args(args)
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    percentiles = _percentiles(args.metric_percentiles)
    goodput = GoodputSLO.parse(args.goodput) if args.goodput else None
    model, max_len = _server_model(args)
    requests, prompts = build_workload(args, max_len, model)
    cfg = ClientConfig(args.base_url, model, args.api_key, seed=args.seed, max_concurrency=args.max_concurrency,
                       return_token_ids=args.return_token_ids, endpoint=args.endpoint, ignore_eos=args.ignore_eos,
                       progress=not args.disable_tqdm)
    print(f"benchmarking {args.base_url}{args.endpoint} ({model}): {len(requests)} requests", flush=True)
    results, duration = asyncio.run(run_workload(cfg, requests, prompts))
    ttft_slo, tbt_slo = args.ttft_slo, args.tbt_slo
    if goodput is None:
        goodput = GoodputSLO(ttft_s=ttft_slo, tpot_s=tbt_slo)
    else:  # the per-token attainment follows the goodput's bounds where it names them
        ttft_slo = goodput.ttft_s if goodput.ttft_s is not None else ttft_slo
        tbt_slo = goodput.tpot_s if goodput.tpot_s is not None else tbt_slo
    report = summarize(results, duration, ttft_slo, tbt_slo, goodput, percentiles)
    print(report.format())
    if report.errors:
        print("errors:", *report.errors, sep="\n  ", file=sys.stderr)
    extra = _conflux_stats(args)
    if extra:
        for inst in extra.get("instances", []):
            print(f"control plane ({inst['kind']}): {100 * inst['share_of_iteration']:.2f}% of iteration time, "
                  f"{1e3 * inst['control_s'] / max(1, inst['calls']):.2f} ms/iteration over {inst['calls']} iterations")
    if args.save_result or args.print_json:
        saved = {**_run_info(args, model), **report.to_dict(), **vllm_result(report, results), "conflux_stats": extra}
        if args.save_result:
            Path(args.save_result).write_text(json.dumps(saved, indent=2))
        if args.print_json:
            print(json.dumps(saved), flush=True)
    return 0 if report.completed else 1


def check_args(args: argparse.Namespace) -> None:
    """A ValueError naming the first flag out of its range (or an unwritable --save-result), before any
    request (or the server) is touched."""
    require_positive({"--num-prompts": args.num_prompts, "--input-len": args.input_len,
                      "--output-len": args.output_len, "--request-rate": args.request_rate,
                      "--burstiness": args.burstiness, "--rate-scale": args.rate_scale,
                      "--length-scale": args.length_scale, "--ttft-slo": args.ttft_slo, "--tbt-slo": args.tbt_slo,
                      "--max-concurrency": args.max_concurrency, "--max-input-len": args.max_input_len,
                      "--max-output-len": args.max_output_len, "--sharegpt-output-len": args.sharegpt_output_len,
                      "--custom-output-len": args.custom_output_len}, infinite_ok={"--request-rate"})
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.trace_sample != "slice" and args.trace is None:
        raise ValueError(f"--trace-sample {args.trace_sample} samples a trace: pass --trace")
    require_writable_file("--save-result", args.save_result)


def _run_info(args: argparse.Namespace, model: str) -> dict:
    """vLLM's run metadata keys."""
    import datetime

    return {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": "openai-chat" if args.endpoint.endswith("chat/completions") else "openai",
            "endpoint": args.endpoint, "model_id": model, "tokenizer_id": args.tokenizer or model,
            "dataset_name": "trace" if args.trace else args.dataset_name, "num_prompts": args.num_prompts,
            "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency}


def _conflux_stats(args: argparse.Namespace) -> dict | None:
    """ConfluxServe's own counters (router decisions, control-plane share); None for other servers."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(f"{args.base_url}/v1/conflux/stats", headers=headers, timeout=30)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):  # not reached, or a 200 that is not JSON: not ConfluxServe
        return None


if __name__ == "__main__":  # pragma: no cover
    from conflux_cluster.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
