"""Dual-mode decode placement (paper §6.3, Alg. 3, App. F).

When a request's final prefill chunk is planned, it needs a decode rank: one whose KV pool can
hold the request's whole decode reservation while keeping ``headroom`` blocks free::

    feasible G = {r : free_r − need ≥ h}          (∅ → infeasible: the chunk is not scheduled)
    G_low      = {r ∈ G : used_r / total < η}
    G_low ≠ ∅  → worst-fit: least aggregate decode context Σ_{i∈D̃_r} c_i   (spread: balance T_D)
    otherwise  → best-fit:  highest KV use (least free blocks) in G         (pack: keep room)

``decode_context`` must include placements reserved earlier in the same step (D̃), and ``free``
must already exclude their KV reservations. Ties go to the lower rank id.
"""

from __future__ import annotations


def place_decode(need: int, free: list[int], total: int, decode_context: list[int], eta: float,
                 headroom: int = 0) -> int | None:
    """The decode rank for a request needing ``need`` KV blocks, or None when infeasible.

    free[r]: unreserved blocks on rank r; total: blocks per rank; decode_context[r]: Σ c_i of the
    decodes resident on (or reserved for) rank r.
    """
    feasible = [r for r, f in enumerate(free) if f - need >= headroom]
    if not feasible:
        return None
    low = [r for r in feasible if (total - free[r]) / total < eta]
    if low:
        return min(low, key=lambda r: (decode_context[r], r))  # worst-fit
    return min(feasible, key=lambda r: (free[r], r))  # best-fit
