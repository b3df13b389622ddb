"""The instance's throughput line (actors/stats_log.py): figures are differences of the totals over
the interval, and nothing is logged for an idle interval."""

from __future__ import annotations

import logging

from conflux_cluster.actors.stats_log import StatsLine, Totals
from conflux_cluster.engine.contracts.cluster import InstanceLoad


def test_line_reports_interval_differences(caplog, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("conflux_cluster.actors.stats_log.time.monotonic", lambda: clock[0])
    totals = [Totals(output_tokens=500, iterations=10, step_s=0.2, rank_compute_s=0.1, control_s=0.01,
                     rank_wall_s=0.2)]
    load = InstanceLoad(num_waiting=3, num_decoding=64, kv_utilization=0.381)
    line = StatsLine(0, lambda: totals[0], lambda: load)
    clock[0] += 2.0
    assert line.tick() is None  # nothing ran: no line
    totals[0] = Totals(output_tokens=2500, iterations=110, step_s=1.7, rank_compute_s=1.9, control_s=0.05,
                       rank_wall_s=2.2)
    clock[0] += 2.0
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        text = line.tick()
    assert text == ("XP instance 0: 1,000 output tok/s, 64 running, 3 waiting, KV 38.1 %; 100 steps of 15.0 ms, "
                    "ranks busy 90.0 % (control plane 2.0 % of step wall)")
    assert text in caplog.text


def test_line_names_the_step_calibration_when_there_is_one(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("conflux_cluster.actors.stats_log.time.monotonic", lambda: clock[0])
    totals = [Totals()]
    scale = [1.0]
    line = StatsLine(1, lambda: totals[0], lambda: InstanceLoad(), lambda: scale[0])
    for k, want in ((1, None), (2, "; prefill steps at 1.07x their estimate")):
        scale[0] = 1.0 if k == 1 else 1.0712
        totals[0] = Totals(output_tokens=100 * k, iterations=10 * k, step_s=0.1 * k, rank_wall_s=0.1 * k)
        clock[0] += 1.0
        text = line.tick()
        assert text.endswith(want) if want else "estimate" not in text


def test_line_reports_the_intervals_prefix_cache_hit_rate(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("conflux_cluster.actors.stats_log.time.monotonic", lambda: clock[0])
    totals = [Totals(prefix_queries=1000, prefix_hits=900)]
    line = StatsLine(0, lambda: totals[0], lambda: InstanceLoad())
    totals[0] = Totals(output_tokens=10, iterations=5, step_s=0.1, prefix_queries=3000, prefix_hits=1400)
    clock[0] += 1.0
    assert line.tick().endswith("; prefix cache hit rate 25.0 %")  # (1400 - 900) / (3000 - 1000)
    totals[0] = Totals(output_tokens=20, iterations=9, step_s=0.2, prefix_queries=3000, prefix_hits=1400)
    clock[0] += 1.0
    assert "prefix cache" not in line.tick()  # no prefill started in the interval
