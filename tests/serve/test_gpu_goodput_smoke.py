"""``python -m benchmarks.gpu_goodput --quick --device cpu --systems conflux``: a real ``conflux serve``
subprocess, the generated toolagent-like workload through the token-accurate client, the simulator on
the same arrivals, and the report. The numbers themselves are not judged (a benchmark, not a timed
test). One system: a baseline's server is the same subprocess with other flags (their flags:
tests/serve/test_serve_preflight.py; the baselines on Ray rank actors: tests/serve/test_ray_modes.py;
the ratio table with baselines: tests/serve/test_goodput_compare.py), and a second server start cost
the CI budget about 30 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = [sys.executable, "-m", "benchmarks.gpu_goodput"]


@pytest.mark.slow  # a Ray cluster and a Serve app: ~35 s on the shared 2 cores
def test_quick_cpu_run_reports_real_and_simulated_goodput(tmp_path):
    out = tmp_path / "gpu_goodput.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"PYTHONPATH": str(ROOT)}
    # a goodput search of one point (1 req/s); tests/serve/test_goodput_compare.py covers the search
    proc = subprocess.run([*SCRIPT, "--quick", "--device", "cpu", "--out", str(out), "--systems", "conflux",
                           "--search-start", "1", "--rates", "1,2", "--max-points", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert list(doc["systems"]) == ["conflux"]
    n = doc["args"]["num_requests"]
    r = doc["systems"]["conflux"]
    assert "error" not in r, r.get("error")
    assert r["server_args"][:2] == ["--xp-mode", "xp"] and r["limits"]["max_num_seqs"] >= 1
    w = r["workloads"]["toolagent"]
    assert w["workload"] == "toolagent-like (generated)"
    real, sim = w["real"][0], w["sim"][0]
    assert real["rate"] == sim["rate"] == 1.0
    assert [p["rate"] for p in w["real"]] == [1.0] == [p["rate"] for p in w["sim"]]
    assert real["completed"] == n and real["failed"] == 0 and sim["completed"] == n
    assert real["step_scale"] == [1.0]  # read from the server; CPU runs the built-in budget: never calibrated
    # the server's side of the point: its steps and token gaps between two stats snapshots
    assert real["server_steps"] > 0 and 0 < real["server_step_p50_ms"] <= real["server_step_p99_ms"]
    assert real["server_itl_p50_ms"] <= real["server_itl_p99_ms"]
    assert len(real["misses"]) == round((1 - real["attainment"]) * n)
    # the server logged its steps next to the results
    from conflux_cluster.engine.scheduler.fitting.step_log import instance_path, read_step_log
    assert r["step_log"].endswith("steps-conflux.jsonl")
    assert read_step_log(instance_path(r["step_log"], 0))
    assert 0 < real["ttft_p50"] <= real["ttft_p99"] and 0 <= real["tbt_p50"] <= real["tbt_p99"]
    assert w["goodput_real"] in (0.0, 1.0, 2.0) and w["goodput_sim"] in (0.0, 1.0, 2.0)
    assert set(w["latency_error_at_reference"]) >= {"ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99"}
    ratio = doc["ratios"]["toolagent"]["goodput_real"]
    assert ratio["best_baseline"] is None and ratio["ratio"] is None  # no baseline ran
    assert "conflux ÷ best baseline" in proc.stdout and "goodput real/sim" in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--rates", "0,1"], "--rates must be > 0"),
    (["--rates", "0.5,2", "--search-start", "4"], "--search-start 4 must lie within --rates' bounds [0.5, 2]"),
    (["--rates", "1", "--search-start", "1", "--max-points", "0"], "--max-points must be >= 1"),
    (["--workloads", "synthetic:half"], "the prompt scale after ':' must be a number"),
    (["--workloads", "synthetic:0"], "the prompt scale must be > 0"),
    (["--workloads", "sharegpt:0.5"], "unknown workloads ['sharegpt:0.5']"),
])
def test_bad_rate_flags_are_one_line_errors(flags, message, tmp_path):
    proc = subprocess.run([*SCRIPT, "--device", "cpu", "--out", str(tmp_path / "x.json"), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "x.json").exists()
