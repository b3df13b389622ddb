"""Prefix-cache hits under XP: a cached prefix moves from its rank's decode layout to every rank's
head-sharded prefill layout, so the suffix's prefill runs with Ulysses SP as if the prefix's
chunks had just run (docs/prefix-caching.md)::

    rank d (holds the prefix, decode view)        every rank p (prefill view, its kv-head shard)
      blocks of hashes: [L, n, H_kv_dev, D]  ──all-to-all──▶  [L, n, h_p, D] at positions [0, n)
      (heads of p's shard, a group of layers at a time)

One all-to-all per group of layers per step with hits, before the forward pass (every rank takes
part; sizes and groups follow from the plan; a group's K and V stay under ``PREFIX_MOVE_BYTES``).
With one SP rank the two layouts are one and the prefill table borrows the cached blocks instead
(no copy). The decode rank's table keeps the cached blocks at its front (shared, never copied); at
the transition only positions [n, prompt_len) travel back to it.
"""

from __future__ import annotations

import os

import torch

from ..contracts.step import PrefixHit
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
    h_me, used = heads.sp_shard.num_kv, kv.decode_tpb * kv.num_kv_heads * d
    sources = {}  # hits held here: their cached blocks in the decode view
    for hit in hits:
        kv.reserve_prefill(hit.request_id, hit.num_tokens)
        if hit.rank == me:
            kv.adopt(hit.request_id, hit.hashes)
            sources[hit.request_id] = kv.block_ids(hit.request_id, hit.num_tokens, prefill=False)
    targets = {hit.request_id: kv.slots(hit.request_id, 0, hit.num_tokens, prefill=True) for hit in hits}
    rows = {rid: kv.rows(b, o, prefill=True) for rid, (b, o) in targets.items()}
    for lo, hi in layer_groups(hits, layers, kv.num_kv_heads * d * kv.k.element_size()):
        _move_layers(kv, heads, groups, hits, sources, targets, rows, lo, hi, h_me, used)
    for hit in hits:
        kv.advance(hit.request_id, hit.num_tokens, prefill=True)


PREFIX_MOVE_BYTES = 256 << 20  # K and V of the hits gathered at once on a holder (every layer: GBs)
MOVE_BYTES_ENV = "CONFLUX_PREFIX_MOVE_BYTES"  # overrides it (tests: several groups with a tiny model)


def layer_groups(hits: list[PrefixHit], layers: int, token_bytes: int,
                 cap: int | None = None) -> list[tuple[int, int]]:
    """Layer ranges [lo, hi) moved by one all-to-all each, so that K and V of every hit over a range
    stay under ``cap`` (default ``PREFIX_MOVE_BYTES``, or ``$CONFLUX_PREFIX_MOVE_BYTES``;
    ``token_bytes``: one layer's K or V of one token). Every rank derives the same ranges from the plan."""
    cap = cap if cap is not None else int(os.environ.get(MOVE_BYTES_ENV, PREFIX_MOVE_BYTES))
    per_layer = 2 * sum(hit.num_tokens for hit in hits) * token_bytes
    step = max(1, min(layers, cap // max(1, per_layer)))
    return [(lo, min(layers, lo + step)) for lo in range(0, layers, step)]


def _move_layers(kv: XPKVCache, heads: DeviceHeads, groups: XPGroups, hits: list[PrefixHit], sources: dict,
                 targets: dict, rows: dict, lo: int, hi: int, h_me: int, used: int) -> None:
    """One all-to-all: layers [lo, hi) of every hit, from its holder's decode view to each rank's
    kv-head shard in the prefill view."""
    d, nl = kv.head_dim, hi - lo
    send: list[list[torch.Tensor]] = [[] for _ in heads.sp_shards]
    recv = [0] * len(heads.sp_shards)
    for hit in hits:
        n = hit.num_tokens
        recv[hit.rank] += 2 * nl * n * h_me * d
        blocks = sources.get(hit.request_id)
        if blocks is None:
            continue
        for pool in (kv.k, kv.v):
            full = pool[lo:hi, blocks, :used].reshape(nl, n, kv.num_kv_heads, d)  # [nl, n, H_kv_dev, D]
            for p, shard in enumerate(heads.sp_shards):
                send[p].append(full[:, :, heads.kv_slice(shard)].reshape(-1))
    empty = kv.k.new_empty(0)
    got = all_to_all_flat([torch.cat(s) if s else empty for s in send], recv, groups.sp)
    cursors = [0] * len(got)
    for hit in hits:
        n, src = hit.num_tokens, hit.rank
        numel = nl * n * h_me * d
        part = got[src][cursors[src]:cursors[src] + 2 * numel]
        cursors[src] += 2 * numel
        k, v = part[:numel].view(nl, n, h_me, d), part[numel:].view(nl, n, h_me, d)
        blocks, offsets = targets[hit.request_id]
        for j in range(nl):
            kv.write_at(lo + j, blocks, offsets, k[j], v[j], prefill=True, rows=rows[hit.request_id])
