"""Trace prefixes in the simulator: Mooncake ``hash_ids`` as the engine's block hashes, the
router's prefix blocks, and the trace's reuse bound (what an infinite, shared cache would hit).

Same id → same 512 tokens (and, Mooncake ids being prefix hashes, the same prefix). An engine
block of ``block_size`` tokens inside trace block ``x`` gets the chained hash of ``(x, j)``, so
the engine scheduler's prefix cache (``engine/scheduler/prefix_index.py``) runs unchanged on
lengths-only requests; hit rates come from the same cache policy as on real tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache

from conflux_cluster.engine.kv.prefix_hash import chain_hashes, leading_run

from .workloads import TRACE_BLOCK_TOKENS, SimRequest, Workload


@lru_cache(maxsize=1 << 16)
def _trace_block_hashes(hash_ids: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    per = TRACE_BLOCK_TOKENS // block_size
    return tuple(chain_hashes([x, j] for x in hash_ids for j in range(per)))


def engine_block_hashes(req: SimRequest, block_size: int) -> list[int]:
    """Chained hashes of the request's full ``block_size``-token prompt blocks (none without hash_ids)."""
    if not req.hash_ids or TRACE_BLOCK_TOKENS % block_size:
        return []
    return list(_trace_block_hashes(req.hash_ids, block_size)[:req.prompt_len // block_size])


@lru_cache(maxsize=1 << 16)
def router_hashes(hash_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The router's prefix blocks: one per trace block (``PrefixRouting.block_tokens`` = 512)."""
    return tuple(chain_hashes([x] for x in hash_ids))


def cached_prefix_tokens(workload: Workload, block_size: int = 16,
                         capacity_tokens: int | None = None) -> list[int]:
    """Per request (in the workload's order), the prompt tokens one cache shared by all instances would
    serve: its leading trace blocks seen in an earlier request, in whole engine blocks, leaving one
    prompt token to compute (the scheduler's own rule). ``capacity_tokens``: that cache is an LRU of
    this many tokens (None: infinite)."""
    cap = None if capacity_tokens is None else max(1, capacity_tokens // TRACE_BLOCK_TOKENS)
    seen: OrderedDict[int, None] = OrderedDict()
    out = [0] * len(workload.requests)
    for i in sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival):
        r = workload.requests[i]
        n = leading_run(r.hash_ids, seen)
        cacheable = (r.prompt_len - 1) // block_size * block_size
        out[i] = min(n * TRACE_BLOCK_TOKENS, cacheable)
        for h in r.hash_ids[:-(-r.prompt_len // TRACE_BLOCK_TOKENS)]:
            seen[h] = None
            seen.move_to_end(h)
        while cap is not None and len(seen) > cap:
            seen.popitem(last=False)
    return out


def reuse_bound(workload: Workload, block_size: int = 16, capacity_tokens: int | None = None) -> float:
    """Share of prompt tokens one cache shared by all instances would serve (``cached_prefix_tokens``
    summed): the trace's reuse bound, at a chosen cache size with ``capacity_tokens``."""
    total = sum(r.prompt_len for r in workload.requests)
    return sum(cached_prefix_tokens(workload, block_size, capacity_tokens)) / total if total else 0.0


def prefix_hit_rate(instances) -> float:
    """Prompt tokens served from the instances' prefix caches over those looked up (0.0 without a cache):
    vLLM's ``prefix_cache_hits / prefix_cache_queries`` summed over a simulation's instances."""
    indexes = [p for p in (getattr(getattr(i, "sched", None), "prefix", None) for i in instances) if p]
    queried = sum(p.queries for p in indexes)
    return sum(p.hits for p in indexes) / queried if queried else 0.0
