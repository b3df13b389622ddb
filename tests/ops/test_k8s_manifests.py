"""Offline validation of k8s/*.yaml against the real KubeRay v1.7.0 CRDs and core k8s schemas.

KubeRay kinds: the CRD's ``v1`` openAPIV3Schema, made strict (``additionalProperties: false`` on
every object schema with ``properties``, as kubectl's strict field validation would be) and with
``required`` satisfied by schema defaults (the API server applies defaults first). Core kinds:
the standalone-strict JSON schemas in k8s-schemas/core. ``NetworkPolicy`` has no standalone schema there:
its rules are checked against the NetworkPolicy rule types the RayCluster CRD embeds (``spec.networkPolicy``:
the same ``networking/v1`` ingress/egress rule, peer and port types), inside a strict envelope written
here (``podSelector``, ``policyTypes``, ``ingress``, ``egress``). The RayService's ``serveConfigV2`` is
parsed and validated with Ray Serve's own ``ServeDeploySchema``, its import path must resolve to
an application builder in this repository, and its ``args`` must be a valid ``ServeConfig``.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import inspect
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "tests" / "data" / "k8s-schemas"  # KubeRay v1.7.0 CRDs + core schemas (see its README)
pytestmark = pytest.mark.skipif(not SCHEMAS.is_dir(), reason=f"no k8s schemas at {SCHEMAS}")

CRDS = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml",
        "RayJob": "ray.io_rayjobs.yaml"}
CORE = {("v1", "ConfigMap"): "configmap-v1.json", ("v1", "Service"): "service-v1.json",
        ("v1", "Secret"): "secret-v1.json", ("apps/v1", "Deployment"): "deployment-apps-v1.json"}
DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted((REPO / "k8s").glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                docs.append((f"{path.name}#{i}", doc))
    return docs


DOCS = _documents()


def _strict(schema):
    """Copy of an OpenAPI schema with additionalProperties: false where fields are listed."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _required_unless_defaulted(validator, required, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    props = schema.get("properties", {})
    for name in required:
        if name not in instance and "default" not in props.get(name, {}):
            yield jsonschema.ValidationError(f"{name!r} is a required property")


_K8sValidator = jsonschema.validators.extend(
    jsonschema.Draft7Validator, {"required": _required_unless_defaulted})


@functools.lru_cache(maxsize=None)
def _crd_validator(kind: str):
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((SCHEMAS / CRDS[kind]).read_text(), Loader=loader)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _K8sValidator(_strict(v1["schema"]["openAPIV3Schema"]))


@functools.lru_cache(maxsize=None)
def _core_validator(api_version: str, kind: str):
    schema = json.loads((SCHEMAS / "core" / CORE[(api_version, kind)]).read_text())
    return jsonschema.Draft7Validator(schema)


