"""``conflux profile``: measure this hardware's iteration latency and fit the estimator profile.

    conflux profile --model llama-3.1-8b --device cuda --num-ranks 2 --out h200-llama8b-n2.json
    conflux profile --model smollm2-135m-instruct --grid cpu --out cpu-smollm2.json
    conflux profile --fit-only raw.json --model llama-3.1-8b --num-ranks 2 --out p.json   # refit saved samples

Writes an ``EstimatorProfile`` JSON for ``SchedulerConfig.estimator_profile`` and prints the MAPE
on held-out heterogeneous batches. How the components are separated: ``engine/profiling/harness.py``.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from conflux_cluster.commands._checks import int_list, require_positive, require_writable_file

if TYPE_CHECKING:
    from conflux_cluster.engine.config import EngineConfig


def register(subparsers: Any) -> None:
    from ._formatting import HelpFormatter

    p = subparsers.add_parser("profile", help="measure iteration latency on this hardware and fit the "
                                              "scheduler's latency model (writes a profile JSON)",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="built-in name, random preset, HF dir or .gguf")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:<i>")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights, activations and KV; auto = float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--num-ranks", type=int, default=1, help="logical ranks N of the XP instance")
    p.add_argument("--tp-size", type=int, default=1, help="devices per logical rank")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None, help="KV pool per rank (GiB)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per rank (overrides the GiB budget)")
    p.add_argument("--grid", choices=["cpu", "gpu"], default=None, help="measurement ranges (default: by device)")
    p.add_argument("--batches", type=int, default=None, help="heterogeneous batches (half held out for MAPE)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; stops the heterogeneous phase")
    p.add_argument("--prefill-chunks", type=int_list(1), default=None,
                   help="comma list of chunk lengths ℓ to measure")
    p.add_argument("--prefill-contexts", type=int_list(0), default=None,
                   help="comma list of c before a measured chunk")
    p.add_argument("--decode-contexts", type=int_list(1), default=None, help="comma list of decode-pool contexts")
    p.add_argument("--decode-batches", type=int_list(1), default=None, help="comma list of decodes per rank")
    p.add_argument("--repeats", type=int, default=None, help="runs per decode/prefill-family point, fastest kept")
    p.add_argument("--hetero-repeats", type=int, default=None,
                   help="runs per heterogeneous batch, fastest kept (>= 2 hides first-shape compile/alloc costs)")
    p.add_argument("--query-tile", type=int, default=None,
                   help="count a chunk's queries over its history in tiles of this many (default: 128 measuring on "
                        "CUDA, where the flash kernels' query blocks are; 1 on CPU and with --fit-only)")
    p.add_argument("--hardware", default=None, help="name stored in the profile (default: cpu / cuda device name)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--raw-out", default=None, help="also save the raw samples (JSON) for refitting")
    p.add_argument("--fit-only", default=None, action="append", metavar="RAW",
                   help="fit saved samples, measure nothing: a profiler's --raw-out JSON or a served step log "
                        "(.jsonl, `conflux serve --step-log`); repeat to fit them together")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.set_defaults(func=run_profile)


def check_args(args: argparse.Namespace) -> None:
    """A ValueError naming the first flag out of its range or an output path that cannot be written, before
    anything is loaded or measured."""
    require_positive({"--num-ranks": args.num_ranks, "--tp-size": args.tp_size,
                      "--kv-cache-memory-gb": args.kv_cache_memory_gb, "--num-kv-blocks": args.num_kv_blocks,
                      "--batches": args.batches, "--time-budget": args.time_budget, "--repeats": args.repeats,
                      "--hetero-repeats": args.hetero_repeats, "--threads": args.threads,
                      "--query-tile": args.query_tile},
                     infinite_ok={"--time-budget"})
    require_writable_file("--out", args.out)
    require_writable_file("--raw-out", args.raw_out)


def run_profile(args: argparse.Namespace) -> int:
    from conflux_cluster.engine.profiling.harness import ProfileGrid, profile_engine
    from conflux_cluster.engine.scheduler.fitting.samples import Measurements, fit_measurements

    check_args(args)
    if args.fit_only:
        from conflux_cluster.engine.loader import resolve_model

        mcfg = resolve_model(args.model).config
        measured = Measurements()
        for path in args.fit_only:
            try:
                measured = measured + Measurements.load(path)
            except ValueError as e:  # names the file and what is wrong with it
                raise ValueError(f"--fit-only {e}") from None
            except OSError as e:  # missing, unreadable, a directory
                raise ValueError(f"--fit-only {path}: {e.strerror or e}") from None
        if len(measured.decode) < 3 or len(measured.prefill) < 3:
            raise ValueError(f"--fit-only: the fit separates its terms on >= 3 decode-only and >= 3 prefill-only "
                             f"steps; these samples have {len(measured.decode)} and {len(measured.prefill)} (a served "
                             "step log has few prefill-only steps under load: add a profiler's raw JSON with another "
                             "--fit-only)")
        profile = fit_measurements(measured, model=args.model,
                                   hardware=args.hardware or "unknown", num_ranks=args.num_ranks,
                                   num_layers=mcfg.num_hidden_layers, query_tile=args.query_tile or 1,
                                   meta={"kind": "measured", "refit_of": args.fit_only})
    else:
        from conflux_cluster.engine.config import EngineConfig

        extra = {k: v for k, v in (("kv_cache_memory_gb", args.kv_cache_memory_gb),
                                   ("num_kv_blocks", args.num_kv_blocks)) if v is not None}
        cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, num_ranks=args.num_ranks,
                           tp_size=args.tp_size, num_threads=args.threads, load_progress=False, **extra)
        cfg.require_device()  # before the hardware's name is asked of CUDA
        grid = ProfileGrid.gpu() if (args.grid or ("gpu" if cfg.on_cuda else "cpu")) == "gpu" else ProfileGrid.cpu()
        if args.batches is not None:
            grid.hetero_batches = args.batches
        if args.time_budget is not None:
            grid.time_budget_s = args.time_budget
        for flag, attr in (("prefill_chunks", "prefill_chunk"), ("prefill_contexts", "prefill_context"),
                           ("decode_contexts", "decode_context"), ("decode_batches", "decode_batch")):
            if getattr(args, flag):
                setattr(grid, attr, getattr(args, flag))
        if args.repeats is not None:
            grid.repeats = args.repeats
        if args.hetero_repeats is not None:
            grid.hetero_repeats = args.hetero_repeats
        profile = profile_engine(cfg, grid, args.hardware or _hardware_name(cfg), raw_out=args.raw_out,
                                 query_tile=args.query_tile)
    profile.to_json(args.out)
    mape = {k: v for k, v in profile.meta.items() if k.startswith("mape")}
    print(json.dumps({"out": args.out, "alpha": profile.alpha, "beta": profile.beta, **mape}, indent=2))
    return 0


def _hardware_name(cfg: EngineConfig) -> str:
    if not cfg.on_cuda:
        return "cpu"
    import torch

    return torch.cuda.get_device_name(torch.device(cfg.device_name)).lower().replace(" ", "-")
