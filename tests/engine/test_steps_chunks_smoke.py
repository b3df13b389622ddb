"""``python -m benchmarks.steps chunks`` on a CPU (tiny-llama, tiny sizes): every family of points runs
and reports its figures, among them a decode-only step followed by a mixed or prefill-only step launched
ahead of the decode step's read and after it (the served held-back decode steps; the GPU run decides)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_chunks_cpu_smoke_reports_steps_after_a_decode_step(tmp_path) -> None:
    out = tmp_path / "chunks.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.steps", "chunks", "--model", "tiny-llama", "--device", "cpu",
                        "--budget", "64", "--splits", "1,2", "--histories", "0", "--decode-batches", "1,3",
                        "--decode-context", "64", "--repeats", "2", "--decode-iters", "2", "--after-decode", "32",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(p["chunks"], p["history"]) for p in res["chunks"]] == [(1, 0), (2, 0)]
    assert [p["batch"] for p in res["decode"]] == [1, 3]
    after = res["after_decode"]
    assert {(p["batch"], p["second"], p["ahead"]) for p in after} == {
        (b, s, a) for b in (1, 3) for s in ("mixed", "prefill") for a in (False, True)}
    for p in after:
        assert p["prompt_tokens"] == 32
        assert 0 < p["launch_ms"] <= p["pair_ms"] and 0 < p["decode_read_ms"] <= p["pair_ms"], p
        if not p["ahead"]:  # read before the second step is launched
            assert p["decode_read_ms"] + p["launch_ms"] <= p["pair_ms"], p