@functools.lru_cache(maxsize=None)
def _networkpolicy_validator():
    """``networking.k8s.io/v1 NetworkPolicy``: its rule types taken from the RayCluster CRD (strict)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((SCHEMAS / CRDS["RayCluster"]).read_text(), Loader=loader)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    head = v1["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["networkPolicy"]["properties"]["head"]
    ingress, egress = head["properties"]["ingressRules"], head["properties"]["egressRules"]
    selector = ingress["items"]["properties"]["from"]["items"]["properties"]["podSelector"]
    schema = {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"enum": ["networking.k8s.io/v1"]}, "kind": {"enum": ["NetworkPolicy"]},
        "metadata": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {"type": "object", "required": ["podSelector"], "properties": {
            "podSelector": selector, "ingress": ingress, "egress": egress,
            "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}}}}}}
    return _K8sValidator(_strict(schema))


def _errors(doc: dict) -> list[str]:
    kind, api = doc.get("kind"), doc.get("apiVersion")
    if kind in CRDS:
        assert api == "ray.io/v1", f"{kind} must use ray.io/v1, got {api}"
        v = _crd_validator(kind)
    elif (api, kind) == ("networking.k8s.io/v1", "NetworkPolicy"):
        v = _networkpolicy_validator()
    elif (api, kind) in CORE:
        v = _core_validator(api, kind)
    else:
        pytest.fail(f"no schema here for {api} {kind}: add one or drop the manifest")
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}"
            for e in v.iter_errors(doc)]


def test_manifests_exist():
    kinds = {d["kind"] for _, d in DOCS}
    assert {"RayService", "RayJob", "ConfigMap"} <= kinds, kinds


@pytest.mark.parametrize("name,doc", DOCS, ids=[n for n, _ in DOCS])
def test_manifest_validates(name, doc):
    errors = _errors(doc)
    assert not errors, "\n".join(errors[:10])
    meta = doc["metadata"]
    assert DNS1123.fullmatch(meta["name"]) and len(meta["name"]) <= 63, meta["name"]
    if doc["kind"] == "RayService":
        assert len(meta["name"]) <= 53, "KubeRay appends -serve-svc"


def test_validator_rejects_typos_and_missing_fields():
    """The strict validator is not vacuous: a typo and a missing required field both fail."""
    (svc,) = [d for _, d in DOCS if d["kind"] == "RayService"]
    typo = copy.deepcopy(svc)
    typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplica"] = 1
    assert any("minReplica" in e for e in _errors(typo))
    missing = copy.deepcopy(svc)
    del missing["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert any("template" in e for e in _errors(missing))
    bad_type = copy.deepcopy(svc)
    bad_type["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert _errors(bad_type)


def _rayservices() -> list[dict]:
    return [d for _, d in DOCS if d["kind"] == "RayService"]


def test_rayservice_gpu_workers_one_instance_per_node():
    for svc in _rayservices():
        cluster = svc["spec"]["rayClusterConfig"]
        head = cluster["headGroupSpec"]
        assert head["rayStartParams"].get("dashboard-host") == "0.0.0.0"
        head_ports = {p["name"]: p["containerPort"]
                      for c in head["template"]["spec"]["containers"] for p in c["ports"]}
        assert head_ports.get("dashboard") == 8265 and head_ports.get("serve") == 8000
        assert head_ports.get("metrics") == 8080
        args = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]["args"]
        (gpu_group,) = [g for g in cluster["workerGroupSpecs"] if g["groupName"] == "xp-gpu"]
        (ctr,) = gpu_group["template"]["spec"]["containers"]
        gpus = int(ctr["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus >= 1 and int(gpu_group["rayStartParams"]["num-gpus"]) == gpus
        assert gpu_group["numOfHosts"] == 1  # one pod = one node = one XP instance
        # the app is asked for up to one XP instance per worker pod, on cuda, with the pod's GPUs as ranks
        # (given, so that it deploys before any GPU pod is up)
        assert args["device"] == "cuda" and args.get("instances") == gpu_group["maxReplicas"]
        assert args.get("ranks") == gpus
        for tmpl in (head["template"], gpu_group["template"]):
            ann = tmpl["metadata"]["annotations"]
            assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8080"


def test_serve_config_is_valid_and_importable():
    from ray.serve.schema import ServeDeploySchema

    from conflux_cluster.config import ServeConfig

    for svc in _rayservices():
        cfg = yaml.safe_load(svc["spec"]["serveConfigV2"])
        ServeDeploySchema.model_validate(cfg)  # Ray Serve's own schema for serveConfigV2
        for app in cfg["applications"]:
            module_name, _, attr = app["import_path"].partition(":")
            spec = importlib.util.find_spec(module_name)
            assert spec is not None and spec.origin, f"{module_name} is not importable"
            assert Path(spec.origin).resolve().is_relative_to(REPO), spec.origin
            builder = getattr(importlib.import_module(module_name), attr)
            # Serve calls a builder with exactly one argument (the args dict)
            assert inspect.isfunction(builder)
            assert len(inspect.signature(builder).parameters) == 1
            args = dict(app.get("args") or {})
            args.setdefault("address", "auto")
            ServeConfig.model_validate(args)  # unknown or invalid fields fail here


JOBS = [(n, d) for n, d in DOCS if d["kind"] == "RayJob"]


def test_rayjobs_cover_bench_and_simulate():
    subcommands = {shlex.split(d["spec"]["entrypoint"])[1] for _, d in JOBS}
    assert {"bench", "simulate"} <= subcommands, subcommands
    scripts = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^conflux\s*=\s*"conflux_cluster\.cli:main"', scripts, re.M)


@pytest.mark.parametrize("name,job", JOBS, ids=[n for n, _ in JOBS])
def test_rayjob_entrypoint_parses_with_the_real_cli(name, job):
    """The entrypoint is a valid `conflux` command line for the CLI in this repository."""
    from conflux_cluster.cli import build_parser

    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "conflux" and job["spec"]["shutdownAfterJobFinishes"] is True
    parser = build_parser()
    known = set(parser._subparsers._group_actions[0].choices)  # registered subcommands
    if argv[1] not in known:
        pytest.skip(f"`conflux {argv[1]}` is not implemented in this checkout yet "
                    f"(have: {sorted(known)})")
    args = parser.parse_args(argv[1:])  # argparse exits (SystemExit) on an unknown flag
    assert args.command == argv[1]


def test_grafana_configmap_carries_the_dashboard():
    (cm,) = [d for _, d in DOCS if d["kind"] == "ConfigMap"
             and d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    for fname, text in cm["data"].items():
        assert text == (REPO / "dashboards" / fname).read_text()


def test_named_traces_in_manifests_exist():
    """Every `--trace NAME` a manifest names (comments included: users copy them) is a trace
    `conflux bench` ships, or a path; `rayjob-bench.yaml` once named one that did not exist."""
    from conflux_cluster.commands.bench import TRACES

    named = [m for path in sorted((REPO / "k8s").glob("*.yaml"))
             for m in re.findall(r"--trace\s+([\w./-]+)", path.read_text())]
    assert named, "no manifest mentions --trace"
    for name in named:
        assert name in TRACES or "/" in name, f"--trace {name}: not one of {sorted(TRACES)}"


def test_bench_results_leave_the_pod():
    """The bench job prints its result JSON to the job log (or writes it under a mounted volume):
    a file in the head pod's /tmp is gone when the cluster shuts down after the job."""
    (job,) = [d for _, d in JOBS if shlex.split(d["spec"]["entrypoint"])[1] == "bench"]
    argv = shlex.split(job["spec"]["entrypoint"])
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    mounts = [m["mountPath"] for m in head.get("volumeMounts", [])]
    saved = argv[argv.index("--save-result") + 1] if "--save-result" in argv else None
    assert "--print-json" in argv or (saved and any(saved.startswith(m + "/") for m in mounts)), argv


