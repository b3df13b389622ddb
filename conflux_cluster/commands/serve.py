"""``conflux serve``: the OpenAI-compatible server on Ray Serve.

    conflux serve                           # embedded default: local Ray, 1 XP instance x 2 CPU ranks,
                                            # SmolLM2 on http://127.0.0.1:8000
    conflux serve --instances 2             # two instances behind the global router
    conflux serve --address auto            # join a Ray cluster: one instance per node of N GPUs
    conflux serve --config serve.yaml       # any ServeConfig field; flags given explicitly win
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

# flag -> ServeConfig field (flags default to None so the YAML file's values survive)
_FLAGS: list[tuple[str, str, type, str]] = [
    ("--model", "model", str, "built-in name or local HF directory / .gguf (default: smollm2-135m-instruct)"),
    ("--served-model-name", "served_model_name", str, "name clients send as 'model'"),
    ("--host", "host", str, "bind address (default: 127.0.0.1)"),
    ("--port", "port", int, "HTTP port (default: 8000; 0 = any free port)"),
    ("--address", "address", str, "Ray cluster to join ('auto'); default: start a local Ray"),
    ("--instances", "instances", int, "XP instances (default: 1 locally, one per node with --address)"),
    ("--ranks", "ranks", int, "ranks per instance (default: 2 on CPU, the node's GPUs on GPU)"),
    ("--device", "device", str, "auto | cpu | cuda"),
    ("--router-policy", "router_policy", str, "lowest_load | round_robin | power_of_two | random"),
    ("--ingress-replicas", "ingress_replicas", int, "HTTP ingress replicas"),
    ("--api-key", "api_key", str, "require 'Authorization: Bearer <key>' on /v1"),
    ("--max-model-len", "max_model_len", int, "context cap in tokens"),
    ("--num-kv-blocks", "num_kv_blocks", int, "KV blocks per rank"),
    ("--control-plane", "control_plane", str, "auto | compiled_graph | actor_calls"),
]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server (Ray Serve)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML file of ServeConfig fields")
    for flag, field, typ, help_ in _FLAGS:
        p.add_argument(flag, dest=field, type=typ, default=None, help=help_)
    p.set_defaults(func=run_serve)


def config_from_args(args: argparse.Namespace) -> Any:
    """Flags (and the YAML file) -> a validated ``ServeConfig``; a ValueError names the bad field."""
    from pydantic import ValidationError

    from conflux_cluster.config import ServeConfig, format_validation_error

    overrides = {field: getattr(args, field) for _, field, _, _ in _FLAGS if getattr(args, field) is not None}
    try:
        if args.config:
            return ServeConfig.from_yaml(args.config, **overrides)
        return ServeConfig(**overrides)
    except ValidationError as e:
        raise ValueError(f"invalid serve configuration: {format_validation_error(e)}") from None
    except OSError as e:
        raise ValueError(f"cannot read --config {args.config}: {e}") from None


def run_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    import ray
    from ray import serve

    from conflux_cluster.serve.app import run

    config = run(config)
    print(f"ConfluxServe is up: http://{config.host}:{config.port}/v1  (model '{config.model_name}'; "
          f"Ctrl-C stops it)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ray replaces Python's SIGINT handler: install ours
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    finally:
        print("ConfluxServe: shutting down", flush=True)
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":  # pragma: no cover
    from conflux_cluster.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
