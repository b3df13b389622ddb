"""Per-token SLO attainment, percentiles, and workload shaping."""

from __future__ import annotations

import numpy as np
import pytest

from conflux_cluster.sim.metrics import RequestRecord, attainment, summarize
from conflux_cluster.slo import SLO
from conflux_cluster.sim.workloads import (SimRequest, Workload, cap_lengths, gamma_arrivals, load_mooncake,
                                           arrival_seconds, load_trace, scale_to_rate, take, toolagent_like)

S = SLO(ttft_s=1.0, tbt_s=0.1)


def rec(times, n=None, arrival=0.0):
    return RequestRecord("r", arrival, 10, n or len(times), list(times))


def test_every_token_has_its_own_deadline():
    assert rec([0.9, 0.95, 1.2]).meets(S)  # deadlines 1.0, 1.1, 1.2 (boundary counts)
    assert rec([0.2, 0.5]).meets(S)  # a 300 ms gap is fine when earlier tokens banked slack
    assert not rec([0.5, 0.6, 1.25]).meets(S)  # third token 50 ms past 1.2
    assert not rec([1.01]).meets(S)  # TTFT missed
    assert not rec([0.1, 0.2], n=3).meets(S)  # unfinished
    assert rec([10.5, 10.6], arrival=10.0).meets(S)  # deadlines are relative to arrival


def test_late_detects_certain_misses_early():
    r = rec([0.5], n=3)
    assert not r.late(S, now=1.05)  # token 2 due at 1.1
    assert r.late(S, now=1.11)


def test_attainment_and_summary():
    recs = [rec([0.5, 0.6]), rec([1.5, 1.6]), rec([0.2, 0.25]), rec([0.3], n=2)]
    assert attainment(recs, S) == 0.5
    s = summarize(recs, S)
    assert s.finished == 3 and s.ttft["p50"] == pytest.approx(0.4)
    assert s.tbt["mean"] == pytest.approx((0.1 + 0.1 + 0.05) / 3)


def test_scale_to_rate_keeps_the_pattern():
    w = Workload("w", tuple(SimRequest(str(i), t, 5, 5) for i, t in enumerate([0.0, 1.0, 3.0, 4.0])))
    s = scale_to_rate(w, 3.0)  # mean rate was 3/4 req/s → gaps scaled by 1/4
    assert [r.arrival for r in s.requests] == pytest.approx([0.0, 0.25, 0.75, 1.0])
    assert s.mean_rate == pytest.approx(3.0)


def test_cap_lengths_fits_context():
    w = Workload("w", (SimRequest("a", 0, 5000, 3000), SimRequest("b", 0, 100, 10)))
    c = cap_lengths(w, 4096)
    assert [(r.prompt_len, r.output_len) for r in c.requests] == [(2048, 2048), (100, 10)]


