"""Graceful drain: stop admitting, let the requests in flight finish within a grace period, then stop.

    SIGTERM ─▶ router.drain()          every arrival from now on: 503 server_draining + Retry-After
           ─▶ ingress.begin_drain()    that replica refuses at its gate at once, /health 503
                                       (other ingress replicas see the router's view within 50 ms)
           ─▶ wait until no request is open (instances' streams + the ingress's open requests),
              at most ``drain_grace_s``
           ─▶ serve.shutdown()         (what is still open after the grace ends there)

``conflux serve`` runs it on SIGTERM and SIGINT (a second signal stops at once). On KubeRay the head
pod's ``preStop`` hook runs it as ``python -m conflux_cluster.serve.drain --grace-s 25`` before the
kubelet sends SIGTERM (docs/operations.md, "Graceful drain"). Requests admitted before the drain
are never cut short by it unless the grace runs out.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often the open requests are counted
QUIET_POLLS = 2  # this many counts of zero in a row end the wait (a request between two hops is not lost)


@dataclass(frozen=True)
class DrainResult:
    """How a drain went."""

    grace_s: float  # the longest it could wait
    waited_s: float  # how long it waited for the open requests
    open_at_start: int  # requests open when admission stopped
    open_at_end: int  # requests still open when it stopped waiting (0: every one finished)


class Drainer:
    """Drains one application. Made before the signal: Serve sets a handle up at its first call (seconds in a
    busy driver), which a drain must not wait for between the signal and the first refusal."""

    def __init__(self, app_name: str) -> None:
        from ray import serve

        self.app_name = app_name
        self.router = serve.get_deployment_handle("router", app_name=app_name)
        self.ingress = serve.get_deployment_handle("ingress", app_name=app_name)
        self._instances: dict[int, object] = {}
        self.open_requests()  # the first calls: every handle is set up now

    def _instance(self, i: int):
        from ray import serve

        if i not in self._instances:
            self._instances[i] = serve.get_deployment_handle(f"xp-{i}", app_name=self.app_name)
        return self._instances[i]

    def open_requests(self) -> int:
        """Requests open now: the live instances' open streams plus the answering ingress replica's requests
        not yet handed to an instance (a non-streamed one counts in both until it ends). A stream's last
        events after its instance is done are covered by Serve's graceful stop of the ingress replica
        (``graceful_shutdown_timeout_s``)."""
        live = self.router.live_instances.remote().result(timeout_s=10)
        streams = sum(self._instance(i).num_open_streams.remote().result(timeout_s=10) for i in live)
        return streams + self.ingress.num_open_requests.remote().result(timeout_s=10)

    def drain(self, grace_s: float, stop: threading.Event | None = None, clock=time.monotonic) -> DrainResult:
        """Stop admitting and wait for the open requests, at most ``grace_s`` (or until ``stop`` is set).
        Leaves the application running (the caller stops it)."""
        t0 = clock()
        self.router.drain.remote().result(timeout_s=10)
        self.ingress.begin_drain.remote().result(timeout_s=10)
        first = last = self.open_requests()
        quiet = 0
        while clock() - t0 < grace_s and not (stop is not None and stop.is_set()):
            quiet = quiet + 1 if last == 0 else 0
            if quiet >= QUIET_POLLS:
                break
            time.sleep(POLL_S)
            last = self.open_requests()
        result = DrainResult(grace_s, round(clock() - t0, 3), first, last)
        log.info("drain: %s", result)
        return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="auto", help="Ray cluster to join (default: auto, the local one)")
    p.add_argument("--app-name", default="conflux", help="Serve application name (ServeConfig.app_name)")
    p.add_argument("--grace-s", type=float, default=30.0,
                   help="longest wait for the open requests (keep it below the pod's terminationGracePeriodSeconds)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m conflux_cluster.serve.drain``: drain the application of a running cluster (KubeRay
    preStop hook); prints the ``DrainResult`` as JSON."""
    p = parser()
    a = p.parse_args(argv)
    if a.grace_s < 0:
        p.error("--grace-s must be >= 0")
    import ray

    ray.init(address=a.address, log_to_driver=False, namespace="serve")
    try:
        print(json.dumps(asdict(Drainer(a.app_name).drain(a.grace_s))), flush=True)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