def test_dockerignore_keeps_vcs_and_environments_out_of_the_image():
    """k8s/Dockerfile copies the build context (`COPY . .`); .dockerignore must keep .git and any
    virtual environment or cache out of it (matched as Docker does: patterns from the context root)."""
    import fnmatch

    assert "COPY --chown=ray:users . ." in (REPO / "k8s" / "Dockerfile").read_text()
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return any(fnmatch.fnmatch(p, pat) or (pat.startswith("**/") and fnmatch.fnmatch(p.rsplit("/", 1)[-1],
                                                                                       pat[3:]))
                   for pat in patterns for p in prefixes)

    for path in (".git/HEAD", ".venv/bin/python", "engine/__pycache__/core.cpython-311.pyc",
                 "conflux_cluster.egg-info/PKG-INFO", "sub/.venv/lib/x.py", "build/lib/a.py"):
        assert ignored(path), f"{path} would be copied into the image"
    for path in ("pyproject.toml", "setup.py", "engine/core.py", "conflux_cluster/data/traces/README.md",
                 "README.md"):
        assert not ignored(path), f"{path} is needed by pip install . and is ignored"


# ---- network exposure (issue 12, item 6) ------------------------------------------------------------


def _policy() -> dict:
    (policy,) = [d for _, d in DOCS if d["kind"] == "NetworkPolicy"]
    return policy


def test_networkpolicy_validator_rejects_typos():
    bad = copy.deepcopy(_policy())
    bad["spec"]["ingress"][0]["form"] = bad["spec"]["ingress"][0].pop("from")
    assert any("form" in e for e in _errors(bad))
    bad = copy.deepcopy(_policy())
    bad["spec"]["ingress"][1]["ports"][0]["port"] = [8000]
    assert _errors(bad)


def test_networkpolicy_covers_every_pod_and_opens_only_api_metrics_and_operator_ports():
    policy, (svc,) = _policy(), _rayservices()
    label = policy["spec"]["podSelector"]["matchLabels"]
    cluster = svc["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for t in templates:  # every Ray pod is selected, so none is left open
        assert label.items() <= t["metadata"]["labels"].items(), t["metadata"]["labels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    open_ports: dict[int, list] = {}
    for rule in policy["spec"]["ingress"]:
        peers = rule["from"]
        if "ports" not in rule:  # all ports: only from the cluster's own pods
            assert peers == [{"podSelector": {"matchLabels": label}}], rule
            continue
        for p in rule["ports"]:
            open_ports.setdefault(p["port"], []).extend(peers)
    assert set(open_ports) == {8000, 8080, 8265, 52365}, open_ports  # never 6379 (GCS) or 10001 (client)
    metrics_peers = open_ports[8080]
    assert metrics_peers == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    for port in (8265, 52365):  # the dashboard: only the KubeRay operator's pods
        assert all("podSelector" in peer and "namespaceSelector" in peer for peer in open_ports[port])


def test_rayservice_uses_ray_token_auth_and_metrics_port_matches_the_policy():
    (svc,) = _rayservices()
    cluster = svc["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}
    assert cluster["headGroupSpec"]["rayStartParams"]["metrics-export-port"] == "8080"


def test_head_prestop_drains_within_the_pod_grace_period_with_the_apps_grace():
    """The head pod's preStop runs the drain (serve/drain.py, its own argument parser) with the app's
    drain_grace_s, below terminationGracePeriodSeconds; the old cluster outlives the drain on an upgrade."""
    from conflux_cluster.serve import drain

    for svc in _rayservices():
        head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
        (ctr,) = [c for c in head["containers"] if c["name"] == "ray-head"]
        cmd = ctr["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[:3] == ["python", "-m", drain.__name__]
        parsed = drain.parser().parse_args(cmd[3:])
        args = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]["args"]
        assert parsed.grace_s == args["drain_grace_s"] < head["terminationGracePeriodSeconds"]
        assert svc["spec"]["rayClusterDeletionDelaySeconds"] > parsed.grace_s
