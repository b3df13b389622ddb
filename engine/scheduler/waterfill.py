"""Pouring a prefill chunk into ranks toward a common combined-load level (paper Alg. 2, lines 'pour').

``loads[r] = n_d^r + n_p^r`` is rank r's combined token load so far this step. Pouring ``amount``
tokens raises the water level ``λ`` over the lowest ranks first, never above ``n_target``::

    n_target ─────────────────────────────
                 ░░░         ░░░             ░ = poured prefill tokens
      λ ─ ─ ─ ─  ░░░ ─ ─ ─ ─ ░░░ ─ ─ ─ ─
                 ░░░  ███    ░░░    ███      █ = existing load
                 ███  ███    ███    ███
                 r0   r1     r2     r3
"""

from __future__ import annotations


def capacity(loads: list[int], n_target: int) -> int:
    """B: tokens that fit below ``n_target`` over all ranks."""
    return sum(max(0, n_target - x) for x in loads)


def pour(loads: list[int], amount: int, n_target: int) -> list[int]:
    """Per-rank token counts that add up to ``amount`` and level the loads toward ``n_target``.

    Requires ``amount <= capacity(loads, n_target)``. Ties go to lower rank ids (deterministic).
    """
    if amount > capacity(loads, n_target):
        raise ValueError(f"amount={amount} exceeds capacity {capacity(loads, n_target)}")
    n = len(loads)
    give = [0] * n
    if amount <= 0:
        return give
    order = sorted(range(n), key=lambda r: (loads[r], r))
    # Find the integer level: raise over the k lowest ranks until amount is placed.
    remaining = amount
    for k in range(1, n + 1):
        low = order[:k]
        next_level = loads[order[k]] if k < n else n_target
        next_level = min(next_level, n_target)
        level = max(loads[r] + give[r] for r in low)
        room = sum(next_level - max(loads[r] + give[r], level) for r in low) if next_level > level else 0
        if room >= remaining or k == n:
            # Spread `remaining` evenly over `low`, bringing all to a common level.
            _level_fill(loads, give, low, remaining, n_target)
            return give
        for r in low:
            top = max(loads[r] + give[r], level)
            give[r] += next_level - top if next_level > top else 0
        remaining -= room
    return give


def _level_fill(loads: list[int], give: list[int], ranks: list[int], amount: int, cap: int) -> None:
    """Add ``amount`` to the lowest of ``ranks`` one quantum-free integer step at a time, O(k log)."""
    cur = {r: loads[r] + give[r] for r in ranks}
    total = sum(cur.values()) + amount
    k = len(ranks)
    # Target level so that everyone below it is raised to it.
    base, extra = divmod(total, k)
    for i, r in enumerate(sorted(ranks, key=lambda r: (cur[r], r))):
        want = min(cap, base + (1 if i < extra else 0))
        add = max(0, want - cur[r])
        add = min(add, amount)
        give[r] += add
        amount -= add
    # Residual (only when some rank already sat above the even level): fill others up to cap.
    for r in sorted(ranks, key=lambda r: (loads[r] + give[r], r)):
        if amount <= 0:
            break
        add = min(amount, cap - (loads[r] + give[r]))
        if add > 0:
            give[r] += add
            amount -= add
    assert amount == 0, "pour: capacity accounting broke"
