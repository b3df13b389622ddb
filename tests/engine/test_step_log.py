"""Served steps as estimator samples (engine/scheduler/fitting/step_log.py): the engine logs every executed step's shape,
measured and estimated time; `conflux profile --fit-only` and `python -m benchmarks.step_logs estimator` read it."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.scheduler.fitting.samples import Measurements
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.scheduler.estimator import Affine, EstimatorProfile
from conflux_cluster.engine.scheduler.fitting.step_log import instance_path, read_step_log
from conflux_cluster.engine.tokenizer import ByteTokenizer

from .helpers import SlowExecutor, tiny_long_source

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = (7000, 2000, 40)  # 7000 > one 100 ms step (~5000 tokens): chunked
OUTPUTS = 4


def _serve(tmp_path) -> tuple[Path, Path]:
    src = tiny_long_source()
    profile = EstimatorProfile(model="tiny-long", hardware="test", num_ranks=1, num_layers=1,
                               f_gemm=Affine(2e-5, 1e-3), f_prefill_attn=Affine(0.0, 0.0),
                               f_decode_attn=Affine(1e-7, 0.0), f_comm=Affine(0.0, 0.0))
    prof = tmp_path / "p.json"
    profile.to_json(prof)
    log = tmp_path / "logs" / "steps.jsonl"
    cfg = EngineConfig(model="tiny-long", dtype="float32", block_size=16, num_kv_blocks=1024, load_progress=False,
                       async_scheduling=False, step_log=str(log),
                       scheduler=SchedulerConfig(estimator_profile=str(prof), tbt_slo=0.1, ttft_slo=60.0,
                                                 calibrate_steps=False, idle_step_stretch=1.0))  # chunks of τ
    core = EngineCore(cfg, SlowExecutor(LocalExecutor(cfg, src), 0.03), source=src,  # 30 ms over the estimate
                      tokenizer=ByteTokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUTS, ignore_eos=True)
    for i, n in enumerate(PROMPTS):
        core.add_request(GenerateRequest(f"r{i}", [65 + i] * n, params))
    steps = 0
    while core.has_unfinished():
        steps += bool(core.step())
    assert steps > 0
    return log, prof


def test_every_served_step_is_logged_with_its_shape_and_times(tmp_path):
    log, prof = _serve(tmp_path)
    samples = read_step_log(str(log))  # on disk: the engine flushed it when it went idle
    estimates = [json.loads(line)["estimated_s"] for line in log.read_text().splitlines()]
    assert sum(sum(s.load.prefill_tokens) for s in samples) == sum(PROMPTS)  # every prompt token, once
    assert sum(sum(s.load.decode_tokens) for s in samples) == len(PROMPTS) * (OUTPUTS - 1)
    assert all(e is not None and e > 0 for e in estimates)
    assert all(s.seconds >= 0.03 for s in samples)  # each step slept 30 ms
    # the 7000-token prompt's chunks: each starts where the previous ended, the last ends at 7000
    chunks = [(n, h) for s in samples for n, h in s.load.prefill_chunks if n + h > 2000]
    assert len(chunks) >= 2 and chunks[0][1] == 0 and sum(n for n, _ in chunks) == 7000
    assert all(h == sum(n for n, _ in chunks[:i]) for i, (_, h) in enumerate(chunks))

    # the estimator-on-steps benchmark: the estimate is 30 ms short on every step
    out = tmp_path / "e.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step_logs", "estimator", str(log),
                           "--profile", str(prof), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    judged = json.loads(out.read_text())["judged"]
    assert judged["all"]["steps"] == len(samples)
    assert judged["all"]["median_measured_over_estimated"] > 1.2 and judged["all"]["mape_percent"] > 15
    assert {"family: decode", "family: prefill"} <= set(judged)


def test_a_served_log_refits_the_profile(tmp_path):
    """`conflux profile --fit-only` takes the log (with enough decode- and prefill-only steps), alone or
    with a profiler's raw JSON; too few prefill-only steps is a one-line error naming the fix."""
    log, _ = _serve(tmp_path)
    m = Measurements.load(str(log))
    assert len(m.decode) + len(m.prefill) + len(m.hetero) == len(read_step_log(str(log)))
    raw = tmp_path / "raw.json"
    Measurements(m.decode * 3, m.prefill * 3, m.hetero).to_json(raw)  # a stand-in for the profiler's samples
    out = tmp_path / "fit.json"
    cmd = [sys.executable, "-m", "conflux_cluster.cli", "profile", "--model", "tiny-llama", "--num-ranks", "1",
           "--out", str(out), "--fit-only", str(raw), "--fit-only", str(log)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fitted = EstimatorProfile.from_json(out)
    assert fitted.meta["samples"]["decode"] == 4 * len(m.decode) and fitted.f_gemm.intercept > 0
    only_decode = tmp_path / "d.jsonl"
    only_decode.write_text("".join(line + "\n" for line in log.read_text().splitlines()
                                   if '"prefill_chunks": []' in line))
    proc = subprocess.run([*cmd[:-4], "--fit-only", str(only_decode)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "prefill-only" in proc.stderr and "Traceback" not in proc.stderr
    missing = tmp_path / "missing.jsonl"
    proc = subprocess.run([*cmd[:-4], "--fit-only", str(missing)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"--fit-only {missing}: " in proc.stderr and "Traceback" not in proc.stderr


def test_read_step_log_skips_a_torn_last_line_and_names_a_bad_one(tmp_path):
    good = json.dumps({"seconds": 0.01, "estimated_s": None, "prefill_tokens": [5], "decode_tokens": [0],
                       "decode_context": [0], "prefill_chunks": [[5, 0]]})
    p = tmp_path / "s.jsonl"
    p.write_text(good + "\n" + good[:20])
    samples = read_step_log(str(p))
    assert len(samples) == 1 and samples[0].seconds == 0.01
    p.write_text(good + "\n{}\n" + good + "\n")
    with pytest.raises(ValueError, match=r"s.jsonl:2: not a step-log line"):
        read_step_log(str(p))
    assert instance_path("/x/steps.jsonl", 3) == "/x/steps.3.jsonl" and instance_path("/x/steps", 0) == "/x/steps.0.jsonl"


def test_read_step_log_reads_a_gzipped_log_and_names_a_broken_one(tmp_path):
    good = json.dumps({"seconds": 0.02, "estimated_s": None, "prefill_tokens": [0], "decode_tokens": [3],
                       "decode_context": [40], "prefill_chunks": []})
    p = tmp_path / "s.jsonl.gz"
    p.write_bytes(gzip.compress((good + "\n" + good + "\n").encode()))
    assert [s.seconds for s in read_step_log(str(p))] == [0.02, 0.02]
    p.write_bytes(gzip.compress((good + "\n").encode())[:-6])  # truncated: no gzip trailer
    with pytest.raises(ValueError, match=r"s.jsonl.gz: not a readable gzip file"):
        read_step_log(str(p))
    p.write_bytes((good + "\n").encode())  # not gzip at all
    with pytest.raises(ValueError, match=r"s.jsonl.gz: not a readable gzip file"):
        read_step_log(str(p))


def test_step_log_stats_reads_speed_and_spread(tmp_path):
    """`python -m benchmarks.step_logs stats` on a served log: every prompt token in the prefill bands, and the
    decode-only steps grouped by shape."""
    from benchmarks.step_logs import stats as step_log_stats

    log, _ = _serve(tmp_path)
    samples = read_step_log(str(log))
    rate, bands = step_log_stats.prefill_rates(samples)
    assert rate > 0 and sum(tokens for tokens, _, _ in bands.values()) == sum(PROMPTS)
    spread = step_log_stats.decode_spread(samples, context_bin=1 << 20, min_group=1)
    assert sum(n for _, n in spread) == sum(1 for s in samples if not any(s.load.prefill_tokens))
    assert all(cv >= 0 for cv, _ in spread)


def test_step_log_stats_counts_late_decode_steps_by_the_step_after(tmp_path):
    """A decode step held back by the next step's launch is counted under what came after it."""
    from benchmarks.step_logs import stats as step_log_stats

    def step(prefill: int, seconds: float) -> dict:
        return {"seconds": seconds, "estimated_s": 0.01, "prefill_tokens": [prefill], "decode_tokens": [2],
                "decode_context": [100], "prefill_chunks": [[prefill, 0]] if prefill else []}

    steps = [step(0, 0.01), step(0, 0.05), step(500, 0.01), step(0, 0.011), step(0, 0.01), step(300, 0.01)]
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(s) + "\n" for s in steps))
    from conflux_cluster.engine.scheduler.fitting.step_log import read_logged_steps

    late = step_log_stats.late_decode_steps(read_logged_steps(str(log)), factor=3.0)
    assert late["prefill"] == (2, 1, 3.0)  # 5x before the first prefill step, 1x before the second
    assert late["decode"][:2] == (2, 0)
    out = subprocess.run([sys.executable, "-m", "benchmarks.step_logs", "stats", str(log)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "followed by a prefill step: 2, 1 (50 %)" in out, out


def test_step_log_stats_flags_launches_that_waited_on_the_device(tmp_path):
    """Ranks that launch ahead log each step's launch host time; a launch as long as its step could not
    run ahead of the device and is counted by step family."""
    from benchmarks.step_logs import stats as step_log_stats

    def step(prefill: int, seconds: float, launch: float | None) -> dict:
        d = {"seconds": seconds, "estimated_s": seconds, "prefill_tokens": [prefill], "decode_tokens": [2],
             "decode_context": [100], "prefill_chunks": [[prefill, 0]] if prefill else []}
        return d if launch is None else {**d, "launch_s": launch}

    steps = [step(0, 0.008, 0.001), step(0, 0.008, 0.002), step(600, 0.05, 0.045), step(600, 0.05, 0.004),
             step(600, 0.05, 0.04), step(0, 0.01, None)]
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(s) + "\n" for s in steps) + '{"seconds": 0.0')  # a torn last line
    times = step_log_stats.launch_times(step_log_stats.launch_rows(str(log)))
    assert times["decode"] == (2, pytest.approx(0.0015), pytest.approx(0.008), 0)
    assert times["prefill"] == (3, pytest.approx(0.04), pytest.approx(0.05), 2)
    out = subprocess.run([sys.executable, "-m", "benchmarks.step_logs", "stats", str(log)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "prefill steps' launches: 3, median 40.0 ms of a median 50.0 ms step; 2 (67 %)" in out, out
    # the estimator's error apart on the steps whose launch waited (here the logged estimate is the step)
    slow = [dict(step(600, 0.06, 0.05), estimated_s=0.03), dict(step(600, 0.03, 0.005), estimated_s=0.033)]
    log.write_text("".join(json.dumps(s) + "\n" for s in slow))
    mape = step_log_stats.launch_mape(step_log_stats.launch_rows(str(log)))
    assert mape["prefill"] == (pytest.approx(50.0), pytest.approx(10.0))


class _DeviceTimed:
    """``inner`` whose steps report ``device_s`` (as CUDA ranks measure it): each step's step number in ms."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def execute(self, step_input):
        import dataclasses

        result = self.inner.execute(step_input)
        return dataclasses.replace(result, device_s=1e-3 * (1 + step_input.plan.step))


def test_a_step_logs_its_device_time_beside_its_wall_time(tmp_path, monkeypatch):
    """With ``device_s`` (CUDA ranks) the log keeps it beside the wall time, which the scheduler still
    observes and the readers take; `bursty.py report` gives the estimator's MAPE against both."""
    from benchmarks.bursty import step_stats

    src = tiny_long_source()
    log = tmp_path / "steps.jsonl"
    cfg = EngineConfig(model="tiny-long", dtype="float32", block_size=16, num_kv_blocks=256, load_progress=False,
                       async_scheduling=False, step_log=str(log))
    core = EngineCore(cfg, _DeviceTimed(SlowExecutor(LocalExecutor(cfg, src), 0.02)), source=src,
                      tokenizer=ByteTokenizer())
    seen: list[float] = []
    observe = core.scheduler.observe_step
    monkeypatch.setattr(core.scheduler, "observe_step", lambda p, c, s: (seen.append(s), observe(p, c, s)))
    core.add_request(GenerateRequest("r", [65] * 300, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))
    while core.has_unfinished():
        core.step()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert seen and all(s >= 0.02 for s in seen)  # wall times, each holding the executor's 20 ms
    assert all(d["seconds"] >= 0.02 and d["device_s"] < 0.02 for d in lines)
    assert [s.seconds for s in read_step_log(str(log))] == [d["seconds"] for d in lines]
    stats = step_stats(str(log))
    rows = [d for d in lines if d["estimated_s"]]
    for key, mape in (("seconds", "mape_percent"), ("device_s", "device_mape_percent")):
        want = 100 * sum(abs(d["estimated_s"] - d[key]) / d[key] for d in rows) / len(rows)
        assert stats[mape] == pytest.approx(want), key


def test_step_device_time_is_the_slowest_rank_per_iteration_summed():
    from conflux_cluster.engine.contracts.step import StepResult, step_device_s

    def r(d):
        return StepResult(step=0, sampled={}, device_s=d)

    assert step_device_s([[r(0.01), r(0.03)], [r(0.02), r(0.01)]]) == pytest.approx(0.05)
    assert step_device_s([[r(0.01), r(None)], [r(None)]]) == 0.01  # a rank or an iteration without work
    assert step_device_s([[r(None), r(None)]]) is None and step_device_s([]) is None
