"""One paged KV pool per device serving both layouts (paper §7 "KV-cache aliasing").

Every physical block holds ``E = block_size * H * D`` elements per layer for K (and for V), where
``H`` is the device's decode kv heads. The two layouts are two *views* of the same blocks, each
with its own block tables::

    decode view  (request decoding here):     block -> [block_size,            H,   D]
    prefill view (head-sharded prefill KV):   block -> [block_size * H // h,   h,   D]
                                              (h = kv heads of the device's SP sub-shard;
                                               leftover elements of a block are unused)

    pool[layer]: [num_blocks, E]     table[rid] = [b0, b1, ...]     token p -> (table[p // tpb], p % tpb)

Prefill chunks append to the prefill view (history never moves). At a prefill->decode transition
the decode rank receives the full heads and writes them into its decode view; every device then
frees the request's prefill blocks. No second pool and no duplicated KV.

Prefix cache (engine/kv/prefix_blocks.py): cached blocks hold the decode view; a hit's decode table
starts with them (shared by every request with that prefix), ``free`` keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..kv.prefix_blocks import CachedBlocks, check_pool
from ..util.transfer import tensor_to_device, to_device
from . import triton_kv
from .triton_decode import DecodeWork


@dataclass(frozen=True)
class DecodeBatch:
    """Per-step decode addressing, computed once and used by every layer."""

    table: torch.Tensor  # [B, nb] block ids (padded with 0)
    lengths: torch.Tensor  # [B] valid keys after this token (position + 1)
    write_block: torch.Tensor  # [B] block of the new token
    write_offset: torch.Tensor  # [B] offset of the new token in that block
    max_blocks: int  # table width (blocks of the longest request)
    prefill: bool = False  # which view: decode (False) or head-sharded (True)
    write_rows: torch.Tensor | None = None  # [B] pool-row offsets of the new tokens (``XPKVCache.rows``)
    host_lengths: tuple[int, ...] = ()  # ``lengths`` on the host
    work: DecodeWork | None = None  # the Triton kernel's split list (``XPAttention`` adds it on CUDA)


@dataclass
class _Table:
    blocks: list[int] = field(default_factory=list)  # physical block ids in token order (append-only)
    length: int = 0  # tokens written so far
    _mirror: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    _synced: int = 0  # leading entries of ``_mirror`` that equal ``blocks``

    def array(self, n: int) -> np.ndarray:
        """The first ``n`` block ids as an int64 array (a view; valid until the table grows).

        Kept in step with ``blocks`` incrementally (blocks are only appended), so a step's tables
        cost the blocks added since the last step, not the whole context: building a 32-request
        table of 2,000 blocks each from Python lists took ~10 ms of host time per step."""
        total = len(self.blocks)
        if self._synced < total:
            if total > len(self._mirror):
                grown = np.zeros(max(total, 2 * len(self._mirror), 16), np.int64)
                grown[:self._synced] = self._mirror[:self._synced]
                self._mirror = grown
            self._mirror[self._synced:total] = self.blocks[self._synced:total]
            self._synced = total
        return self._mirror[:n]


class XPKVCache:
    """The paged KV pool of one device plus its prefill and decode block tables."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 prefill_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", pool: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``pool``: existing (k, v) tensors [L, num_blocks, >= E] to alias (the worker's KVCache)."""
        if not 1 <= prefill_kv_heads <= num_kv_heads:
            raise ValueError(f"prefill_kv_heads={prefill_kv_heads} not in [1, {num_kv_heads}]")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.prefill_kv_heads, self.head_dim = num_kv_heads, prefill_kv_heads, head_dim
        elems = block_size * num_kv_heads * head_dim
        # k/v: [L, num_blocks, E]: the single physical pool of this device.
        if pool is not None:
            self.k, self.v = pool
            if self.k.shape[:2] != (num_layers, num_blocks) or self.k.shape[2] < elems:
                raise ValueError(f"pool {tuple(self.k.shape)} cannot hold {num_blocks} blocks of {elems}")
        else:
            self.k = torch.zeros(num_layers, num_blocks, elems, dtype=dtype, device=device)
            self.v = torch.zeros_like(self.k)
        self.decode_tpb = block_size
        self.prefill_tpb = block_size * num_kv_heads // prefill_kv_heads
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest id first
        self.prefill: dict[str, _Table] = {}
        self.decode: dict[str, _Table] = {}
        self.cache = CachedBlocks()  # prefix-cache blocks (decode view)

    # ---- block accounting --------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def _grow(self, table: _Table, tokens: int, tpb: int, rid: str) -> None:
        need = -(-tokens // tpb) - len(table.blocks)
        if need > len(self._free):
            raise RuntimeError(f"KV pool exhausted: request {rid} needs {need} more blocks, "
                               f"{len(self._free)} free (the scheduler's accounting should prevent this)")
        for _ in range(max(0, need)):
            table.blocks.append(self._free.pop())

    def reserve_prefill(self, rid: str, tokens: int) -> None:
        """Make the prefill table of ``rid`` hold at least ``tokens`` tokens."""
        self._grow(self.prefill.setdefault(rid, _Table()), tokens, self.prefill_tpb, rid)

    def reserve_decode(self, rid: str, tokens: int) -> None:
        self._grow(self.decode.setdefault(rid, _Table()), tokens, self.decode_tpb, rid)

    def free_prefill(self, rid: str) -> None:
        t = self.prefill.pop(rid, None)
        if t is not None:  # a shared prefix's cached blocks stay (``share_prefix``)
            self._free.extend(reversed(self.cache.private(t.blocks)))

    @property
    def one_layout(self) -> bool:
        """Both views are one layout: this device holds every kv head of a prompt (one SP rank)."""
        return self.prefill_tpb == self.decode_tpb and self.prefill_kv_heads == self.num_kv_heads

    def share_prefix(self, rid: str) -> None:
        """One layout: ``rid``'s prefill table starts with the cached blocks its decode table adopted
        (borrowed, not copied: the suffix's chunks append private blocks after them)."""
        if not self.one_layout:
            raise RuntimeError("share_prefix needs the prefill and decode views to be one layout")
        if rid in self.prefill:
            raise RuntimeError(f"prefix hit for {rid}, which already holds prefill KV")
        head = self.decode[rid]
        self.prefill[rid] = _Table(list(head.blocks), head.length)

    def hand_over(self, rid: str, length: int) -> None:
        """Prefill -> decode transition without a copy: the prefill table becomes the decode table.

        Only where both views are one layout (this device holds every kv head of the prompt: one
        SP rank). A decode table that already exists holds a prefix hit's cached blocks for
        positions ``[0, n)``; it keeps them. The prefill table's blocks of those positions are the
        same cached blocks where the hit shared them (``share_prefix``), else copies, which are freed::

            prefill  [c0 c1 p2 p3]   decode (hit) [c0 c1]   ->   decode [c0 c1 p2 p3]
            prefill  [p0 p1 p2 p3]   decode (hit) [c0 c1]   ->   decode [c0 c1 p2 p3], free p0 p1
        """
        if not self.one_layout:
            raise RuntimeError("hand_over needs the prefill and decode views to be one layout")
        t = self.prefill.pop(rid)
        head = self.decode.get(rid)
        if head is None:
            self.decode[rid] = _Table(t.blocks, length)
            return
        n = len(head.blocks)
        if head.length != n * self.decode_tpb:
            raise RuntimeError(f"{rid}: decode table of {head.length} tokens is not whole cached blocks")
        self._free.extend(reversed(self.cache.private(t.blocks[:n])))
        self.decode[rid] = _Table(head.blocks + t.blocks[n:], length)

    def free(self, rid: str) -> None:
        """Free both layouts of ``rid`` (finished or aborted)."""
        self.free_prefill(rid)
        t = self.decode.pop(rid, None)
        if t is not None:
            self._free.extend(reversed(self.cache.private(t.blocks)))

    # ---- prefix cache (the scheduler decides; see engine/kv/prefix_blocks.py) ---------------
    def evict(self, hashes: list[int]) -> None:
        self._free.extend(reversed(self.cache.evict(hashes)))

    def adopt(self, rid: str, hashes: tuple[int, ...]) -> None:
        """``rid``'s decode table starts with the cached blocks of ``hashes`` (full, in the decode view)."""
        if rid in self.decode:
            raise RuntimeError(f"prefix hit for {rid}, which already holds decode KV")
        self.decode[rid] = _Table(self.cache.lookup(hashes), len(hashes) * self.decode_tpb)

    def cache_insert(self, rid: str, first_block: int, hashes: tuple[int, ...]) -> int:
        return self.cache.insert(self.decode[rid].blocks, first_block, hashes)

    def prefill_len(self, rid: str) -> int:
        t = self.prefill.get(rid)
        return t.length if t else 0

    def decode_len(self, rid: str) -> int:
        t = self.decode.get(rid)
        return t.length if t else 0

    def check_invariants(self, live_requests: set[str] | None = None) -> None:
        """No private block owned twice, or owned and free; none leaked; only live requests own blocks."""
        tables: dict[str, list[list[int]]] = {}
        for layout in (self.prefill, self.decode):
            for rid, t in layout.items():
                tables.setdefault(rid, []).append(t.blocks)
        check_pool(self.num_blocks, self._free, tables, self.cache, live_requests)

    # ---- views and slots ---------------------------------------------------------------
    def _view(self, pool: torch.Tensor, layer: int, prefill: bool) -> torch.Tensor:
        """pool[layer] seen as [num_blocks, tpb, heads, D] in the chosen layout."""
        heads = self.prefill_kv_heads if prefill else self.num_kv_heads
        tpb = self.prefill_tpb if prefill else self.decode_tpb
        return pool[layer, :, : tpb * heads * self.head_dim].view(self.num_blocks, tpb, heads, self.head_dim)

    def slots(self, rid: str, start: int, end: int, prefill: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets) of token positions ``[start, end)``; each [end - start] int64."""
        blocks, offsets = self.host_slots(rid, start, end, prefill)
        dev = self.k.device
        return tensor_to_device(blocks, dev), tensor_to_device(offsets, dev)

    def host_slots(self, rid: str, start: int, end: int, prefill: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``slots`` on the host (CPU tensors), for callers that gather several requests' into one copy."""
        table = (self.prefill if prefill else self.decode)[rid]
        tpb = self.prefill_tpb if prefill else self.decode_tpb
        pos = torch.arange(start, end)
        return torch.from_numpy(table.array(len(table.blocks)))[pos // tpb], pos % tpb  # indexing copies

    def host_block_ids(self, rid: str, end: int, prefill: bool) -> np.ndarray:
        """The blocks holding positions ``[0, end)`` of ``rid`` (table order), a host int64 copy."""
        table = (self.prefill if prefill else self.decode)[rid]
        return table.array(-(-end // (self.prefill_tpb if prefill else self.decode_tpb))).copy()

    def block_ids(self, rid: str, end: int, prefill: bool) -> torch.Tensor:
        """Device tensor of the blocks holding positions ``[0, end)`` of ``rid`` (table order)."""
        return tensor_to_device(torch.from_numpy(self.host_block_ids(rid, end, prefill)), self.k.device)

    def rows(self, blocks: torch.Tensor, offsets: torch.Tensor, prefill: bool) -> torch.Tensor | None:
        """Row offsets of slots (the same in every layer) for ``write_rows``; None where the
        row-copy kernel does not run (CPU, no Triton): writes then index the view."""
        if not self._row_copy():
            return None
        return triton_kv.row_offsets(self._view(self.k, 0, prefill), blocks, offsets)

    def _row_copy(self) -> bool:
        """Whether KV writes take the Triton row-copy kernel (CUDA with Triton)."""
        return self.k.is_cuda and triton_kv.available()

    def write_at(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, prefill: bool, rows: torch.Tensor | None = None) -> None:
        """Store k/v [T, heads, D] at precomputed ``slots`` (block ids, offsets; each [T]);
        ``rows``: the same slots from ``rows()`` (GPU: whole-row copies in one kernel)."""
        kv, vv = self._view(self.k, layer, prefill), self._view(self.v, layer, prefill)
        rows = rows if rows is not None else self.rows(blocks, offsets, prefill)
        if rows is not None:
            triton_kv.scatter_kv(kv, vv, rows, k, v)
            return
        kv[blocks, offsets] = k.to(self.k.dtype)
        vv[blocks, offsets] = v.to(self.v.dtype)

    def read_at(self, layer: int, blocks: torch.Tensor, end: int, prefill: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of positions ``[0, end)`` given ``block_ids``: each [end, heads, D] (one gather, a copy)."""
        kv = []
        for view in self.decode_views(layer, prefill):
            g = view.index_select(0, blocks)  # [nb, tpb, heads, D]
            kv.append(g.reshape(g.shape[0] * g.shape[1], g.shape[2], self.head_dim)[:end])
        return kv[0], kv[1]

    def write(self, layer: int, rid: str, start: int, k: torch.Tensor, v: torch.Tensor,
              prefill: bool) -> None:
        """Store k/v [T, heads, D] at positions ``[start, start + T)`` of ``rid``'s table.

        The table must already hold the blocks (``reserve_*``). Lengths advance via ``advance``.
        """
        b, o = self.slots(rid, start, start + k.shape[0], prefill)
        self.write_at(layer, b, o, k, v, prefill)

    def read(self, layer: int, rid: str, end: int, prefill: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of positions ``[0, end)``: each [end, heads, D] (one block gather, a copy)."""
        return self.read_at(layer, self.block_ids(rid, end, prefill), end, prefill)

    # ---- batched decode (one new token per request, decode view) -----------------------
    def decode_batch(self, rids: list[str], prefill: bool = False) -> "DecodeBatch":
        """Block tables and write slots for one new token of each of ``rids`` (after reserve).

        ``prefill=False``: decode view (local decode); ``True``: head-sharded view (uniform-sp
        decode tokens, which keep their KV head-sharded). The new token sits at the table length.
        """
        tables = self.prefill if prefill else self.decode
        dev, bs = self.k.device, self.prefill_tpb if prefill else self.decode_tpb
        pos = [tables[r].length for r in rids]
        rows = [tables[r].array(p // bs + 1) for r, p in zip(rids, pos)]
        nb = max(len(b) for b in rows)
        host = np.zeros((len(rows), nb), np.int64)  # [B, nb], padded with block 0
        for i, b in enumerate(rows):
            host[i, :len(b)] = b
        table = tensor_to_device(torch.from_numpy(host), dev)
        # lengths, write blocks, write offsets (and pool rows on the row-copy path) in one copy
        wb, wo = [int(b[p // bs]) for b, p in zip(rows, pos)], [p % bs for p in pos]
        small = [[p + 1 for p in pos], wb, wo]
        row_copy = self._row_copy()
        if row_copy:
            view = self._view(self.k, 0, prefill)
            small.append([triton_kv.row_offsets(view, b, o) for b, o in zip(wb, wo)])
        vec = to_device(small, dev)  # [3 or 4, B]
        return DecodeBatch(table, vec[0], vec[1], vec[2], nb, prefill, vec[3] if row_copy else None,
                           tuple(p + 1 for p in pos))

    def write_decode(self, layer: int, batch: "DecodeBatch", k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [B, heads, D]: the new token of each request into its blocks (the batch's view)."""
        self.write_at(layer, batch.write_block, batch.write_offset, k, v, batch.prefill, batch.write_rows)

    def decode_views(self, layer: int, prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``layer`` as [num_blocks, tokens_per_block, heads, D] views of the pool (no copy)."""
        return self._view(self.k, layer, prefill), self._view(self.v, layer, prefill)

    def read_decode(self, layer: int, batch: "DecodeBatch") -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, nb * tokens_per_block, heads, D] padded (valid: first ``batch.lengths[b]`` rows)."""
        b, nb = batch.table.shape
        out = []
        for view in self.decode_views(layer, batch.prefill):
            g = view[batch.table]  # [B, nb, tpb, heads, D]
            out.append(g.reshape(b, nb * view.shape[1], view.shape[2], self.head_dim))
        return out[0], out[1]

    def advance(self, rid: str, length: int, prefill: bool) -> None:
        """Record that ``rid``'s table now holds ``length`` tokens (after all layers wrote them)."""
        (self.prefill if prefill else self.decode)[rid].length = length
