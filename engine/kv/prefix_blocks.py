"""A rank's side of the prefix cache: which blocks of its pool the cache owns, under which hash.

The scheduler decides (``scheduler/prefix_index.py``); a rank only follows its plan::

    plan.evicted[r]      -> evict(hashes)         the blocks go back to the free list
    plan.prefix_hits     -> lookup(hashes)        a request's decode table starts with these blocks
    plan.cache_inserts   -> insert(table, i, hs)  blocks i, i+1, ... of a table become cached
    plan.retained                                 (stops at the first hash already cached;
                                                  ``insert_on_rank`` applies either list)

A cached block can sit in several requests' tables at once; freeing a table returns only its
private blocks (``private``). Blocks hold the decode (all-heads) layout. Pure Python.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

if TYPE_CHECKING:
    from ..contracts.step import CacheInsert


class CachedBlocks:
    def __init__(self) -> None:
        self.block_of: dict[int, int] = {}  # hash -> block id
        self._hash_of: dict[int, int] = {}  # block id -> hash

    def __len__(self) -> int:
        return len(self.block_of)

    def lookup(self, hashes: Iterable[int]) -> list[int]:
        try:
            return [self.block_of[h] for h in hashes]
        except KeyError as e:
            raise RuntimeError(f"prefix hit on a block this rank does not cache (hash {e.args[0]}): "
                               "the scheduler's index and the rank disagree") from None

    def insert(self, table: Sequence[int], first_block: int, hashes: Sequence[int]) -> int:
        """Cache ``table[first_block + j]`` under ``hashes[j]`` up to the first hash already cached."""
        n = 0
        for j, h in enumerate(hashes):
            if h in self.block_of:
                break
            b = table[first_block + j]
            self.block_of[h], self._hash_of[b] = b, h
            n += 1
        return n

    def evict(self, hashes: Iterable[int]) -> list[int]:
        """Forget ``hashes``; returns their blocks (now free)."""
        out = []
        for h in hashes:
            b = self.block_of.pop(h)
            del self._hash_of[b]
            out.append(b)
        return out

    def private(self, blocks: Iterable[int]) -> list[int]:
        """The blocks of a table that the cache does not own (freed with the table)."""
        return [b for b in blocks if b not in self._hash_of]

    def owns(self, block: int) -> bool:
        return block in self._hash_of


class _CachingPool(Protocol):
    def cache_insert(self, request_id: str, first_block: int, hashes: tuple[int, ...]) -> int: ...


def insert_on_rank(pool: _CachingPool, inserts: Iterable["CacheInsert"], rank: int) -> None:
    """Apply a plan's ``cache_inserts`` or ``retained`` (every rank's) to this rank's ``pool``."""
    for ins in inserts:
        if ins.rank == rank:
            pool.cache_insert(ins.request_id, ins.first_block, ins.hashes)


def check_pool(num_blocks: int, free: list[int], tables: dict[str, list[list[int]]],
               cache: CachedBlocks, live_requests: set[str] | None = None) -> None:
    """Raise AssertionError unless: a private block has one owner, cached blocks are not free,
    free + private + cached cover the pool exactly (nothing leaked), and (if given) only
    ``live_requests`` own blocks. ``tables``: request id -> its block tables (one per layout)."""
    owned: dict[int, str] = {}
    for rid, rid_tables in tables.items():
        for table in rid_tables:
            for b in cache.private(table):
                if b in owned:
                    raise AssertionError(f"block {b} owned by both {owned[b]} and {rid}")
                owned[b] = rid
    free_set, cached = set(free), set(cache.block_of.values())
    if len(free_set) != len(free):
        raise AssertionError("a block appears twice in the free list")
    if free_set & (owned.keys() | cached):
        raise AssertionError(f"blocks both free and owned or cached: {sorted(free_set & (owned.keys() | cached))[:5]}")
    if len(free_set) + len(owned) + len(cached) != num_blocks or not all(0 <= b < num_blocks for b in free_set):
        leaked = set(range(num_blocks)) - free_set - owned.keys() - cached
        raise AssertionError(f"blocks leaked (neither free, owned nor cached): {sorted(leaked)[:5]}")
    if live_requests is not None and set(tables) - live_requests:
        raise AssertionError(f"finished requests still own blocks: {sorted(set(tables) - live_requests)}")
