"""The Grafana dashboards ConfluxServe ships (``*.json`` next to this file, written by ``generate.py``).

Installed as ``conflux_cluster.dashboards`` (package data), so ``conflux dashboards push`` finds them
in a wheel, an editable install and the k8s image alike.
"""

from __future__ import annotations

from pathlib import Path


def dashboard_files() -> list[Path]:
    """The shipped dashboard JSON files, sorted by name."""
    return sorted(Path(__file__).parent.glob("*.json"))
