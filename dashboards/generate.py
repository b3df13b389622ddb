"""Generate the ConfluxServe Grafana dashboard JSON (``confluxserve_grafana_dashboard.json``).

Run:  .venv/bin/python dashboards/generate.py          # rewrites the JSON next to this file
      .venv/bin/python dashboards/generate.py --check  # exit 1 if the committed JSON is stale

Layout follows Ray's dashboard factory (python/ray/dashboard/modules/metrics/dashboards/): panels
are described by small dataclasses (Panel, Target), laid out on Grafana's 24-column grid, and
every expr gets the global filter ``{F}``. The JSON is in Grafana's current form (``timeseries``
panels, ``datasource: {"type": "prometheus", "uid": "${datasource}"}``, schemaVersion 39) so it
validates strictly against the Grafana dashboard JSON schema; Grafana 9+ imports it as is.

Every metric referenced here must be in ``conflux_cluster.metrics.METRIC_SPECS`` (tests/ops checks).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

UID = "confluxServeDashboard"
TITLE = "ConfluxServe"
OUT = Path(__file__).with_name("confluxserve_grafana_dashboard.json")
# The same JSON as a ConfigMap for the Grafana dashboard sidecar of kube-prometheus-stack
# (it loads every ConfigMap labelled grafana_dashboard: "1"; one ConfigMap per dashboard).
CONFIGMAP = Path(__file__).resolve().parents[1] / "k8s" / "grafana-dashboard-configmap.yaml"
DS = {"type": "prometheus", "uid": "${datasource}"}

# Global label filter applied to every instance-level query ({F} in the exprs below).
F = 'model_name=~"$model_name",xp_instance=~"$xp_instance",ray_io_cluster=~"$Cluster"'
# Router / ingress series carry no model_name (router) or no xp_instance (ingress).
F_ROUTER = 'xp_instance=~"$xp_instance",ray_io_cluster=~"$Cluster"'
F_INGRESS = 'model_name=~"$model_name",ray_io_cluster=~"$Cluster"'
RI = "$__rate_interval"


@dataclass(frozen=True)
class Target:
    expr: str  # PromQL; "{F}", "{FR}", "{FI}" and "{RI}" are substituted
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: str = "timeseries"  # "timeseries" | "stat" | "gauge"
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None


@dataclass
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


def _q(p: float, metric: str, by: str = "") -> str:
    """histogram_quantile over a Ray histogram, optionally kept apart by labels ``by``."""
    grp = f"le,{by}" if by else "le"
    return f"histogram_quantile({p}, sum by ({grp}) (rate({metric}_bucket{{F}}[{{RI}}])))"


def _per_iter(counter: str, by: str = "xp_instance") -> str:
    """Per-iteration mean of an exact counter: rate(counter) / rate(iterations), by ``by``."""
    return (f"sum by ({by}) (rate({counter}{{F}}[{{RI}}])) / on (xp_instance) group_left "
            f"sum by (xp_instance) (rate(ray_conflux_iterations_total{{F}}[{{RI}}]))")


def _latency_panel(title: str, metric: str, desc: str) -> Panel:
    return Panel(title, desc, (
        Target(_q(0.5, metric), "P50"),
        Target(_q(0.9, metric), "P90"),
        Target(_q(0.99, metric), "P99"),
    ), unit="s")


def _ratio(num: str, den: str, window: str = "{RI}") -> str:
    """sum(increase(num)) / sum(increase(den)). A Ray counter has no series until its first
    increment, so a numerator nobody met yet counts as 0 (``or vector(0)``), not "no data"."""
    return (f"(sum(increase({num}{{F}}[{window}])) or vector(0)) / "
            f"sum(increase({den}{{F}}[{window}]))")


def _overview_row() -> Row:
    return Row("Overview", [
        Panel("Request rate", "Finished requests per second (all finish reasons).",
              (Target("sum(rate(ray_vllm_request_success_total{F}[{RI}]))", "req/s"),),
              unit="reqps", kind="stat", width=6, height=5),
        Panel("SLO attainment (range)",
              "Share of finished requests whose every token met arrival + TTFT_SLO + "
              "(i-1)*TBT_SLO over the dashboard time range. Goodput is the largest rate "
              "keeping this >= 95%.",
              (Target(_ratio("ray_conflux_slo_met_total", "ray_conflux_slo_requests_total",
                             "$__range"), "attainment"),),
              unit="percentunit", kind="stat", width=6, height=5, min=0, max=1),
        Panel("Requests running / waiting", "Requests in the XP instances (sum).",
              (Target("sum(ray_vllm_num_requests_running{F})", "running"),
               Target("sum(ray_vllm_num_requests_waiting{F})", "waiting")),
              kind="stat", width=6, height=5),
        Panel("KV cache usage", "Highest KV-block use of any selected instance.",
              (Target("max(ray_vllm_kv_cache_usage_perc{F})", "max KV use"),),
              unit="percentunit", kind="gauge", width=6, height=5, min=0, max=1),
    ])


def _throughput_row() -> Row:
    return Row("Throughput", [
        Panel("Requests by finish reason", "Finished requests per second, by finish reason.",
              (Target("sum by (finished_reason) "
                      "(rate(ray_vllm_request_success_total{F}[{RI}]))", "{{finished_reason}}"),),
              unit="reqps"),
        Panel("Token throughput", "Prompt tokens admitted and output tokens generated per second.",
              (Target("sum(rate(ray_vllm_prompt_tokens_total{F}[{RI}]))", "prompt"),
               Target("sum(rate(ray_vllm_generation_tokens_total{F}[{RI}]))", "generation")),
              unit="short"),
    ])


def _latency_row() -> Row:
    return Row("Latency", [
        _latency_panel("Time to first token", "ray_vllm_time_to_first_token_seconds",
                       "Arrival at the HTTP ingress to the first output token (vLLM's definition)."),
        _latency_panel("Inter-token latency", "ray_vllm_inter_token_latency_seconds",
                       "Gap between consecutive token deltas of a request."),
        _latency_panel("End-to-end latency", "ray_vllm_e2e_request_latency_seconds",
                       "Arrival to the last token."),
        _latency_panel("Time per output token (per request)",
                       "ray_vllm_request_time_per_output_token_seconds",
                       "Per request (last token - first token) / (output tokens - 1)."),
        Panel("Request phases (P90)", "Where a request's time goes (vLLM's phase histograms): queue = arrival "
              "to its first scheduled prefill chunk, prefill = that to the first token, decode = first to last "
              "token, inference = prefill + decode.",
              tuple(Target(_q(0.9, f"ray_vllm_request_{phase}_time_seconds"), phase)
                    for phase in ("queue", "prefill", "decode", "inference")), unit="s", width=24),
    ])


def _slo_row() -> Row:
    return Row("SLO attainment", [
        Panel("SLO attainment", "Share of requests finishing in the interval that met the TTFT "
              "SLO, the TBT deadlines, and both (SLO-compliant).", (
                  Target(_ratio("ray_conflux_slo_met_total", "ray_conflux_slo_requests_total"),
                         "both (compliant)"),
                  Target(_ratio("ray_conflux_slo_ttft_met_total",
                                "ray_conflux_slo_requests_total"), "TTFT met"),
                  Target(_ratio("ray_conflux_slo_tbt_met_total",
                                "ray_conflux_slo_requests_total"), "TBT met"),
              ), unit="percentunit", min=0, max=1),
        Panel("Goodput", "SLO-compliant requests per second vs all judged requests per second.",
              (Target("sum(rate(ray_conflux_slo_met_total{F}[{RI}])) or vector(0)",
                      "SLO-compliant req/s"),
               Target("sum(rate(ray_conflux_slo_requests_total{F}[{RI}]))", "judged req/s")),
              unit="reqps"),
    ])


def _instance_row() -> Row:
    return Row("XP instances", [
        Panel("Running / waiting by instance", "Requests per XP instance.",
              (Target("sum by (xp_instance) (ray_vllm_num_requests_running{F})",
                      "{{xp_instance}} running"),
               Target("sum by (xp_instance) (ray_vllm_num_requests_waiting{F})",
                      "{{xp_instance}} waiting"))),
        Panel("KV cache usage by instance", "Fraction of each instance's KV blocks in use.",
              (Target("max by (xp_instance) (ray_vllm_kv_cache_usage_perc{F})",
                      "{{xp_instance}}"),), unit="percentunit", min=0, max=1),
        Panel("Preemptions by instance", "Requests preempted per second because a rank ran out of "
              "KV blocks (each recomputes its prompt and outputs so far). An instance that never preempted "
              "has no counter series yet (Ray creates it at the first increment): it shows 0.",
              (Target("sum by (xp_instance) (rate(ray_vllm_num_preemptions_total{F}[{RI}])) or "
                      "sum by (xp_instance) (ray_vllm_num_requests_running{F}) * 0",
                      "{{xp_instance}}"),), unit="reqps", min=0),
        Panel("Prefix cache hit rate by instance",
              "Share of looked-up prompt tokens the prefix cache served (vLLM's prefix_cache_hits / "
              "prefix_cache_queries, counted when a prefill starts; enable_prefix_caching).",
              (Target("sum by (xp_instance) (rate(ray_vllm_prefix_cache_hits_total{F}[{RI}])) / "
                      "sum by (xp_instance) (rate(ray_vllm_prefix_cache_queries_total{F}[{RI}]))",
                      "{{xp_instance}}"),), unit="percentunit", min=0, max=1),
        Panel("Iteration time: measured vs estimated",
              "Mean wall time of an XP iteration next to the latency estimator's prediction "
              "(paper Eq. 2-12) for the same iterations (exact, from counters), and the "
              "measured P90.", (
                  Target(_per_iter("ray_conflux_iteration_measured_seconds_total"),
                         "{{xp_instance}} measured"),
                  Target(_per_iter("ray_conflux_iteration_estimated_seconds_total"),
                         "{{xp_instance}} estimated"),
                  Target(_q(0.9, "ray_conflux_iteration_latency_seconds", "xp_instance"),
                         "{{xp_instance}} measured P90"),
              ), unit="s"),
        Panel("Estimator accuracy (measured / estimated)",
              "Distribution of measured/estimated iteration time; 1.0 is a perfect estimate. The "
              "scheduler's calibration (its step budget is the TBT SLO over it) and how often it refitted its "
              "profile on served steps, per instance.",
              (Target(_q(0.1, "ray_conflux_iteration_estimate_ratio"), "P10"),
               Target(_q(0.5, "ray_conflux_iteration_estimate_ratio"), "P50"),
               Target(_q(0.9, "ray_conflux_iteration_estimate_ratio"), "P90"),
               Target("max by (xp_instance) (ray_conflux_step_budget_scale{F})",
                      "{{xp_instance}} step calibration"),
               Target("max by (xp_instance) (ray_conflux_estimator_refits{F})",
                      "{{xp_instance}} profile refits"))),
        Panel("Control-plane share", "Control-plane time (plan broadcast + result gather) as a "
              "share of iteration time (target <= 2%).",
              (Target("sum by (xp_instance) "
                      "(rate(ray_conflux_control_plane_seconds_total{F}[{RI}])) / "
                      "sum by (xp_instance) "
                      "(rate(ray_conflux_iteration_measured_seconds_total{F}[{RI}]))",
                      "{{xp_instance}}"),),
              unit="percentunit", min=0),
        Panel("Tokens per iteration", "Prefill + decode tokens over all ranks per iteration.",
              (Target(_per_iter("ray_conflux_rank_prefill_tokens_total"),
                      "{{xp_instance}} prefill"),
               Target(_per_iter("ray_conflux_rank_decode_tokens_total"),
                      "{{xp_instance}} decode"),
               Target(_q(0.9, "ray_vllm_iteration_tokens_total"), "P90 total (all)"))),
    ])


def _ranks_row() -> Row:
    return Row("Per-rank load", [
        Panel("Prefill tokens per iteration, by rank",
              "Mean prefill tokens the waterfill dispatcher gave each rank per iteration.",
              (Target(_per_iter("ray_conflux_rank_prefill_tokens_total", "xp_instance,rank"),
                      "{{xp_instance}} r{{rank}}"),)),
        Panel("Decode tokens per iteration, by rank",
              "Mean resident decode requests run by each rank per iteration.",
              (Target(_per_iter("ray_conflux_rank_decode_tokens_total", "xp_instance,rank"),
                      "{{xp_instance}} r{{rank}}"),)),
        Panel("Decode context by rank", "Aggregate decode context (tokens) resident per rank.",
              (Target("max by (xp_instance, rank) (ray_conflux_rank_decode_context_tokens{F})",
                      "{{xp_instance}} r{{rank}}"),)),
        Panel("KV cache usage by rank", "Fraction of each rank's KV blocks in use.",
              (Target("max by (xp_instance, rank) (ray_conflux_rank_kv_cache_usage_perc{F})",
                      "{{xp_instance}} r{{rank}}"),), unit="percentunit", min=0, max=1),
    ])


def _router_row() -> Row:
    return Row("Global router", [
        Panel("Router decisions by instance", "Requests per second routed to each XP instance.",
              (Target("sum by (xp_instance) "
                      "(rate(ray_conflux_router_decisions_total{FR}[{RI}]))", "{{xp_instance}}"),),
              unit="reqps"),
        Panel("Router spread (max / mean share)",
              "Busiest instance's routed rate divided by the mean over instances; 1.0 is even.",
              (Target("max(sum by (xp_instance) "
                      "(rate(ray_conflux_router_decisions_total{FR}[{RI}]))) / "
                      "avg(sum by (xp_instance) "
                      "(rate(ray_conflux_router_decisions_total{FR}[{RI}])))", "spread"),)),
        Panel("Normalized queued workload (router view)",
              "Queued work relative to capacity, per instance, as the router last saw it.",
              (Target("max by (xp_instance) (ray_conflux_router_instance_load{FR})",
                      "{{xp_instance}}"),)),
        Panel("Router decision time", "Time to pick an instance (P50, P99).",
              (Target("histogram_quantile(0.5, sum by (le) "
                      "(rate(ray_conflux_router_decision_seconds_bucket{FC}[{RI}])))", "P50"),
               Target("histogram_quantile(0.99, sum by (le) "
                      "(rate(ray_conflux_router_decision_seconds_bucket{FC}[{RI}])))", "P99")),
              unit="s"),
        Panel("Ingress errors by status", "Requests the OpenAI ingress rejected, by HTTP code.",
              (Target("sum by (code) (rate(ray_conflux_request_errors_total{FI}[{RI}]))",
                      "{{code}}"),), unit="reqps"),
    ])


def rows() -> list[Row]:
    """The dashboard content: rows of panels, top to bottom."""
    return [_overview_row(), _throughput_row(), _latency_row(), _slo_row(), _instance_row(), _ranks_row(), _router_row()]


def _render_expr(expr: str) -> str:
    return (expr.replace("{F}", "{" + F + "}").replace("{FR}", "{" + F_ROUTER + "}")
            .replace("{FI}", "{" + F_INGRESS + "}")
            .replace("{FC}", '{ray_io_cluster=~"$Cluster"}').replace("{RI}", RI))


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict:
    defaults: dict = {"unit": p.unit}
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    if p.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                              "showPoints": "never", "spanNulls": True}
        options = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                   "tooltip": {"mode": "multi", "sort": "desc"}}
    else:
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "orientation": "auto"}
    refs = "ABCDEFGH"
    return {
        "type": p.kind, "id": pid, "title": p.title, "description": p.description,
        "datasource": dict(DS), "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options,
        "targets": [{"datasource": dict(DS), "expr": _render_expr(t.expr),
                     "legendFormat": t.legend or "__auto", "refId": refs[i], "range": True,
                     "editorMode": "code"} for i, t in enumerate(p.targets)],
    }


def _query_var(name: str, label: str, query: str, all_value: str) -> dict:
    return {"type": "query", "name": name, "label": label, "datasource": dict(DS),
            "query": query, "definition": query,
            "refresh": 2, "includeAll": True, "allValue": all_value, "multi": True,
            "sort": 1, "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "options": [], "hide": 0}


def _templating() -> dict:
    base = "ray_vllm_num_requests_running"
    return {"list": [
        {"type": "datasource", "name": "datasource", "label": "Data source",
         "query": "prometheus", "current": {"selected": False, "text": "Prometheus",
                                            "value": "Prometheus"},
         "options": [], "hide": 0, "refresh": 1, "includeAll": False, "multi": False},
        _query_var("Cluster", "Cluster", f"label_values({base}, ray_io_cluster)", ".*"),
        _query_var("model_name", "Model",
                   f'label_values({base}{{ray_io_cluster=~"$Cluster"}}, model_name)', ".+"),
        _query_var("xp_instance", "XP instance",
                   f'label_values({base}{{model_name=~"$model_name"}}, xp_instance)', ".+"),
    ]}


def build_dashboard() -> dict:
    """The full dashboard JSON object (deterministic: ids in layout order)."""
    panels: list[dict] = []
    pid, y = 1, 0
    for row in rows():
        panels.append({"type": "row", "id": pid, "title": row.title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y, x, row_h = pid + 1, y + 1, 0, 0
        for p in row.panels:
            if x + p.width > 24:
                x, y, row_h = 0, y + row_h, 0
            panels.append(_panel_json(p, pid, x, y))
            pid, x, row_h = pid + 1, x + p.width, max(row_h, p.height)
        y += row_h
    return {
        "uid": UID, "title": TITLE,
        "description": "ConfluxServe: requests, latency, SLO attainment, XP instances, "
                       "ranks and the global router (metrics from conflux_cluster/metrics.py).",
        "tags": ["confluxserve", "ray", "llm"], "timezone": "browser", "editable": True,
        "graphTooltip": 1, "time": {"from": "now-30m", "to": "now"}, "refresh": "10s",
        "schemaVersion": 39, "version": 1, "fiscalYearStartMonth": 0, "liveNow": False,
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": _templating(), "links": [], "panels": panels,
    }


def render() -> str:
    return json.dumps(build_dashboard(), indent=2) + "\n"


def render_configmap() -> str:
    """``render()`` wrapped in a v1 ConfigMap (YAML) for Grafana's dashboard sidecar."""
    import yaml

    cm = {"apiVersion": "v1", "kind": "ConfigMap",
          "metadata": {"name": "confluxserve-grafana-dashboard",
                       "labels": {"grafana_dashboard": "1",
                                  "app.kubernetes.io/name": "confluxserve"}},
          "data": {OUT.name: render()}}
    class _Dumper(yaml.SafeDumper):  # multi-line strings as literal blocks ("|")
        pass

    def _str(dumper, value):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    _Dumper.add_representer(str, _str)
    head = ("# Generated by dashboards/generate.py from the same source as\n"
            f"# dashboards/{OUT.name}; do not edit.\n")
    return head + yaml.dump(cm, Dumper=_Dumper, sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed JSON is stale")
    args = ap.parse_args(argv)
    outputs = {OUT: render(), CONFIGMAP: render_configmap()}
    if args.check:
        stale = [p for p, text in outputs.items() if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"{p} is stale: run dashboards/generate.py", file=sys.stderr)
        return 1 if stale else 0
    for p, text in outputs.items():
        p.write_text(text)
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
