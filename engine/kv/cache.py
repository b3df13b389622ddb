"""The paged KV cache of one rank: a pre-sized pool of blocks, block tables per request, invariants.

One physical pool per rank, shared by both layouts of ``KVLayout`` (KV aliasing, paper §4)::

    k[layer]: [num_blocks, block_elems]          block_elems = block_size * H_kv * D
      decode view          [num_blocks, block_size, H_kv, D]      all KV heads
      prefill view (rank r) [num_blocks, tpb_r, h_r, D]           tpb_r = block_size * H_kv // h_r
                                                                  (this rank's head shard)

A request's block table is a list of block ids; which layout its blocks hold is up to the caller
(the local engine uses the decode view only). Token ``t`` of a request lives in block
``table[t // tokens_per_block]`` at offset ``t % tokens_per_block``; flat slot = block * tpb + offset.

Blocks are allocated on demand (``ensure``); the scheduler's conservative reservations
(``scheduler/kv_accounting.py``) with the same ``blocks_per_rank`` guarantee this never fails.
Prefix cache: blocks the cache owns (``cache``, engine/kv/prefix_blocks.py) may start several
tables; ``free`` returns only a table's private blocks.
"""

from __future__ import annotations

import torch

from .layout import KVLayout
from ..models.config import ModelConfig
from .prefix_blocks import CachedBlocks, check_pool


class KVCacheFull(RuntimeError):
    """The pool ran out of blocks: the scheduler over-committed (a bug, never a user error)."""


def bytes_per_block(config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    """K and V of ``block_size`` tokens over all layers and KV heads."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.kv_size * elem


def blocks_for_budget(config: ModelConfig, dtype: torch.dtype, block_size: int, budget_bytes: int) -> int:
    return max(0, int(budget_bytes) // bytes_per_block(config, dtype, block_size))


class KVCache:
    """Pool tensors + allocator + per-request block tables for ONE rank."""

    def __init__(self, config: ModelConfig, layout: KVLayout, rank: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block (num_blocks={num_blocks})")
        self.layout, self.rank, self.num_blocks = layout, rank, num_blocks
        self.block_size = layout.block_size
        self.num_kv, self.head_dim = config.num_key_value_heads, config.head_dim
        block_elems = self.block_size * self.num_kv * self.head_dim
        shape = (config.num_hidden_layers, num_blocks, block_elems)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, num_blocks, block_elems]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack; pops lowest id first
        self.tables: dict[str, list[int]] = {}  # request id -> block ids, in token order
        self.cache = CachedBlocks()  # prefix-cache blocks of this pool (decode layout)

    # ---- views -------------------------------------------------------------------------
    def decode_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``layer`` as flat slots: [num_blocks * block_size, H_kv, D] each (views, no copy)."""
        shape = (self.num_blocks * self.block_size, self.num_kv, self.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)

    def prefill_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``layer`` in this rank's head-sharded layout: [num_blocks, tpb_r, h_r, D] (views)."""
        h = self.layout.shards[self.rank].num_kv
        tpb = self.layout.prefill_tokens_per_block(self.rank)
        used = tpb * h * self.head_dim
        return (self.k[layer][:, :used].view(self.num_blocks, tpb, h, self.head_dim),
                self.v[layer][:, :used].view(self.num_blocks, tpb, h, self.head_dim))

    # ---- allocation --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def ensure(self, request_id: str, num_tokens: int, tokens_per_block: int | None = None) -> list[int]:
        """Grow ``request_id``'s table to hold ``num_tokens`` tokens; returns the table."""
        tpb = tokens_per_block or self.block_size
        table = self.tables.setdefault(request_id, [])
        need = -(-num_tokens // tpb) - len(table)
        if need > len(self._free):
            raise KVCacheFull(f"rank {self.rank}: request {request_id} needs {need} more blocks, "
                              f"{len(self._free)} free of {self.num_blocks}")
        for _ in range(max(0, need)):
            table.append(self._free.pop())
        return table

    def free(self, request_id: str) -> int:
        """Return the request's blocks to the pool (unknown ids are fine: never allocated here)."""
        table = self.cache.private(self.tables.pop(request_id, []))
        self._free.extend(reversed(table))
        return len(table)

    # ---- prefix cache (the scheduler decides; see engine/kv/prefix_blocks.py) ---------------
    def evict(self, hashes: list[int]) -> None:
        self._free.extend(reversed(self.cache.evict(hashes)))

    def adopt(self, request_id: str, hashes: tuple[int, ...]) -> None:
        """``request_id``'s table starts with the cached blocks of ``hashes`` (a prefix hit)."""
        if self.tables.get(request_id):
            raise RuntimeError(f"rank {self.rank}: prefix hit for {request_id}, which already holds KV")
        self.tables[request_id] = self.cache.lookup(hashes)

    def cache_insert(self, request_id: str, first_block: int, hashes: tuple[int, ...]) -> int:
        return self.cache.insert(self.tables[request_id], first_block, hashes)

    def slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Flat decode-view slots of tokens ``[start, end)``: [end - start] int64 (CPU)."""
        table = torch.tensor(self.tables[request_id], dtype=torch.int64)
        pos = torch.arange(start, end, dtype=torch.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    # ---- invariants --------------------------------------------------------------------
    def check_invariants(self, live_requests: set[str] | None = None) -> None:
        """Raise AssertionError unless: no private block is owned twice, owned, cached and free
        blocks are disjoint and cover the pool exactly (none leaked), and (if given) only
        ``live_requests`` own blocks."""
        check_pool(self.num_blocks, self._free, {rid: [t] for rid, t in self.tables.items()}, self.cache,
                   live_requests)
