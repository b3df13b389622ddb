"""Network exposure of the local default (issue 12, item 6): ``run`` starting its own Ray leaves no
socket of Ray's or ConfluxServe's listening on anything but the loopback address, and Ray's token
authentication is on. Real Ray, real Serve, real HTTP; sockets read from the kernel (psutil)."""

from __future__ import annotations

import ipaddress

import httpx
import psutil
import pytest
import ray
from ray import serve

from conflux_cluster.config import ServeConfig
from conflux_cluster.local_ray import SINGLE_NODE_ENV
from conflux_cluster.serve.app import run

pytestmark = [
    pytest.mark.slow,  # a Serve deployment: ~30 s on 2 shared cores
    pytest.mark.ray_exclusive,  # checks the listeners of the Ray run() starts: fails beside another worker's Ray
]


def _listeners(root: psutil.Process) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP listening socket of ``root`` and its descendants."""
    pids = {p.pid: p for p in [root, *root.children(recursive=True)]}
    out = []
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            out.append((c.laddr.ip, c.laddr.port, pids[c.pid].name()))
    return out


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def _unauthenticated_call(port: int) -> str:
    """Status of a call to the replica server's real method without Ray's token (an empty request)."""
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.unary_unary("/ray.serve.ASGIService/HandleRequest")
        try:
            call(b"", timeout=10)
        except grpc.RpcError as e:
            return e.code().name
    return "OK"


def test_local_default_listens_on_loopback_only_with_token_auth(monkeypatch):
    from ray._private import ray_constants
    from ray._raylet import AuthenticationMode, get_authentication_mode

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv(SINGLE_NODE_ENV, raising=False)  # restored afterwards, as is Ray's cached switch
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", ray_constants.ENABLE_RAY_CLUSTER)
    try:
        cfg = run(ServeConfig(model="tiny-llama", port=0, instances=1, ranks=2, num_kv_blocks=64))
        r = httpx.post(f"http://127.0.0.1:{cfg.port}/v1/completions", timeout=120,
                       json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        found = _listeners(psutil.Process())
        names = {n for _, _, n in found}
        assert {"gcs_server", "raylet"} <= names and len(found) >= 8, found  # Ray's servers were seen
        exposed = [x for x in found if not _loopback(x[0])]
        # Ray Serve 2.60 starts each replica's inter-deployment gRPC server on "[::]:0", hard-coded
        # (ray/serve/_private/replica.py); Ray's token authentication guards it: a call without the
        # token is refused before any method is looked up
        serve_grpc = [x for x in exposed if x[2].startswith("ray::ServeReplica:")]
        assert exposed == serve_grpc and len(serve_grpc) == 3, exposed  # router, ingress, xp-0
        assert get_authentication_mode() == AuthenticationMode.TOKEN
        for _, port, _ in serve_grpc:
            assert _unauthenticated_call(port) == "UNAUTHENTICATED"
        assert cfg.port in {p for ip, p, _ in found if _loopback(ip)}  # the HTTP proxy, on 127.0.0.1
        print(f"\n{len(found)} listening sockets; on loopback: {sorted({n for ip, _, n in found if _loopback(ip)})}; "
              f"all interfaces (token auth): {sorted({n for _, _, n in serve_grpc})}")
    finally:
        serve.shutdown()
        ray.shutdown()
