"""Assemble and run the Serve application: router + K XP instances + OpenAI ingress.

    HTTP ─▶ ingress (×R replicas) ──route──▶ router (1 replica, holds RouterState)
                 │                               ▲ load reports
                 └──stream──▶ xp-0 … xp-(K-1) ───┘  (each: replica + N rank actors, one PG, one node)

Instance ``i`` is its own deployment (``xp-i``) so the router can address it. Its placement group is
``[replica bundle] + N × [rank bundle]`` with ``STRICT_PACK``: the whole instance on one node.

Locally (no ``address``) each deployment has one replica. In cluster mode (``address``, KubeRay) the
instances are slots that follow the nodes joining and leaving: ``xp-i`` scales between 0 and 1
replica as the cluster has room for more than ``i`` instances (``serve/elastic.py``), so the app
deploys before any GPU worker is up and grows and shrinks with the cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ray
from ray import serve

from conflux_cluster.actors.router_actor import GlobalRouter
from conflux_cluster.actors.xp_deployment import XPInstanceDeployment
from conflux_cluster.config import ServeConfig
from conflux_cluster.engine.config import Device
from conflux_cluster.router.rate_limit import RateLimit

from . import preflight
from .elastic import autoscaling_config, instance_need, node_capacity
from .ingress import OpenAIIngress

REPLICA_CPUS = 0.1  # bundle 0: the instance replica (scheduler loop, no model)
MAX_ONGOING = 100_000  # admission is the router's job (a queue bound per instance), not Serve's
# how often a stopping replica checks that nothing is in flight: Serve's default (2 s) made every stop
# take 2 s with nothing in flight, and a shutdown stops the three deployments one after the other
STOP_POLL_S = 0.2
STALE_AFTER_S = 3.0  # cluster mode: an instance without a load report this long (3 heartbeats) gets no requests


class DeployFailed(RuntimeError):
    """Serve could not start the application; the message holds the replicas' own errors where Serve kept
    them, else where to find them."""


@dataclass(frozen=True)
class InstancePlan:
    """Where one XP instance goes and what it reserves."""

    index: int
    num_ranks: int
    device: Device  # cpu or cuda (never auto: plan_instances resolves it)
    elastic: bool = False  # a cluster-mode slot: 0..1 replica, following the nodes (serve/elastic.py)


def instance_bundles(plan: InstancePlan, cpus_per_rank: float) -> list[dict[str, float]]:
    """Placement-group bundles: the replica, then one per rank (one GPU each on cuda)."""
    rank = plan.device.rank_bundle(cpus_per_rank)
    return [{"CPU": REPLICA_CPUS}] + [dict(rank) for _ in range(plan.num_ranks)]


def plan_instances(config: ServeConfig) -> list[InstancePlan]:
    """Local: ``instances`` (default 1) of ``ranks`` (default 2 CPU). Cluster: ``instances`` slots (default:
    as many as the alive nodes host now, at least 1) of ``ranks`` (default: a GPU node's GPUs; 2 on CPU),
    each following the nodes (``serve/elastic.py``). A cluster without a GPU node yet needs ``ranks``."""
    if config.address is None:
        shape = preflight.local_shape(config) or preflight.local_shape(
            config, cluster_gpus=int(ray.cluster_resources().get("GPU", 0)))
        assert shape is not None  # local mode with the cluster's GPU count
        return [InstancePlan(i, *shape) for i in range(config.instances or 1)]
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    gpu_nodes = [n for n in nodes if n["Resources"].get("GPU", 0) >= 1]
    device = Device.CUDA if config.device is Device.CUDA or (config.device is Device.AUTO and gpu_nodes) else Device.CPU
    ranks = config.ranks
    if ranks is None:
        if not device.has_gpus:
            ranks = preflight.CPU_RANKS
        elif gpu_nodes:
            ranks = int(min(n["Resources"]["GPU"] for n in gpu_nodes))
        else:
            raise ValueError("ranks: no GPU node is up yet to take the ranks per instance from; set ranks "
                             "(GPUs per node) and instances (most nodes) and instances start as nodes join")
    probe = InstancePlan(0, ranks, device, elastic=True)
    slots = config.instances or max(1, node_capacity(nodes, instance_need(instance_bundles(probe, config.cpus_per_rank))))
    return [InstancePlan(i, ranks, device, elastic=True) for i in range(slots)]


def admission_bound(config: ServeConfig) -> int | None:
    """Requests one instance may hold waiting for prefill before the router refuses (None: no bound).

    ``max_queued_requests_per_instance`` when set (0: none); by default the scheduler's
    ``max_num_seqs``: as many requests may wait as may decode at once (one full batch behind the
    running one; fewer decode where KV is the limit), and the excess is told at once to retry (503)."""
    bound = config.max_queued_requests_per_instance
    if bound is None:
        return config.scheduler.max_num_seqs
    return bound or None


def rate_limit(config: ServeConfig) -> RateLimit | None:
    """The per-API-key rate limit (None: none). Burst by default: ten seconds' worth of the rate."""
    rpm = config.rate_limit_requests_per_minute
    if rpm is None:
        return None
    return RateLimit(rpm, config.rate_limit_burst or max(1, math.ceil(rpm / 6)))


def build_app(config: ServeConfig, plans: list[InstancePlan]) -> serve.Application:
    """The bound application graph (call inside a connected Ray driver)."""
    elastic = any(p.elastic for p in plans)
    router = serve.deployment(GlobalRouter, name="router", num_replicas=1,
                              ray_actor_options={"num_cpus": 0}, max_ongoing_requests=MAX_ONGOING,
                              graceful_shutdown_wait_loop_s=STOP_POLL_S,
                              ).bind(len(plans), config.router_policy.value, config.seed,
                                     max_queued_requests=admission_bound(config),
                                     stale_after_s=STALE_AFTER_S if elastic else None,
                                     instance_need=instance_need(instance_bundles(plans[0], config.cpus_per_rank))
                                     if elastic else None,
                                     rate_limit=rate_limit(config), prefix=config.prefix_routing(),
                                     freeze_gc=config.freeze_gc)
    instances = []
    for p in plans:
        bundles = instance_bundles(p, config.cpus_per_rank)
        opts: dict = ({"autoscaling_config": autoscaling_config(p.index)} if p.elastic
                      else {"num_replicas": 1})
        dep = serve.deployment(XPInstanceDeployment, name=f"xp-{p.index}",
                               ray_actor_options={"num_cpus": REPLICA_CPUS},
                               placement_group_bundles=bundles, placement_group_strategy="STRICT_PACK",
                               max_ongoing_requests=MAX_ONGOING, health_check_period_s=5,
                               health_check_timeout_s=120, graceful_shutdown_wait_loop_s=STOP_POLL_S, **opts)
        instances.append(dep.bind(p.index, config, p.num_ranks, p.device, router))
    ingress_cls = serve.ingress()(OpenAIIngress)
    ingress = serve.deployment(ingress_cls, name="ingress", num_replicas=config.ingress_replicas,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=MAX_ONGOING,
                               graceful_shutdown_timeout_s=config.drain_grace_s,  # Serve stops it: in-flight finish
                               graceful_shutdown_wait_loop_s=STOP_POLL_S)
    return ingress.bind(config, router, instances, elastic=elastic)


def local_cpus_needed(config: ServeConfig) -> float:
    """Logical CPUs a local Ray must offer for ``instances`` × (replica + ranks)."""
    ranks = config.ranks or preflight.CPU_RANKS
    return (config.instances or 1) * (REPLICA_CPUS + ranks * config.cpus_per_rank) + 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on ``host`` (bind to 0, read it back, release)."""
    import socket

    with socket.socket(preflight.socket_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_plans(config: ServeConfig, plans: list[InstancePlan]) -> None:
    """Before deploying: the Ray cluster can host the fixed instances at all (else their placement groups
    would wait forever), and each instance shape that was not known before Ray started (CUDA ranks from
    the cluster's GPUs, cluster mode) passes the replica's own checks (``serve/preflight.py``)."""
    preflight.check_room(plans, instance_need(instance_bundles(plans[0], config.cpus_per_rank)), ray.nodes())
    if preflight.local_shape(config) is None:
        for num_ranks, device in sorted({(p.num_ranks, p.device) for p in plans}):
            preflight.check_instance(config, num_ranks, device)


def deploy_failure(app_name: str, error: Exception) -> str:
    """What to tell the user when ``serve.run`` failed: the failed deployments' own errors (from Serve's
    status), else Serve's message and where the replica logs are."""
    try:
        found = preflight.deployment_errors(serve.status(), app_name)
    except Exception:  # noqa: BLE001 - the controller is gone too: say what is known
        found = []
    if found:
        return "deploying failed: " + "; ".join(found)
    return (f"deploying failed ({error}); the replicas' errors are in the Ray logs: logs/serve/ under the Ray "
            "session directory (/tmp/ray/session_latest by default)")


PORT_ATTEMPTS = 5  # port 0: a free port can be taken by another process before the proxy binds it


def start_proxy(config: ServeConfig) -> ServeConfig:
    """Start Serve with one HTTP proxy on the head node: the user's single entry point (and no port clash
    when several "nodes" share one machine, as with ray.cluster_utils.Cluster). With ``port: 0`` the port is
    picked here; if another process takes it before the proxy binds it, Serve is restarted on a new one.
    A port the user named is bound or fails, as asked. Returns the config with the bound port."""
    attempts = PORT_ATTEMPTS if config.port == 0 else 1
    for attempt in range(attempts):
        port = config.port or free_port(config.host)
        try:
            serve.start(http_options={"host": config.host, "port": port}, proxy_location="HeadOnly")
            return config.model_copy(update={"port": port})
        except Exception as e:  # noqa: BLE001 - Serve wraps the proxy's bind error in a RayTaskError
            if attempt + 1 == attempts or "bind" not in str(e).lower():
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


def run(config: ServeConfig, blocking: bool = False) -> ServeConfig:
    """Start (or join) Ray, deploy the app on ``host:port``; returns the config with the real port. A plan
    the cluster cannot host is a ValueError; a failed deployment is ``DeployFailed`` with the replicas'
    errors. (``conflux serve`` runs ``preflight.check_before_ray`` first.)"""
    if not ray.is_initialized():
        if config.address is None:  # one node, every Ray service on 127.0.0.1 (conflux_cluster/local_ray.py)
            import os

            from conflux_cluster.local_ray import start_local_ray

            start_local_ray(max(os.cpu_count() or 1, int(local_cpus_needed(config) + 0.999)))
        else:
            ray.init(address=config.address, log_to_driver=False)
    plans = plan_instances(config)
    check_plans(config, plans)  # ValueError naming the flag
    config = start_proxy(config)
    app = build_app(config, plans)
    try:
        serve.run(app, name=config.app_name, route_prefix="/", blocking=blocking)
    except RuntimeError as e:  # "Deploying application ... failed": a replica's constructor raised
        raise DeployFailed(deploy_failure(config.app_name, e)) from None
    return config
