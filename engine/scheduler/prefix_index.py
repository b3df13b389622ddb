"""The scheduler's view of the prefix cache: which chained block hashes each rank holds.

Cached blocks live in one rank's decode layout (``engine/kv/prefix_blocks.py`` holds the block
ids there). The scheduler decides everything and the ranks follow its plan::

    rank r:  hash -> refs          refs > 0: tables of running requests use the block
             lru (refs == 0)       evictable, oldest first; a released prefix enters tail-first,
                                   so its last blocks are evicted before its first

    acquire(rid, r, hashes)   a request starts with a hit: its table begins with these blocks
    insert(rid, r, hashes)    after its prefill, a request's full prompt blocks join the cache
                              (a contiguous run, up to the first hash already cached on r)
    release(rid)              finished or preempted: refs drop, blocks become evictable
    evict(r, n)               free n LRU blocks on r (their hashes go to the ranks in the plan)

Counters follow vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits`` (in tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ..kv.prefix_hash import leading_run


@dataclass
class PrefixIndex:
    num_ranks: int
    block_size: int
    refs: list[dict[int, int]] = field(default_factory=list)  # per rank: hash -> refs
    lru: list[OrderedDict[int, None]] = field(default_factory=list)  # per rank: refs == 0, oldest first
    held: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # rid -> (rank, hashes in use)
    queries: int = 0  # prompt tokens looked up (vLLM prefix_cache_queries)
    hits: int = 0  # of those, tokens served from the cache (vLLM prefix_cache_hits)
    evictions: int = 0  # blocks evicted so far
    removed: list[int] = field(default_factory=list)  # per rank: blocks evicted so far (match's memo epoch)

    def __post_init__(self) -> None:
        self.refs = self.refs or [{} for _ in range(self.num_ranks)]
        self.lru = self.lru or [OrderedDict() for _ in range(self.num_ranks)]
        self.removed = self.removed or [0] * self.num_ranks

    # ---- lookups -----------------------------------------------------------------------
    def match(self, rank: int, hashes: list[int], memo: dict[int, tuple[int, int]] | None = None) -> int:
        """Leading blocks of ``hashes`` cached on ``rank``.

        ``memo`` (rank -> (evictions on that rank, blocks matched)), kept by the caller with a hash
        list that only grows at its end between calls: where the rank evicted nothing since the last
        call, the blocks matched then are still cached and the scan resumes after them. A waiting
        request is looked up every step; without the memo each lookup re-walked its whole cached
        prefix (hundreds of blocks for a long shared document)."""
        start = 0
        if memo is not None and rank in memo and memo[rank][0] == self.removed[rank]:
            start = min(memo[rank][1], len(hashes))
        n = leading_run(hashes, self.refs[rank], start)
        if memo is not None:
            memo[rank] = (self.removed[rank], n)
        return n

    def best(self, hashes: list[int], memo: dict[int, tuple[int, int]] | None = None) -> tuple[int, int]:
        """(rank, blocks) of the longest cached prefix; (0, 0) when none (``memo``: see ``match``)."""
        best = (0, 0)
        for r in range(self.num_ranks):
            n = self.match(r, hashes, memo)
            if n > best[1]:
                best = (r, n)
        return best

    def unreferenced(self, rank: int, hashes: list[int]) -> int:
        """How many of ``hashes`` (cached on ``rank``) nobody uses now: acquiring them takes them
        out of the evictable pool."""
        return sum(1 for h in hashes if h in self.lru[rank])

    def size(self, rank: int) -> int:
        return len(self.refs[rank])

    def evictable(self, rank: int) -> int:
        return len(self.lru[rank])

    # ---- changes -----------------------------------------------------------------------
    def acquire(self, rid: str, rank: int, hashes: list[int]) -> None:
        if rid in self.held:
            raise RuntimeError(f"request {rid} already holds cached blocks")
        for h in hashes:
            self._ref(rank, h)
        self.held[rid] = (rank, list(hashes))

    def insert(self, rid: str, rank: int, hashes: list[int]) -> int:
        """Cache the leading run of ``hashes`` not yet on ``rank``, referenced by ``rid``
        (whose table holds these blocks right after the ones it already references).
        Returns how many blocks joined the cache (the rest stay private to ``rid``)."""
        refs = self.refs[rank]
        n = 0
        while n < len(hashes) and hashes[n] not in refs:
            refs[hashes[n]] = 1
            n += 1
        r, held = self.held.setdefault(rid, (rank, []))
        if r != rank:
            raise RuntimeError(f"request {rid} holds cached blocks on rank {r}, inserts on {rank}")
        held.extend(hashes[:n])
        return n

    def release(self, rid: str) -> None:
        rank, hashes = self.held.pop(rid, (0, []))
        refs, lru = self.refs[rank], self.lru[rank]
        for h in reversed(hashes):  # tail first: the prefix's last blocks are evicted first
            refs[h] -= 1
            if refs[h] == 0:
                lru[h] = None

    def evict(self, rank: int, n: int) -> list[int]:
        """Drop up to ``n`` least recently released blocks of ``rank``; returns their hashes."""
        out, lru, refs = [], self.lru[rank], self.refs[rank]
        while lru and len(out) < n:
            h, _ = lru.popitem(last=False)
            del refs[h]
            out.append(h)
        self.evictions += len(out)
        self.removed[rank] += len(out)
        return out

    def _ref(self, rank: int, h: int) -> None:
        refs = self.refs[rank]
        if refs[h] == 0:
            del self.lru[rank][h]
        refs[h] += 1

    def check_invariants(self) -> None:
        for r in range(self.num_ranks):
            counted: dict[int, int] = {}
            for rank, hashes in self.held.values():
                if rank == r:
                    for h in hashes:
                        counted[h] = counted.get(h, 0) + 1
            assert all(self.refs[r].get(h, 0) == c for h, c in counted.items()), "prefix refcount drift"
            assert all(c == counted.get(h, 0) for h, c in self.refs[r].items()), "prefix refcount drift"
            assert set(self.lru[r]) == {h for h, c in self.refs[r].items() if c == 0}, "prefix LRU drift"
