"""``python -m benchmarks.gpu_serve --quick --device cpu``: the GPU serving benchmark's every phase, on CPU.

``conflux serve`` (Ray, tiny-llama with random weights, 2 CPU ranks) as a subprocess, the burst,
first/steady request, long prompt and a one-point sweep through the token-accurate client, then
the offline engine with the same config: every figure of the table and the JSON must be there.
The numbers themselves are not judged (a benchmark, not a timed test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_roofline_from_the_model_config():
    """DESIGN §6: 64 x 2K/128 on 2 x H200, Llama-3.1-8B: ≈1.33 s of prefill + ≈0.74 s of decode
    (≈5.8 ms a step) ≈ 2.1 s ≈ 3,900 output tok/s; derived here from the preset's config."""
    from conflux_cluster.bench import roofline as gs
    from conflux_cluster.engine.models.config import PRESETS

    m = PRESETS["llama-3.1-8b"]
    assert gs.param_count(m) == 8_030_261_248  # the published parameter count
    r = gs.roofline_limit(m, 64, 2048, 128, 2, 2, 790e12, 4.3e12)
    assert r["prefill_s"] == pytest.approx(1.38, abs=0.02) and r["decode_s"] == pytest.approx(0.74, abs=0.01)
    assert r["decode_s"] / r["decode_steps"] == pytest.approx(5.8e-3, rel=0.01)
    assert r["output_tok_s"] == pytest.approx(3900, rel=0.02)
    # one rank: prefill twice as long, each step reads the KV of all 64 requests
    one = gs.roofline_limit(m, 64, 2048, 128, 1, 2, 790e12, 4.3e12)
    assert one["prefill_s"] == pytest.approx(2 * r["prefill_s"]) and one["decode_s"] > r["decode_s"]
    tied = PRESETS["tiny-qwen3"]  # tied embeddings count once
    assert gs.param_count(tied) < gs.param_count(tied.model_copy(update={"tie_word_embeddings": False}))


@pytest.mark.slow  # a Ray cluster, a Serve app and an offline XP instance: ~1.5 min on 2 cores
def test_quick_cpu_run_produces_every_figure(tmp_path):
    out = tmp_path / "gpu_serve.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_serve", "--quick", "--device", "cpu", "--rates", "2",
                           "--duration", "3", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    args, served = res["args"], res["served"]
    assert "error" not in served, served.get("error")

    burst = served["burst"]
    n, olen = args["burst"], args["output_len"]
    assert (burst["completed"], burst["failed"]) == (n, 0)
    assert burst["output_lens"] == [olen] * n and burst["total_output_tokens"] == n * olen
    for key in ("output_throughput", "median_ttft_ms", "p99_ttft_ms"):
        assert burst[key] > 0, key
    assert burst["p99_itl_ms"] >= burst["median_itl_ms"] >= 0

    for phase in ("first_request", "steady_request", "long_prompt"):
        assert served[phase]["completed"] and served[phase]["ttft_s"] > 0, (phase, served[phase])
    assert served["long_prompt"]["prompt_tokens"] == served["max_model_len"] - args["long_output"]

    sweep = served["sweep"]
    assert [p["rate"] for p in sweep["points"]] == [2.0]
    assert all(0.0 <= p["slo_attainment"] <= 1.0 and p["completed"] > 0 for p in sweep["points"])
    assert all(p["server_steps"] > 0 and p["server_step_p50_ms"] <= p["server_step_p99_ms"] for p in sweep["points"])
    assert sweep["goodput_req_s"] in (0.0, 2.0)

    roof = res["roofline"]
    assert roof["prefill_s"] > 0 and roof["decode_s"] > 0 and roof["decode_steps"] == olen - 1
    assert res["offline"]["total_output_tokens"] == n * olen and res["offline"]["output_throughput"] > 0
    r = res["ratios"]
    for key in ("measured_over_roofline", "served_over_offline", "first_over_steady_ttft"):
        assert r[key] is not None and r[key] > 0, key

    table = proc.stdout[proc.stdout.index("burst "):]  # the table is printed last
    for row in ("output tok/s", "TTFT p50 / p99", "TBT p50 / p99", "measured / roofline", "served / offline",
                "first-request TTFT", "long prompt", "sweep (rate:attainment)", "goodput"):
        assert row in table, row
