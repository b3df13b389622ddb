"""Entry points that the KubeRay manifests in ``k8s/`` name.

``app_builder`` is the Ray Serve application builder a RayService's ``serveConfigV2`` imports::

    applications:
      - name: conflux
        import_path: conflux_cluster.kuberay:app_builder
        route_prefix: /
        args: {device: cuda, instances: 2, scheduler: {policy: slo, ttft_slo: 1.0}}

Serve calls it on the cluster (inside the Serve controller's build task) with ``args``; they are
``ServeConfig`` fields (unknown fields are rejected with the field's name). ``host``/``port``
are ignored there: under KubeRay, Serve's HTTP proxy listens on port 8000 of every pod
(``http_options`` in ``serveConfigV2``).
"""

from __future__ import annotations

from typing import Any, Mapping


def app_builder(args: Mapping[str, Any] | None):
    """Build the ConfluxServe Serve application (router + one XP instance per node + ingress).

    ``address`` defaults to ``"auto"``, i.e. cluster mode: up to ``instances`` XP instances that
    follow the GPU nodes as they join and leave (``serve/elastic.py``), ``ranks`` GPUs each. Give both
    so the app deploys before any GPU node is up (else they default to what the nodes up now offer).
    Returns a ``ray.serve.Application``.
    """
    from conflux_cluster.config import ServeConfig
    from conflux_cluster.serve.app import build_app, plan_instances

    data = dict(args or {})
    data.setdefault("address", "auto")
    config = ServeConfig.model_validate(data)
    return build_app(config, plan_instances(config))
