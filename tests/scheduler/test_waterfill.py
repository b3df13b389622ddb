"""Waterfill pour and dispatch (Alg. 2): TBT-safe, balanced, maximal."""

from __future__ import annotations

import math

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from conflux_cluster.engine.scheduler.dispatch import StepState, WaterfillDispatcher
from conflux_cluster.engine.scheduler.estimator import Affine, BatchLoad, EstimatorProfile, LatencyEstimator
from conflux_cluster.engine.scheduler.roofline import roofline_profile
from conflux_cluster.engine.scheduler.waterfill import capacity, min_level, pour

loads_st = st.lists(st.integers(0, 3000), min_size=1, max_size=8)


@given(loads_st, st.integers(0, 4000), st.data())
def test_pour_sums_caps_and_levels(loads, n_target, data):
    cap = capacity(loads, n_target)
    amount = data.draw(st.integers(0, cap))
    give = pour(loads, amount, n_target)
    assert sum(give) == amount and min(give) >= 0
    after = [x + g for x, g in zip(loads, give)]
    for x, g, a in zip(loads, give, after):
        assert g == 0 or a <= n_target  # never lifted above the target
    if amount:
        # water level: every rank that got tokens is within one token of the lowest filled level,
        # and no rank left below that level received nothing while being lower.
        filled = [a for a, g in zip(after, give) if g]
        level = max(filled)
        assert level - min(filled) <= 1
        assert all(a >= level - 1 for a, x in zip(after, loads) if x < level - 1)
        # minimax: no assignment of `amount` tokens has a lower highest-receiving level
        assert level == min_level(loads, amount)


@given(loads_st, st.integers(1, 5000))
def test_min_level_is_minimal(loads, amount):
    lv = min_level(loads, amount)
    assert capacity(loads, lv) >= amount
    assert capacity(loads, lv - 1) < amount


def random_profile(draw, n):
    f = lambda hi_s, hi_i: Affine(draw(st.floats(0, hi_s)), draw(st.floats(0, hi_i)))  # noqa: E731
    return EstimatorProfile(model="m", hardware="h", num_ranks=n, num_layers=draw(st.integers(1, 40)),
                            f_gemm=f(2e-6, 1e-4), f_prefill_attn=f(1e-10, 1e-5), f_decode_attn=f(1e-8, 1e-5),
                            f_comm=f(1e-7, 1e-4), alpha=draw(st.floats(1, 2)), beta=draw(st.floats(1, 2)),
                            f_prefill_kv=Affine(draw(st.floats(0, 1e-8)), 0.0), cobatch=draw(st.floats(0, 1e-4)),
                            query_tile=draw(st.sampled_from([1, 128])))


@st.composite
def dispatch_case(draw):
    n = draw(st.integers(1, 8))
    prof = random_profile(draw, n)
    decodes = [draw(st.integers(0, 64)) for _ in range(n)]
    ctx = [d * draw(st.integers(1, 8000)) for d in decodes]
    prior = draw(st.lists(st.tuples(st.integers(1, 2000), st.integers(0, 8000)), max_size=3))
    return prof, decodes, ctx, prior, draw(st.integers(1, 20000)), draw(st.integers(0, 30000)), \
        draw(st.sampled_from([1, 16, 64])), draw(st.floats(0.005, 0.2))


def _state(est, decodes, ctx, prior, disp):
    s = StepState.from_decodes(list(decodes), est.decode_time(ctx, decodes))
    for chunk, c in prior:  # earlier requests of the same step, dispatched for real
        ell, give = disp.dispatch(s, chunk, c)
        if ell:
            s.commit(give, ell, c, disp.tile)
    return s


@settings(max_examples=300, deadline=None)
@given(dispatch_case())
def test_dispatch_is_tbt_safe_balanced_and_maximal(case):
    prof, decodes, ctx, prior, m, c, q, tau = case
    est = LatencyEstimator(prof)
    disp = WaterfillDispatcher(est, tau, q, max_level=16384)
    s = _state(est, decodes, ctx, prior, disp)
    # the dispatcher's inlined probe is the estimator's model
    level = max(s.combined) + q
    added, t = disp._fill_time(s, level, c)
    fill = tuple(p + max(0, level - x) for p, x in zip(s.prefill, s.combined))
    probe_load = BatchLoad(fill, tuple(decodes), tuple(ctx), tuple(s.chunks) + ((added, c),))
    assert t == pytest.approx(est.estimate(probe_load).total, rel=1e-9, abs=1e-15)
    ell, give = disp.dispatch(s, m, c)
    assert 0 <= ell <= m and sum(give) == ell and min(give) >= 0
    if ell == 0:
        # not even one quantum above the lowest rank is safe (or nothing fits under max_level)
        k = min(s.combined) // q + 1
        if k * q <= 16384:
            assert disp._fill_time(s, k * q, c)[1] > tau * (1 + 1e-9) or capacity(s.combined, k * q) == 0
        return
    load = BatchLoad(tuple(p + g for p, g in zip(s.prefill, give)), tuple(decodes), tuple(ctx),
                     tuple(s.chunks) + ((ell, c),))
    assert est.estimate(load).total <= tau * (1 + 1e-9)
    # largest combined per-rank load <= that of an even split of the same prefill tokens
    total_prefill = sum(s.prefill) + ell
    even = max(d + total_prefill / len(decodes) for d in decodes)
    assert max(x + g for x, g in zip(s.combined, give)) <= math.ceil(even)
    # maximal: the next aligned level would break the TBT budget (unless the whole prompt fit)
    if ell < m:
        level = max(x + g for x, g in zip(s.combined, give))
        nxt = (level // q + 1) * q
        if nxt <= 16384:
            added, t = disp._fill_time(s, nxt, c)
            assert t > tau * (1 + 1e-9) or added >= m


def test_waterfill_unloads_decode_heavy_rank():
    """Paper Fig. 15(a): one rank with 128 decodes, three idle; waterfill gives it the least."""
    prof = roofline_profile("llama-3.1-8b", "h100", 4)
    est = LatencyEstimator(prof)
    disp = WaterfillDispatcher(est, 0.05, 16, 16384)
    decodes, ctx = [128, 0, 0, 0], [128 * 2048, 0, 0, 0]
    s = StepState.from_decodes(decodes, est.decode_time(ctx, decodes))
    ell, give = disp.dispatch(s, 1024, 0)
    assert ell == 1024
    assert give[0] < min(give[1:])
    wf = est.estimate(BatchLoad(tuple(give), tuple(decodes), tuple(ctx), ((ell, 0),)))
    ev = est.estimate(BatchLoad((256,) * 4, tuple(decodes), tuple(ctx), ((ell, 0),)))
    assert wf.gemm < ev.gemm and wf.total <= ev.total
