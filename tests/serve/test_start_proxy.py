"""The HTTP proxy's port (``serve/app.py: start_proxy``). With ``port: 0`` the port is ours to pick, and
another process can take it between the pick and the proxy's bind (it happened in CI): Serve is then
started again on a new port. A port the user named is never swapped for another: taken means an error."""

from __future__ import annotations

import socket

import httpx
import pytest

pytestmark = pytest.mark.slow  # a local Ray + Serve


def test_port_zero_retries_a_taken_port_and_a_named_taken_port_fails(monkeypatch, shared_ray):
    from ray import serve

    from conflux_cluster.config import ServeConfig
    from conflux_cluster.serve import app

    taker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taker.bind(("127.0.0.1", 0))
    taker.listen()
    taken = taker.getsockname()[1]
    picks = iter([taken])  # the first pick is a port someone else took meanwhile; then the OS's choice
    real_pick = app.free_port
    monkeypatch.setattr(app, "free_port", lambda host="127.0.0.1": next(picks, None) or real_pick(host))
    try:
        cfg = app.start_proxy(ServeConfig(model="tiny-llama", port=0))
        assert cfg.port not in (0, taken)
        # Serve's proxy answers on it (503 until an application is deployed)
        assert httpx.get(f"http://127.0.0.1:{cfg.port}/-/healthz", timeout=30).status_code in (200, 503)
        serve.shutdown()
        with pytest.raises(Exception, match="(?i)bind"):
            app.start_proxy(ServeConfig(model="tiny-llama", port=taken))
    finally:
        serve.shutdown()
        taker.close()
