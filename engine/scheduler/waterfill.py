"""Pouring a prefill chunk into ranks toward a common combined-load level (paper Alg. 2, 'WaterfillAssign').

``loads[r] = n_d^r + n_p^r`` is rank r's combined token load so far this step. Pouring ``amount``
tokens raises the water level ``λ`` over the lowest ranks first, never above ``n_target``::

    n_target ─────────────────────────────
                 ░░░         ░░░             ░ = poured prefill tokens
      λ ─ ─ ─ ─  ░░░ ─ ─ ─ ─ ░░░ ─ ─ ─ ─
                 ░░░  ███    ░░░    ███      █ = existing load
                 ███  ███    ███    ███
                 r0   r1     r2     r3

All functions are O(N log N) in the number of ranks N and pure Python.
"""

from __future__ import annotations


def capacity(loads: list[int], n_target: int) -> int:
    """B: tokens that fit below ``n_target`` over all ranks (Alg. 2, line 3)."""
    return sum(n_target - x for x in loads if x < n_target)


def min_level(loads: list[int], amount: int) -> int:
    """The lowest integer level λ with ``capacity(loads, λ) >= amount`` (no upper cap)."""
    if amount <= 0:
        return min(loads, default=0)
    srt = sorted(loads)
    prefix = 0
    for k in range(1, len(srt) + 1):
        prefix += srt[k - 1]
        top = srt[k] if k < len(srt) else None
        if top is None or top * k - prefix >= amount:
            return -(-(prefix + amount) // k)  # ceil: k lowest ranks share prefix + amount
    raise AssertionError("unreachable")


def pour(loads: list[int], amount: int, n_target: int) -> list[int]:
    """Per-rank token counts that add up to ``amount`` and level the loads toward ``n_target``.

    The result raises the lowest ranks to a common level (ranks differ by at most one token
    there; the extra tokens go to the lower rank ids) and never lifts a rank above ``n_target``.
    Requires ``amount <= capacity(loads, n_target)``.
    """
    if amount > capacity(loads, n_target):
        raise ValueError(f"amount={amount} exceeds capacity {capacity(loads, n_target)} at n_target={n_target}")
    n = len(loads)
    give = [0] * n
    if amount <= 0:
        return give
    order = sorted(range(n), key=lambda r: (loads[r], r))
    prefix = 0
    for k in range(1, n + 1):
        prefix += loads[order[k - 1]]
        top = min(n_target, loads[order[k]]) if k < n else n_target
        if top * k - prefix >= amount:
            base, extra = divmod(prefix + amount, k)  # base >= loads[order[k-1]]; base + (extra>0) <= top
            low = sorted(order[:k])
            for i, r in enumerate(low):
                give[r] = base + (1 if i < extra else 0) - loads[r]
            return give
    raise AssertionError("pour: capacity accounting broke")
