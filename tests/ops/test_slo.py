"""The shared per-token SLO check (conflux_cluster.slo) and its three callers: Prometheus
``judge_slo``, the simulator's ``RequestRecord.meets`` and the benchmark's
``meets_token_deadlines``, each with its own edge semantics on top of the shared check."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conflux_cluster.bench.client import RequestResult
from conflux_cluster.bench.report import meets_token_deadlines
from conflux_cluster.metrics import judge_slo
from conflux_cluster.slo import SLO, SLOJudgement, token_deadline, token_deadlines_met
from conflux_cluster.sim.metrics import RequestRecord

# Binary-exact values, so "exactly on the deadline" is exact in floating point.
ARR, TTFT, TBT = 8.0, 1.0, 0.25


def _v(times, eps=0.0):
    j = token_deadlines_met(ARR, [ARR + t for t in times], TTFT, TBT, eps)
    return (j.ttft_met, j.tbt_met, j.met)


def test_deadline_formula():
    assert token_deadline(ARR, 1, TTFT, TBT) == ARR + TTFT
    assert token_deadline(ARR, 5, TTFT, TBT) == ARR + TTFT + 4 * TBT
    with pytest.raises(ValueError, match="1-based"):
        token_deadline(ARR, 0, TTFT, TBT)


def test_exactly_on_every_deadline_meets():
    assert _v([1.0, 1.25, 1.5, 1.75]) == (True, True, True)


def test_one_token():
    assert _v([1.0]) == (True, True, True)  # on time; TBT vacuously met
    assert _v([1.0 + 2 ** -20]) == (False, True, False)  # just late: only TTFT missed


def test_empty_meets_neither():
    assert token_deadlines_met(ARR, [], TTFT, TBT) == SLOJudgement(False, False, False)


def test_cumulative_deadlines_and_late_tokens():
    assert _v([0.0, 1.2]) == (True, True, True)  # 1.2 s gap, but before token 2's 1.25 deadline
    assert _v([0.5, 0.75, 1.5 + 2 ** -20]) == (True, False, False)  # token 3 just past 1.5
    assert _v([1.5, 1.5]) == (False, False, False)  # a late first token drags token 2 along


def test_eps_tolerates_noise_only():
    late_by = 1e-10
    assert _v([1.0, 1.25 + late_by]) == (True, False, False)
    assert _v([1.0, 1.25 + late_by], eps=1e-9) == (True, True, True)
    assert _v([1.0, 1.25 + 1e-8], eps=1e-9) == (True, False, False)
    with pytest.raises(ValueError, match="eps"):
        token_deadlines_met(ARR, [ARR], TTFT, TBT, eps=-1e-9)


# --------------------------------------------------------------------- the three callers agree
_gaps = st.lists(st.floats(0.0, 0.6, allow_nan=False), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(first=st.floats(0.0, 1.5, allow_nan=False), gaps=_gaps)
def test_callers_use_the_shared_check(first, gaps):
    times = [ARR + first]
    for g in gaps[1:]:
        times.append(times[-1] + g)
    shared = token_deadlines_met(ARR, times, TTFT, TBT)
    # Prometheus: exact check, the same judgement.
    assert judge_slo(ARR, times, SLO(TTFT, TBT)) == shared
    # Simulator: a finished record with eps=0 is the shared verdict.
    rec = RequestRecord("r", ARR, 10, len(times), list(times))
    assert rec.meets(SLO(TTFT, TBT), eps=0.0) == shared.met
    # Benchmark: one chunk per token is the shared verdict.
    res = RequestResult(10, len(times), arrival_s=ARR, chunk_times=list(times),
                        output_tokens=len(times), end_s=times[-1])
    assert meets_token_deadlines(res, TTFT, TBT) == shared.met


def test_caller_edges_stay_in_the_callers():
    # Simulator: all tokens on time but one still missing -> not compliant; eps default 1e-9.
    assert not RequestRecord("r", 0.0, 10, 3, [0.5, 0.6]).meets(SLO(TTFT, TBT))
    assert RequestRecord("r", 0.0, 10, 2, [1.0, 1.25 + 1e-10]).meets(SLO(TTFT, TBT))
    # Benchmark: a final chunk carrying 3 tokens counts its time for tokens 2..4 (deadlines
    # 1.25, 1.5, 1.75 after arrival): at 1.5 token 2 is late, at 1.25 all are on time.
    late = RequestResult(10, 4, arrival_s=0.0, chunk_times=[0.5, 1.5], output_tokens=4, end_s=1.5)
    ok = RequestResult(10, 4, arrival_s=0.0, chunk_times=[0.5, 1.25], output_tokens=4, end_s=1.25)
    assert not meets_token_deadlines(late, TTFT, TBT)
    assert meets_token_deadlines(ok, TTFT, TBT)
    # ... and a request that never got a chunk does not meet it (no IndexError).
    assert not meets_token_deadlines(RequestResult(10, 4, output_tokens=4), TTFT, TBT)
    # Prometheus: no token -> neither part met.
    assert judge_slo(0.0, [], SLO(TTFT, TBT)) == SLOJudgement(False, False, False)


def test_shared_module_needs_neither_ray_nor_torch():
    code = ("import sys, conflux_cluster.slo, conflux_cluster.sim.metrics, "
            "conflux_cluster.bench.report, conflux_cluster.metrics; "
            "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_next_token_overdue_is_the_one_rule_for_a_certain_miss():
    from conflux_cluster.slo import next_token_overdue

    # token 3 of 5 is due at 1 + 1.0 + 2 * 0.1 = 2.2
    assert not next_token_overdue(1.0, 2, 5, 2.2, 1.0, 0.1) and next_token_overdue(1.0, 2, 5, 2.21, 1.0, 0.1)
    assert not next_token_overdue(1.0, 5, 5, 99.0, 1.0, 0.1)  # nothing left to come
    assert not next_token_overdue(1.0, 2, 5, 2.21, 1.0, 0.1, eps=0.05)
    rec, res = RequestRecord("r", 1.0, 8, 5, token_times=[1.5, 1.6]), RequestResult(8, 5, arrival_s=1.0,
                                                                                   chunk_times=[1.5, 1.6])
    for now in (2.2, 2.21):  # the simulator and the HTTP benchmark agree
        assert rec.late(SLO(1.0, 0.1), now, eps=0.0) == res.late(now, 1.0, 0.1) == (now > 2.2)
