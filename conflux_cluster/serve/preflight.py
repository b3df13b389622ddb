"""What ``conflux serve`` checks in its driver before deploying: the mistakes a replica would otherwise
meet only after Ray and Serve are up, as a generic "Deploying application failed" minutes later. Each
check raises a ValueError that names the flag (the CLI prints it on one line).

    before Ray          check_http_endpoint   --host resolves; --port is free on it (local mode)
                        check_files           api_keys_file, chat_template, generation_config read
                        check_instance        one instance's engine: its heads over the ranks, the
                                              estimator profile, the KV pool against max_model_len
                                              (local_shape: when the ranks are known without Ray)
    after the plan      check_room            the Ray cluster can host the fixed instances at all
    after a failure     deployment_errors     the replicas' own errors, from Serve's status

No Ray and no weights here: the model's shapes come from its config (``resolve_model``). Files are
checked on the driver's node; in cluster mode a replica reads its own node's copy, so a file must be
on every node anyway.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

from conflux_cluster.engine.config import Device

if TYPE_CHECKING:
    from conflux_cluster.config import ServeConfig
    from conflux_cluster.engine.config import EngineConfig
    from conflux_cluster.engine.models.config import ModelConfig

CPU_RANKS = 2  # ranks per instance on CPU when ``ranks`` is unset


def local_shape(config: ServeConfig, cluster_gpus: int | None = None) -> tuple[int, Device] | None:
    """Local mode: ``(ranks, device)`` of every instance. None in cluster mode, and on CUDA without ``ranks``
    unless ``cluster_gpus`` (the Ray cluster's GPUs: one rank each) is given."""
    if config.address is not None:
        return None
    if config.device is not Device.CUDA:  # 'auto' runs on CPU locally
        return config.ranks or CPU_RANKS, Device.CPU
    if config.ranks is None and cluster_gpus is None:
        return None
    return max(1, config.ranks or cluster_gpus or 0), Device.CUDA


def check_before_ray(config: ServeConfig) -> None:
    """Every check that needs no Ray cluster (run by ``conflux serve`` before it starts or joins one)."""
    check_http_endpoint(config.host, config.port, bind=config.address is None)
    check_files(config)
    shape = local_shape(config)
    if shape is not None:
        check_instance(config, *shape)


# ---- --host / --port ------------------------------------------------------------------------------


def socket_family(host: str) -> socket.AddressFamily:
    """The family Ray Serve's proxy binds ``host`` with: IPv6 for an IPv6 literal, else IPv4."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host.strip("[]")).version == 6 else socket.AF_INET
    except ValueError:  # a host name
        return socket.AF_INET


def check_http_endpoint(host: str, port: int, bind: bool = True) -> None:
    """``host`` resolves; with ``bind`` (the proxy runs on this machine), ``(host, port)`` can be bound now,
    as the proxy will bind it (port 0: only that ``host`` is an address of this machine)."""
    family = socket_family(host)
    try:
        socket.getaddrinfo(host or None, port, family, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r}: cannot be resolved ({getattr(e, 'strerror', None) or e})") from None
    if not bind:
        return
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(_bind_error(host, port, e)) from None


def _bind_error(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"--port {port}: already in use on {host} (choose another port, or --port 0 for a free one)"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host!r}: not an address of this machine ({e.strerror})"
    if e.errno == errno.EACCES:
        return f"--port {port}: permission denied on {host} (ports below 1024 need privileges)"
    return f"--host {host!r} / --port {port}: cannot bind ({e.strerror or e})"


# ---- files the replicas read ------------------------------------------------------------------------


def check_files(config: ServeConfig) -> None:
    """The files the ingress replicas read at start, read here with their own readers (the same error, before
    Ray instead of as a failed deployment): ``api_keys_file`` holds a key, the ``chat_template`` file is text,
    and ``generation_config``'s ``generation_config.json`` is a JSON object."""
    from conflux_cluster.engine.loader import resolve_model

    from .request_params import generation_defaults, read_chat_template

    read_chat_template(config.chat_template)
    if config.generation_config != "vllm":
        generation_defaults(config.generation_config, resolve_model(config.model))
    if config.api_keys_file is None:
        return
    from .ingress import APIKeys

    APIKeys.from_config(config, environ={})


# ---- one instance's engine ---------------------------------------------------------------------------


def check_instance(config: ServeConfig, num_ranks: int, device: Device) -> None:
    """The checks an instance replica makes while it builds its engine, made on the model's config
    (no weights): the engine config of ``num_ranks`` ranks on ``device`` after ``xp_topology``, its
    attention heads split over the ranks (scheduler and ranks), its estimator profile, and (where the
    KV pool is sized from the config) ``max_model_len`` against the pool."""
    from pydantic import ValidationError

    from conflux_cluster.config import engine_config, format_validation_error
    from conflux_cluster.engine.loader import resolve_model
    from conflux_cluster.engine.scheduler.scheduler import load_estimator
    from conflux_cluster.engine.config import xp_topology

    try:
        ecfg = xp_topology(engine_config(config, num_ranks, device))
    except ValidationError as e:
        raise ValueError(f"invalid serve configuration: {format_validation_error(e)}") from None
    mc = resolve_model(config.model).config  # ModelLoadError (a ValueError) names the model
    check_heads(ecfg, mc, num_ranks)
    load_estimator(ecfg.scheduler, ecfg.num_ranks)  # a ValueError names estimator_profile
    # a ValueError names max_model_len: against the model's context, and the KV pool where the config
    # sizes it (None: sized on each GPU after loading the weights)
    ecfg.context_limit(mc, ecfg.blocks_per_rank(mc))


def check_heads(ecfg: EngineConfig, mc: ModelConfig, num_ranks: int) -> None:
    """The split of the model's attention heads that the scheduler (``kv_layout``) and each device
    (``DeviceHeads``) make; ``ecfg`` is after ``xp_topology``."""
    from conflux_cluster.engine.xp.heads import DeviceHeads

    q, kv = mc.num_attention_heads, mc.num_key_value_heads
    try:
        ecfg.kv_layout(mc)
        for t in range(ecfg.tp_size):
            DeviceHeads.build(q, kv, ecfg.num_ranks, ecfg.tp_size, rank=0, tp_rank=t)
    except ValueError as e:
        hint = f"; --ranks must be at most {q}" if num_ranks > q else ""
        raise ValueError(f"--ranks {num_ranks} (xp_mode {ecfg.xp_mode}): model {ecfg.model!r} has {q} attention "
                         f"heads ({kv} KV heads): {e}{hint}") from None


# ---- the Ray cluster ------------------------------------------------------------------------------------


class PlannedInstance(Protocol):
    """What the room check reads of an instance's plan (``serve/app.py``'s ``InstancePlan`` is one)."""

    num_ranks: int
    device: Device  # cpu or cuda
    elastic: bool  # a cluster-mode slot: waits for nodes, not checked


def check_room(plans: Sequence[PlannedInstance], need: Mapping[str, float], nodes: Sequence[Mapping[str, Any]]) -> None:
    """The fixed (local-mode) instances, each taking ``need`` on one node (``STRICT_PACK``), fit the alive
    ``nodes`` (``ray.nodes()``) by their total resources; otherwise their placement groups would never be
    scheduled and the deployment would wait forever. Cluster-mode slots (``elastic``) wait for nodes by
    design and are not checked."""
    from .elastic import node_capacity

    fixed = [p for p in plans if not p.elastic]
    if not fixed or node_capacity(nodes, need) >= len(fixed):
        return
    alive = [n.get("Resources") or {} for n in nodes if n.get("Alive")]
    p, k = fixed[0], len(fixed)
    if "GPU" in need and node_capacity(nodes, {"GPU": need["GPU"]}) < k:  # GPUs are what is short
        gpus = [r.get("GPU", 0.0) for r in alive]
        per_node = f" (per node: {', '.join(f'{g:g}' for g in gpus)})" if len(gpus) > 1 else ""
        raise ValueError(f"--device cuda needs {need['GPU']:g} GPUs per instance on one node (one per rank: "
                         f"--ranks {p.num_ranks}) for {k} instance(s) (--instances); the Ray cluster has "
                         f"{sum(gpus):g} GPUs{per_node}" + ("; use --device cpu" if not sum(gpus) else ""))
    raise ValueError(f"{k} instance(s) (--instances) of {p.num_ranks} {p.device} ranks (--ranks, --cpus-per-rank) "
                     f"need {_fmt(need)} each on one node; the Ray cluster's nodes have "
                     f"{', '.join(_fmt(r, need) for r in alive) or 'nothing'}")


def _fmt(res: Mapping[str, float], keys: Mapping[str, float] | None = None) -> str:
    return " ".join(f"{k}={res.get(k, 0.0):g}" for k in (keys or res))


# ---- after a failed deployment -----------------------------------------------------------------------------

# the line of a Python traceback that states the exception: "ValueError: ...", "pkg.mod.SomeError: ..."
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Z]\w*(?:Error|Exception|Exit)): (\S.*)$")
_RAY_WRAPPERS = ("RayTaskError", "RayActorError", "ActorDiedError", "RayServeException")


def exception_line(text: str) -> str | None:
    """The last ``Type: message`` line of a traceback in ``text`` (Ray's own wrapper lines skipped), or None."""
    found = [m for m in (_EXCEPTION_LINE.match(ln.strip()) for ln in text.splitlines()) if m]
    own = [m for m in found if not m.group(1).startswith(_RAY_WRAPPERS)]
    if not own:
        return None
    return f"{own[-1].group(1)}: {own[-1].group(2)}"


def deployment_errors(status: Any, app_name: str) -> list[str]:
    """``deployment: Type: message`` for each failed deployment of ``app_name`` in ``serve.status()``, from
    the replica's traceback that Serve keeps in the deployment's status message."""
    app = getattr(status, "applications", {}).get(app_name)
    if app is None:
        return []
    out = []
    for name, dep in sorted(app.deployments.items()):
        if str(getattr(dep.status, "value", dep.status)) not in ("DEPLOY_FAILED", "UNHEALTHY"):
            continue
        line = exception_line(dep.message or "")
        if line is not None:
            out.append(f"{name}: {line}")
    return out
