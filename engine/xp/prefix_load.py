"""Prefix-cache hits under XP: a cached prefix moves from its rank's decode layout to every rank's
head-sharded prefill layout, so the suffix's prefill runs with Ulysses SP as if the prefix's
chunks had just run (docs/prefix-caching.md)::

    rank d (holds the prefix, decode view)        every rank p (prefill view, its kv-head shard)
      blocks of hashes: [L, n, H_kv_dev, D]  ──all-to-all──▶  [L, n, h_p, D] at positions [0, n)
      (heads of p's shard, all layers at once)

One all-to-all per step with hits, before the forward pass (every rank takes part; sizes follow
from the plan). With one SP rank the two layouts are one and the prefill table borrows the cached
blocks instead (no copy). The decode rank's table keeps the cached blocks at its front (shared, never
copied); at the transition only positions [n, prompt_len) travel back to it.
"""

from __future__ import annotations

import torch

from ..plan import PrefixHit
from .comm import XPGroups, all_to_all_flat
from .heads import DeviceHeads
from .kv import XPKVCache


def load_prefixes(kv: XPKVCache, heads: DeviceHeads, groups: XPGroups, hits: list[PrefixHit]) -> None:
    """Start each hit's tables (decode on its rank, prefill on all) and fill the prefill views.

    One SP rank (both views one layout): nothing moves; the prefill table borrows the cached blocks
    (``XPKVCache.share_prefix``). Copying them would gather every layer of every hit at once, several
    GB of activation memory for a long prefix on a GPU whose pool fills the rest."""
    if len(heads.sp_shards) == 1 and kv.one_layout:
        for hit in hits:
            kv.adopt(hit.request_id, hit.hashes)
            kv.share_prefix(hit.request_id)
        return
    me, d, layers = groups.rank, kv.head_dim, kv.num_layers
    send: list[list[torch.Tensor]] = [[] for _ in heads.sp_shards]
    recv = [0] * len(heads.sp_shards)
    h_me = heads.sp_shard.num_kv
    for hit in hits:
        n = hit.num_tokens
        kv.reserve_prefill(hit.request_id, n)
        recv[hit.rank] += 2 * layers * n * h_me * d
        if hit.rank != me:
            continue
        kv.adopt(hit.request_id, hit.hashes)
        blocks = kv.block_ids(hit.request_id, n, prefill=False)
        used = kv.decode_tpb * kv.num_kv_heads * d
        for pool in (kv.k, kv.v):
            full = pool[:, blocks, :used].reshape(layers, n, kv.num_kv_heads, d)  # [L, n, H_kv_dev, D]
            for p, shard in enumerate(heads.sp_shards):
                send[p].append(full[:, :, heads.kv_slice(shard)].reshape(-1))
    empty = kv.k.new_empty(0)
    got = all_to_all_flat([torch.cat(s) if s else empty for s in send], recv, groups.sp)
    cursors = [0] * len(got)
    for hit in hits:
        n, src = hit.num_tokens, hit.rank
        numel = layers * n * h_me * d
        part = got[src][cursors[src]:cursors[src] + 2 * numel]
        cursors[src] += 2 * numel
        k, v = part[:numel].view(layers, n, h_me, d), part[numel:].view(layers, n, h_me, d)
        blocks, offsets = kv.slots(hit.request_id, 0, n, prefill=True)
        rows = kv.rows(blocks, offsets, prefill=True)
        for layer in range(layers):
            kv.write_at(layer, blocks, offsets, k[layer], v[layer], prefill=True, rows=rows)
        kv.advance(hit.request_id, n, prefill=True)