def test_load_csv_by_naming_columns(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("t_s,prompt,gen\n2.5,100,7\n1.0,50,3\n")
    w = load_trace(p, "t_s", "prompt", "gen", time_unit=1.0)
    assert [(r.arrival, r.prompt_len, r.output_len) for r in w.requests] == [(0.0, 50, 3), (1.5, 100, 7)]
    with pytest.raises(ValueError, match="columns"):
        load_trace(p, "nope", "prompt", "gen")


def test_arrival_column_accepts_iso_timestamps_and_epochs(tmp_path):
    assert arrival_seconds("2023-11-16 18:15:46.68") == pytest.approx(1700158546.68)  # naive: UTC
    assert arrival_seconds("2023-11-16T18:15:46.68Z") == arrival_seconds("2023-11-16 19:15:46.68+01:00")
    assert arrival_seconds(1700158546680, 1e-3) == pytest.approx(1700158546.68)  # epoch ms
    assert arrival_seconds("1700158546.5", 1.0) == 1700158546.5  # epoch seconds as text (CSV)
    with pytest.raises(ValueError, match="ISO-8601"):
        arrival_seconds("yesterday")
    p = tmp_path / "t.jsonl"
    p.write_text('{"ts": "2023-11-16 18:15:47.18", "i": 5, "o": 2}\n{"ts": "2023-11-16 18:15:46.68", "i": 9, "o": 1}\n')
    w = load_trace(p, "ts", "i", "o")
    assert [(r.arrival, r.prompt_len) for r in w.requests] == [(0.0, 9), (pytest.approx(0.5), 5)]
    p.write_text('{"ts": "soon", "i": 5, "o": 2}\n')
    with pytest.raises(ValueError, match="row 1"):
        load_trace(p, "ts", "i", "o")


@pytest.mark.parametrize("text,message", [
    ('not json\n', "line 1 is not JSON"),
    ('[1, 2]\n', "line 1 is not a JSON object"),
    ('{"ts": 0, "i": 5, "o": 2}\n{"ts": 1, "o": 2}\n', "row 2: no column 'i'"),
    ('{"ts": 0, "i": 5, "o": 2}\n{"ts": 1, "i": Infinity, "o": 2}\n', "row 2"),
    ('{"ts": NaN, "i": 5, "o": 2}\n', "row 1: arrival nan is not finite"),
])
def test_a_bad_trace_line_is_an_error_naming_it(tmp_path, text, message):
    p = tmp_path / "t.jsonl"
    p.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_trace(p, "ts", "i", "o")


def test_mooncake_conversation_matches_its_readme():
    raw = load_mooncake("conversation", spread=False)
    st = raw.stats()
    assert len(raw) == 12031 and st["prompt_p50"] == 6909 and st["output_p50"] == 350
    assert raw.duration == pytest.approx(3536.999)
    assert len(take(raw, 100, offset=50)) == 100
    # quantised timestamps (≈3 s steps) are spread evenly up to the next step, order kept
    w = load_mooncake("conversation")
    t = [r.arrival for r in w.requests]
    assert len(set(t)) == len(t) and t == sorted(t)
    assert [r.request_id for r in w.requests] == [r.request_id for r in raw.requests]
    assert all(0 <= a - b < 3.01 for a, b in zip(t, (r.arrival for r in raw.requests)))


def test_toolagent_like_matches_table3_percentiles():
    w = toolagent_like(20000, seed=3)
    assert "generated" in w.name
    st = w.stats()
    assert st["prompt_p50"] == pytest.approx(6346, rel=0.05) and st["prompt_p95"] == pytest.approx(26114, rel=0.08)
    assert st["output_p50"] == pytest.approx(30, rel=0.08) and st["output_p95"] == pytest.approx(600, rel=0.1)
    assert toolagent_like(50, seed=3).requests == toolagent_like(50, seed=3).requests


def test_gamma_arrivals_rate_and_burstiness():
    rng = np.random.default_rng(0)
    gaps = np.diff(gamma_arrivals(50000, rate=4.0, cv=3.0, rng=rng))
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.1)


def test_sampled_sessions_keep_the_traces_prefix_reuse():
    from conflux_cluster.sim.prefix import reuse_bound
    from conflux_cluster.sim.workloads import make_workload, sample_sessions

    full = load_mooncake("conversation")
    sliced = make_workload("conversation", 200)
    sampled = make_workload("conversation-sessions", 200, seed=3)
    assert len(sampled) == 200 and sampled.requests[0].arrival == 0.0
    arrivals = [r.arrival for r in sampled.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 10 * sliced.requests[-1].arrival  # spans the trace
    # a contiguous slice repeats few prompt blocks; whole sessions keep most of the whole trace's reuse
    whole, contiguous, sessions = reuse_bound(full), reuse_bound(sliced), reuse_bound(sampled)
    assert contiguous < 0.5 * whole < sessions, (contiguous, whole, sessions)
    # every request is the trace's own; the seed picks the sessions
    ids = {r.request_id for r in full.requests}
    assert {r.request_id for r in sampled.requests} <= ids
    again = make_workload("conversation-sessions", 200, seed=3)
    assert again.requests == sampled.requests and make_workload("conversation-sessions", 200, seed=4).requests != sampled.requests
    # requests without hash_ids are sessions of their own; bad arguments are errors
    plain = Workload("w", tuple(SimRequest(str(i), float(i), 10, 2) for i in range(10)))
    assert len(sample_sessions(plain, 4, seed=1)) == 4
    with pytest.raises(ValueError, match="n >= 1"):
        sample_sessions(plain, 0)
    with pytest.raises(ValueError, match="takes no offset"):
        make_workload("conversation-sessions", 10, offset=5)
