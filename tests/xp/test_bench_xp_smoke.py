"""The XP GPU benchmark's CPU smoke mode (``python -m benchmarks.steps xp --tiny``: tiny dims, gloo, 2 processes) runs end to end and reports
every figure the docs table quotes (the script itself only runs for real on the GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_xp_gpu_tiny_runs(tmp_path) -> None:
    out = tmp_path / "xp.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.steps", "xp", "--tiny", "--out", str(out), "--repeats", "2",
                        "--region-decodes", "2", "--timeout", "240"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    summary, multi = res["summary"], res["results"]["multi_gpu"]
    for key in ("xp-no-overlap_over_xp_prefill_256", "uniform-sp_over_xp_prefill_256",
                "no-cobatch_over_xp_prefill_256", "uniform-tp_over_xp_prefill_256", "sp2_speedup_over_sp1_32k"):
        assert summary[key] > 0, key
    for mode in ("xp", "xp-no-overlap", "uniform-sp", "no-cobatch", "uniform-tp"):
        assert len(multi[mode]["runs"]) == 2 and all(t > 0 for t in multi[mode]["completion_s"].values())
    region = multi["attention_region"]["2_decodes_per_gpu"]
    assert {"prefill_only", "decode_only", "serialized", "overlapped"} <= set(region)
