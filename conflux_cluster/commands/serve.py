"""``conflux serve``: the OpenAI-compatible server on Ray Serve.

    conflux serve                           # embedded default: local Ray, 1 XP instance x 2 CPU ranks,
                                            # SmolLM2 on http://127.0.0.1:8000
    conflux serve --instances 2             # two instances behind the global router
    conflux serve --address auto            # join a Ray cluster: instances follow its nodes (N GPUs each)
    conflux serve --config serve.yaml       # any ServeConfig field; flags given explicitly win
    conflux serve --device cuda --gpu-memory-utilization 0.85 --policy slo --tbt-slo 0.1

Every ServeConfig field is a flag (and a YAML key); so is every scheduler field (--policy, --tbt-slo,
...: YAML under 'scheduler:' or at the top level). Each instance logs its effective engine config
(KV blocks per rank, max_model_len, ...) once its engine is built. Before Ray starts, the driver checks
what the replicas would refuse (--host/--port, the key file, the model's heads over --ranks, the
estimator profile, max_model_len against the KV pool: serve/preflight.py); an error names the flag.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from ._fields import FieldFlag, collect, field_flags

ConfigFlag = FieldFlag  # one ``conflux serve`` flag (a ServeConfig or SchedulerConfig field)


def config_flags() -> list[FieldFlag]:
    """Every ServeConfig field as a flag, ``scheduler`` expanded into one flag per SchedulerConfig field
    (``--scheduler-<name>`` where a name is also a ServeConfig field)."""
    from conflux_cluster.config import ServeConfig
    from conflux_cluster.engine.scheduler.config import SchedulerConfig

    flags = field_flags(ServeConfig, [n for n in ServeConfig.model_fields if n != "scheduler"])
    for name in SchedulerConfig.model_fields:
        prefix = "scheduler_" if name in ServeConfig.model_fields else ""
        flags += field_flags(SchedulerConfig, [name], section="scheduler", prefix=prefix)
    return flags


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server (Ray Serve)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML file of ServeConfig fields; flags given explicitly win "
                                                  "(default: unset)")
    serve_group = p.add_argument_group("server, engine and KV cache (ServeConfig)")
    sched_group = p.add_argument_group("per-instance scheduler (ServeConfig.scheduler)")
    for f in config_flags():
        f.add_to(sched_group if f.scheduler else serve_group)
    p.set_defaults(func=run_serve)


def config_from_args(args: argparse.Namespace) -> Any:
    """Flags (and the YAML file) -> a validated ``ServeConfig``; a ValueError names the bad field."""
    from pydantic import ValidationError

    from conflux_cluster.config import ServeConfig, format_validation_error

    given = collect(config_flags(), args)
    overrides: dict[str, Any] = given.get(None, {})
    if "scheduler" in given:
        overrides["scheduler"] = given["scheduler"]
    try:
        if args.config:
            return ServeConfig.from_yaml(args.config, **overrides)
        return ServeConfig(**overrides)
    except ValidationError as e:
        raise ValueError(f"invalid serve configuration: {format_validation_error(e)}") from None
    except OSError as e:
        raise ValueError(f"cannot read --config {args.config}: {e}") from None


def slo_line(s: Any) -> str:
    """Which SLOs the scheduler (a ``SchedulerConfig``) schedules for, in words."""
    ms = f"{1e3 * s.tbt_slo:g} ms"
    head = (f"scheduling for SLOs: first token within {s.ttft_slo:g} s of arrival, token i by arrival + "
            f"{s.ttft_slo:g} s + (i-1) x {ms} (--ttft-slo, --tbt-slo)")
    if s.policy == "slo":
        idle = f" ({s.idle_step_stretch:g} x that when no decode rides in the step)" if s.idle_step_stretch > 1 else ""
        return (f"{head}; policy slo: steps sized to {ms}{idle}, requests that cannot make their first-token deadline "
                f"go after the others until they have waited {s.deferred_wait_factor:g} x what first-come-first-served "
                f"would have made them wait, then take {s.overdue_share:g} of each step, and go first after "
                f"{max(s.deferred_first_factor, s.deferred_wait_factor):g} x")
    return f"{head}; policy {s.policy} orders without them (they judge SLO attainment in the metrics)"


def summary(config: Any) -> str:
    """One line: what ``conflux serve`` starts (each instance logs its effective engine config)."""
    from conflux_cluster.engine.config import GPU_MAX_NUM_BATCHED_TOKENS

    s = config.scheduler
    budget = (str(s.max_num_batched_tokens) if "max_num_batched_tokens" in s.model_fields_set else
              f"{s.max_num_batched_tokens} on CPU, {GPU_MAX_NUM_BATCHED_TOKENS} on CUDA")
    kv = (f"num_kv_blocks={config.num_kv_blocks}" if config.num_kv_blocks is not None else
          f"kv_cache_memory_gb={config.kv_cache_memory_gb}" if config.kv_cache_memory_gb is not None else
          f"kv_cache_memory_gb=1 on CPU, gpu_memory_utilization={config.gpu_memory_utilization} on CUDA")
    return (f"model={config.model} device={config.device} instances={config.instances or 'auto'} "
            f"ranks={config.ranks or 'auto'} dtype={config.dtype} xp_mode={config.xp_mode} "
            f"max_model_len={config.max_model_len or 'auto'} KV: {kv}, block_size={config.block_size} "
            f"cuda_graphs={'auto' if config.cuda_graphs is None else config.cuda_graphs} "
            f"async_scheduling={config.async_scheduling} | scheduler: "
            f"policy={s.policy} estimator_profile={s.estimator_profile} max_num_batched_tokens={budget} max_num_seqs={s.max_num_seqs} "
            f"ttft_slo={s.ttft_slo}s tbt_slo={s.tbt_slo}s | router_policy={config.router_policy.value}")


def graceful_stop(drainer: Any, grace_s: float, force: threading.Event) -> None:
    """Stop admitting (503 server_draining), let the requests in flight finish for up to ``grace_s``
    (``serve/drain.py``); ``force`` (a second signal) cuts the wait short."""
    print(f"ConfluxServe: draining (new requests get 503; up to {grace_s:g} s for the requests in flight; "
          f"a second signal stops at once)", flush=True)
    try:
        result = drainer.drain(grace_s, stop=force)
    except Exception as e:  # noqa: BLE001 - the app is half gone already: stop anyway
        print(f"ConfluxServe: drain failed ({e}); stopping", file=sys.stderr, flush=True)
        return
    print(f"ConfluxServe: drained in {result.waited_s:.1f} s ({result.open_at_start} requests open at the "
          f"signal, {result.open_at_end} still open)", flush=True)


def run_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    from conflux_cluster.serve.preflight import check_before_ray

    check_before_ray(config)  # --host/--port, key file, the instances' engine: a ValueError names the flag
    print(f"ConfluxServe: {summary(config)}", flush=True)
    print(f"ConfluxServe: {slo_line(config.scheduler)}", flush=True)
    import ray
    from ray import serve

    from conflux_cluster.serve.app import DeployFailed, run

    try:
        try:
            config = run(config)
        except DeployFailed as e:
            print(f"conflux serve: error: {e}", file=sys.stderr, flush=True)
            return 1
        print(f"ConfluxServe is up: http://{config.host}:{config.port}/v1  (model '{config.model_name}'; "
              f"Ctrl-C stops it)", flush=True)
        from conflux_cluster.serve.drain import Drainer

        drainer = Drainer(config.app_name)  # its handles set up now, not after the signal
        stop, force = threading.Event(), threading.Event()  # first signal: drain; a second: stop now
        for sig in (signal.SIGINT, signal.SIGTERM):  # Ray replaces Python's SIGINT handler: install ours
            signal.signal(sig, lambda *_: force.set() if stop.is_set() else stop.set())
        while not stop.wait(0.1):
            pass
        graceful_stop(drainer, config.drain_grace_s, force)
    finally:
        print("ConfluxServe: shutting down", flush=True)
        if ray.is_initialized():  # serve.shutdown() without Ray would start one
            serve.shutdown()
            ray.shutdown()
    return 0


if __name__ == "__main__":  # pragma: no cover
    from conflux_cluster.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
