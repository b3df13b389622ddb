"""Start the single-node Ray of the local default with every service on 127.0.0.1 (issue 12, item 6).

Ray 2.60 has no bind-address option: its gRPC servers (GCS, raylet, object manager, core workers)
listen on all interfaces, its agents and metrics exporter on the node's IP, and ``ray.init`` turns
``_node_ip_address="127.0.0.1"`` into the machine's routable address (``resolve_ip_for_localhost``).
What it does have is the single-node switch it uses on Windows and macOS: with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` the node's IP is the loopback address, and then every one of
those servers listens on 127.0.0.1 only (checked by ``tests/serve/test_network_exposure.py``). That is
the local default's situation exactly: one node, nothing joins it. A cluster (``--address``) never
goes through here.

Ray reads the switch when it is imported; a driver that imported Ray before this runs has cached it,
so the cached value is updated too (the one place this package touches a private Ray name). An
explicit ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` in the environment is respected.

Token authentication (Ray's ``RAY_AUTH_MODE=token``) is already what ``ray.init`` does for a new local
cluster in Ray 2.60: it generates ``~/.ray/auth_token`` if there is none.
"""

from __future__ import annotations

import os

SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's switch: "0" = single node, loopback IP


def start_local_ray(num_cpus: int) -> None:
    """``ray.init`` of a new single-node cluster whose services listen on 127.0.0.1 only."""
    os.environ.setdefault(SINGLE_NODE_ENV, "0")  # read by Ray's own processes (raylet, agents, workers)
    import ray
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = os.environ[SINGLE_NODE_ENV].strip().lower() in ("1", "true")
    # address "local": always a new cluster; a bare ray.init() would join one `ray start` left running here
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
