"""Dual-mode decode placement (Alg. 3)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from conflux_cluster.engine.scheduler.placement import place_decode


@st.composite
def cluster(draw):
    n = draw(st.integers(1, 8))
    total = draw(st.integers(10, 1000))
    free = [draw(st.integers(0, total)) for _ in range(n)]
    ctx = [draw(st.integers(0, 100000)) for _ in range(n)]
    return total, free, ctx, draw(st.integers(1, total)), draw(st.floats(0.05, 1.0)), draw(st.integers(0, 20))


@given(cluster())
def test_dual_mode(case):
    total, free, ctx, need, eta, h = case
    g = place_decode(need, free, total, ctx, eta, h)
    feasible = [r for r in range(len(free)) if free[r] - need >= h]
    if not feasible:
        assert g is None
        return
    assert g in feasible  # never a rank without KV room + headroom
    low = [r for r in feasible if (total - free[r]) / total < eta]
    if low:  # worst-fit below η: least aggregate decode context among low-utilization ranks
        assert g in low and ctx[g] == min(ctx[r] for r in low)
    else:  # best-fit once every feasible rank is at/above η: fewest free blocks
        assert free[g] == min(free[r] for r in feasible)


def test_worst_fit_spreads_then_best_fit_packs():
    total, need, eta = 100, 10, 0.5
    free, ctx = [100, 100, 100], [0, 0, 0]
    picks = []
    for _ in range(6):  # below η: round-robin-like spread by context
        g = place_decode(need, free, total, ctx, eta)
        picks.append(g)
        free[g] -= need
        ctx[g] += 1000
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]
    free = [45, 40, 30]  # all above η = 0.5 use
    assert place_decode(need, free, total, [0, 0, 0], eta) == 2  # packs onto the fullest that fits
    assert place_decode(35, free, total, [0, 0, 0], eta) == 1  # rank 2 cannot hold it
    assert place_decode(10, [12, 11], total, [0, 0], eta, headroom=5) is None  # headroom h kept
