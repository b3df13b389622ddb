"""A real Prometheus for the ops tests: generated config, free ports, temp dirs, HTTP API client."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from tests.ops.promql import expand_grafana_vars

PROMETHEUS = shutil.which("prometheus")
REPO = Path(__file__).resolve().parents[2]
SKIP_REASON = "the `prometheus` binary is not installed (apt-get install -y prometheus)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prom:
    """Client of Prometheus' HTTP API (/api/v1/query)."""

    def __init__(self, url: str):
        self.url = url

    def query(self, expr: str) -> dict:
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def scalar(self, expr: str) -> float:
        res = self.query(expr)["result"]
        assert len(res) == 1, f"{expr}: {res}"
        return float(res[0]["value"][1])


@contextlib.contextmanager
def running_prometheus(target_port: int, tmp: Path, probes: list[str],
                       timeout: float = 90) -> Iterator[Prom]:
    """Run ``prometheus`` scraping 127.0.0.1:``target_port`` every second; yield once every
    series in ``probes`` has >= 3 scraped samples (so rate() has data). Stops it on exit."""
    web = free_port()
    (tmp / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: ray\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{target_port}']\n")
    log = tmp / "prometheus.log"
    with log.open("w") as log_f:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{web}",
             "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=log_f)
    try:
        prom = Prom(f"http://127.0.0.1:{web}")
        _wait_for_data(prom, proc, log, probes, timeout)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_for_data(prom: Prom, proc: subprocess.Popen, log: Path, probes: list[str],
                   timeout: float) -> None:
    deadline, missing = time.time() + timeout, probes
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited: {log.read_text()[-2000:]}")
        try:
            missing = [p for p in probes
                       if not prom.query(f"min(count_over_time({p}[1m])) >= 3")["result"]]
            if not missing:
                return
        except OSError as e:  # not listening yet
            missing = [repr(e)]
        time.sleep(0.5)
    pytest.fail(f"no scraped ConfluxServe data within {timeout}s; missing: {missing}")


def dashboard_queries(overrides: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(name, PromQL) of every panel target of dashboards/*.json, Grafana variables expanded to
    their "All" value or to ``overrides[name]``."""
    out = []
    for path in sorted((REPO / "dashboards").glob("*.json")):
        dash = json.loads(path.read_text())
        variables = {v["name"]: v.get("allValue", ".*") for v in dash["templating"]["list"]
                     if v["type"] == "query"}
        variables.update(overrides or {})
        for p in dash["panels"]:
            for t in p.get("targets", []):
                expr = expand_grafana_vars(t["expr"], variables, "30s", "10m")
                out.append((f"{path.stem}/{p['title']}/{t['refId']}", expr))
    return out


def empty_queries(prom: Prom, queries: list[tuple[str, str]]) -> list[str]:
    """Evaluate each query (each must succeed); return the names of those with no series."""
    empty = []
    for name, expr in queries:
        data = prom.query(expr)
        assert data["resultType"] in ("vector", "scalar"), (name, data["resultType"])
        if data["resultType"] == "vector" and not data["result"]:
            empty.append(name)
    return empty
