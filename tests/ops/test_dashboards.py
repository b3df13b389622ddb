"""Offline checks of dashboards/*.json: Grafana schema, Ray conventions, metric names emitted.

The live check (every query evaluated by a real Prometheus) is in test_prometheus.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest

from conflux_cluster.metrics import METRIC_SPECS, RAY_PREFIX, MetricKind, exported_series_names
from tests.ops.promql import metric_names, variable_query_selector

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "dashboards").glob("*.json"))
SCHEMAS = REPO / "tests" / "data" / "ray-dashboards" / "schema"  # copied from the project's shared folder


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows nest their panels
    return out


def _exprs(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in _panels(dash) for t in p.get("targets", [])]
    exprs += [variable_query_selector(v["query"]) for v in dash["templating"]["list"]
              if v["type"] == "query"]
    return exprs


def test_there_is_a_dashboard():
    assert DASHBOARDS, "dashboards/ holds no *.json"


def test_committed_json_matches_generator():
    spec = importlib.util.spec_from_file_location("dash_gen", REPO / "dashboards" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules["dash_gen"] = gen  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(gen)
    finally:
        del sys.modules["dash_gen"]
    assert gen.OUT.read_text() == gen.render(), "run: .venv/bin/python dashboards/generate.py"
    assert gen.CONFIGMAP.read_text() == gen.render_configmap(), "run: dashboards/generate.py"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_validates_against_grafana_schema(path):
    if not SCHEMAS.is_dir():
        pytest.skip(f"Grafana JSON schemas not found at {SCHEMAS}")
    dash = _load(path)
    dash_schema = json.loads((SCHEMAS / "grafana-dashboard.jsonschema.json").read_text())
    errors = sorted(jsonschema.Draft7Validator(dash_schema).iter_errors(dash), key=str)
    assert not errors, "\n".join(f"{e.json_path}: {e.message[:200]}" for e in errors[:10])
    query_schema = json.loads((SCHEMAS / "grafana-prometheus-dataquery.jsonschema.json")
                              .read_text())
    qv = jsonschema.Draft7Validator(query_schema)
    for p in _panels(dash):
        for t in p.get("targets", []):
            errs = list(qv.iter_errors(t))
            assert not errs, f"panel {p['title']!r} target {t.get('refId')}: {errs[0].message}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_ray_conventions(path):
    dash = _load(path)
    assert re.fullmatch(r"[A-Za-z0-9_-]{8,40}", dash.get("uid", "")), "uid must be 8-40 chars"
    ids = [p["id"] for p in _panels(dash)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for p in _panels(dash):
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            used = set(re.findall(r"\$\{?([A-Za-z_]\w*)", t["expr"]))
            unknown = used - set(variables) - {"__rate_interval", "__range", "__interval"}
            assert not unknown, f"{p['title']}: undefined variables {unknown}"
        gp = p["gridPos"]
        assert gp["x"] + gp["w"] <= 24


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_only_metrics_the_code_emits(path):
    emitted = exported_series_names()
    dash = _load(path)
    for expr in _exprs(dash):
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - emitted
        assert not unknown, f"{expr!r} references metrics nobody emits: {unknown}"


def test_dashboard_covers_the_operations_surface():
    """The panels the operations brief asks for are there (by the metric they read)."""
    used = set()
    for path in DASHBOARDS:
        for expr in _exprs(_load(path)):
            used |= metric_names(expr)
    required = {
        "ray_vllm_request_success_total",  # request rate
        "ray_vllm_time_to_first_token_seconds_bucket",
        "ray_vllm_inter_token_latency_seconds_bucket",
        "ray_vllm_e2e_request_latency_seconds_bucket",
        "ray_conflux_slo_met_total", "ray_conflux_slo_requests_total",
        "ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting",
        "ray_vllm_kv_cache_usage_perc",
        "ray_conflux_iteration_measured_seconds_total",
        "ray_conflux_iteration_estimated_seconds_total",
        "ray_conflux_rank_prefill_tokens_total", "ray_conflux_rank_decode_tokens_total",
        "ray_conflux_router_decisions_total",
    }
    assert required <= used, f"missing from dashboards: {sorted(required - used)}"


def test_metric_catalogue_is_well_formed():
    names = [s.name for s in METRIC_SPECS]
    assert len(names) == len(set(names))
    for s in METRIC_SPECS:
        assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", s.name), s.name  # Ray rejects ':' soon
        s.description.encode("ascii")  # Ray's C++ exporter needs ASCII help text
        assert not s.name.startswith(RAY_PREFIX)
        if s.vllm_name is not None:
            assert s.vllm_name.startswith("vllm:")
            assert s.name == re.sub(r"[^a-zA-Z0-9_]", "_", s.vllm_name), s.name
        if s.kind is MetricKind.HISTOGRAM:
            b = list(s.boundaries)
            assert b and all(x > 0 for x in b) and b == sorted(set(b)), s.name
        else:
            assert not s.boundaries
        if s.kind is MetricKind.COUNTER:
            assert not s.name.endswith("_total"), "Ray appends _total to counters"
        assert "instance" not in s.tag_keys, "collides with Prometheus' target label"


def test_operations_doc_describes_every_metric():
    doc = (REPO / "docs" / "operations.md").read_text()
    missing = [s.prometheus_name for s in METRIC_SPECS if f"`{s.prometheus_name}`" not in doc]
    assert not missing, f"docs/operations.md lacks: {missing}"
