"""One Ray cluster shared by the test modules that only need *a* Ray (fixture ``shared_ray``).

Starting Ray costs ~5 s and stopping it ~2 s on the 2-core CI machine, paid once per module (or per
test) when each started its own. A module that only deploys Serve apps and calls actors asks for
``shared_ray`` instead: the cluster is started on first use and kept for the next module; at the end
of the module Serve is shut down (its apps, controller and HTTP proxy), so no app of one module meets
the next, and the next module's proxy binds a port picked afresh.

Modules that need a Ray of their own keep starting it themselves and shutting down whatever Ray runs
first, the shared one included (the next module asking for ``shared_ray`` then starts it again): a
multi-node ``ray.cluster_utils.Cluster``, a metrics-export port for Prometheus, replicas that must
inherit an environment variable from the raylet, ``run()`` starting its own local Ray (the network
exposure check, the faults benchmark), ``conflux serve`` as a subprocess.

scripts/test.sh runs the suite on two pytest-xdist workers, each with its own shared cluster. The few
modules whose Ray must be the only one on the machine are marked ``ray_exclusive`` and run afterwards,
alone (a metrics-export port scraped by Prometheus, a multi-node ``Cluster``, the network exposure check).
"""

from __future__ import annotations

from typing import Iterator

import pytest

SHARED_RAY_CPUS = 8  # logical CPUs: fits the largest app here (2 instances x 2 ranks, 2 ingress, router)


class SharedRay:
    """The session's shared cluster: started when a module first needs it, again if a module with a Ray
    of its own stopped it."""

    def __init__(self) -> None:
        self.gcs_address: str | None = None  # the shared cluster's GCS, None before it first starts

    def _is_running(self) -> bool:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().gcs_address == self.gcs_address

    def ensure(self) -> None:
        import ray

        if self._is_running():
            return
        if ray.is_initialized():  # another module's Ray must not leak into this one
            ray.shutdown()
        for attempt in range(2):
            try:
                ray.init(address="local", num_cpus=SHARED_RAY_CPUS, include_dashboard=False, log_to_driver=False)
                break
            except Exception:  # noqa: BLE001 - Ray waits a fixed 30 s for its raylet to register, which
                if attempt:  # the other worker's load on two cores can exceed: one more start
                    raise
                ray.shutdown()
        self.gcs_address = ray.get_runtime_context().gcs_address

    def stop(self) -> None:
        import ray

        if self._is_running():
            ray.shutdown()


@pytest.fixture(scope="session")
def _shared_ray_session() -> Iterator[SharedRay]:
    shared = SharedRay()
    yield shared
    shared.stop()


@pytest.fixture(scope="module")
def shared_ray(_shared_ray_session: SharedRay) -> Iterator[None]:
    """The shared Ray cluster for this module; Serve is shut down when the module ends."""
    from ray import serve

    _shared_ray_session.ensure()
    yield
    serve.shutdown()
