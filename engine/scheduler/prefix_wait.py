"""Waiting for a prefix that is being computed (the prefix cache's in-flight case).

Blocks join the prefix cache when their prefill completes. A request that arrives while an
earlier prompt with the same prefix is still prefilling (the next turn of a conversation, a burst
of requests over one long document) would otherwise compute that prefix a second time, in
parallel, and find nothing cached. SGLang defers such requests within a batch; here a waiting
request does not start while a started prefill will cache more of its prefix than is cached now
and has no more prompt tokens left than that gain: it cannot be slower than computing the shared
part itself, and it frees that compute for everyone else. Once the earlier prefill completes (or
is aborted or preempted, when the condition no longer holds) the request starts as usual.
"""

from __future__ import annotations

from typing import Iterable

from ..kv.prefix_hash import shared_run
from .requests import SchedRequest


def awaited_prefill(hashes: list[int], cached_blocks: int, started: Iterable[SchedRequest],
                    block_size: int) -> SchedRequest | None:
    """The started prefill worth waiting for, if any. ``hashes``: the waiting request's cacheable
    block hashes; ``cached_blocks``: how many of them are cached now (its best hit)."""
    for p in started:
        full = min(len(p.block_hashes), p.prompt_len // block_size)  # what p caches at its transition
        gain = (min(shared_run(hashes, p.block_hashes), full) - cached_blocks) * block_size
        if gain > 0 and p.prompt_len - p.computed <= gain:
            return p
    return None
