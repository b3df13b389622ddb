"""Head partitions (uneven, replicated KV heads, TP sub-shards) and the aliased KV pool (no processes)."""

from __future__ import annotations

import pytest
import torch

from conflux_cluster.engine.xp.heads import DeviceHeads
from conflux_cluster.engine.xp.kv import XPKVCache

SHAPES = [(9, 3), (32, 8), (4, 2), (40, 8), (8, 1), (12, 4), (14, 2)]


@pytest.mark.parametrize("hq,hkv", SHAPES)
def test_partitions_cover_heads_once(hq: int, hkv: int) -> None:
    for tp in (1, 2):
        for n in range(1, hq // tp + 1):
            for t in range(tp):
                d = DeviceHeads.build(hq, hkv, n, tp, 0, t)
                qs = [h for s in d.sp_shards for h in range(s.q_lo, s.q_hi)]
                assert qs == list(range(d.tp_shard.q_lo, d.tp_shard.q_hi))  # every q head exactly once
                sizes = [s.num_q for s in d.sp_shards]
                assert max(sizes) - min(sizes) <= 1  # balanced
                for s in d.sp_shards:  # a shard holds every kv head its q heads read
                    assert {h // d.group for h in range(s.q_lo, s.q_hi)} == set(range(s.kv_lo, s.kv_hi))
                # the transition gather takes each kv head from exactly one owner, contiguously
                owned = [[j for j in range(s.kv_lo, s.kv_hi) if d.kv_owner(j) == r] for r, s in enumerate(d.sp_shards)]
                assert sorted(j for o in owned for j in o) == list(range(d.tp_shard.kv_lo, d.tp_shard.kv_hi))
                assert all(o == list(range(o[0], o[-1] + 1)) for o in owned if o)


def test_smollm2_two_ranks_replicates_kv_head_1() -> None:
    d = [DeviceHeads.build(9, 3, 2, rank=r) for r in range(2)]
    assert [(s.q_lo, s.q_hi, s.kv_lo, s.kv_hi) for s in d[0].sp_shards] == [(0, 5, 0, 2), (5, 9, 1, 3)]


def test_both_layouts_alias_one_pool() -> None:
    pool_k = torch.zeros(2, 8, 4 * 3 * 2 + 5)  # [L, blocks, E + slack] like the worker's KVCache rows
    pool_v = torch.zeros_like(pool_k)
    kv = XPKVCache(2, 8, 4, 3, 2, 2, pool=(pool_k, pool_v))  # 3 kv heads, shard of 2: 6 tokens/block
    assert kv.k.data_ptr() == pool_k.data_ptr() and kv.prefill_tpb == 6
    kv.reserve_prefill("a", 7)  # 2 blocks
    kv.reserve_decode("b", 5)  # 2 blocks
    assert kv.num_free_blocks == 4
    k = torch.arange(7 * 2 * 2, dtype=torch.float32).view(7, 2, 2)
    kv.write(1, "a", 0, k, -k, prefill=True)
    got_k, got_v = kv.read(1, "a", 7, prefill=True)
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    assert pool_k[1].abs().sum() == k.abs().sum()  # written into the shared tensor, nowhere else
    kv.check_invariants({"a", "b"})
    with pytest.raises(AssertionError):
        kv.check_invariants({"b"})  # a finished request that still owns blocks is reported
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8 and not kv.prefill and not kv.decode
    with pytest.raises(RuntimeError, match="exhausted"):
        kv.reserve_decode("c", 4 * 9)


def test_hand_over_makes_the_prefill_table_the_decode_table() -> None:
    """One SP rank: the transition moves block ids, not KV; a prefix hit keeps its cached blocks."""
    kv = XPKVCache(1, 8, 4, 2, 2, 2)  # every kv head in the prefill view: one layout
    kv.reserve_prefill("a", 10)  # 3 blocks
    k = torch.arange(10 * 2 * 2, dtype=torch.float32).view(10, 2, 2)
    kv.write(0, "a", 0, k, -k, prefill=True)
    kv.hand_over("a", 10)
    assert not kv.prefill and kv.decode_len("a") == 10 and kv.num_free_blocks == 5
    got_k, got_v = kv.read(0, "a", 10, prefill=False)
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    kv.cache_insert("a", 0, (11, 12))  # two full blocks become the cached prefix 11, 12
    kv.free("a")
    kv.adopt("b", (11, 12))  # a hit on 8 cached tokens; its prefill view holds all 10 positions
    kv.reserve_prefill("b", 10)
    free_before = kv.num_free_blocks
    kv.hand_over("b", 10)
    assert kv.decode["b"].blocks[:2] == kv.cache.lookup((11, 12))
    assert kv.num_free_blocks == free_before + 2  # the prefill copies of the cached blocks
    kv.check_invariants({"b"})
    kv.free("b")
    kv.evict([11, 12])
    assert kv.num_free_blocks == 8
    with pytest.raises(RuntimeError, match="one layout"):
        XPKVCache(1, 8, 4, 3, 2, 2).hand_over("x", 1)


def test_a_prefix_hit_on_one_layout_borrows_the_cached_blocks() -> None:
    """One SP rank: the hit's prefill table starts with the cached blocks (no copy); the transition
    and an abort free only the request's own blocks."""
    kv = XPKVCache(1, 8, 4, 2, 2, 2)
    kv.reserve_prefill("a", 8)
    k = torch.arange(8 * 2 * 2, dtype=torch.float32).view(8, 2, 2)
    kv.write(0, "a", 0, k, -k, prefill=True)
    kv.hand_over("a", 8)
    kv.cache_insert("a", 0, (11, 12))
    kv.free("a")
    cached = kv.cache.lookup((11, 12))
    for rid, finish in (("b", "hand_over"), ("c", "abort")):
        kv.adopt(rid, (11, 12))
        kv.share_prefix(rid)
        assert kv.prefill[rid].blocks == cached and kv.prefill_len(rid) == 8
        kv.reserve_prefill(rid, 10)  # the suffix: one private block after the borrowed ones
        assert kv.num_free_blocks == 5 and kv.prefill[rid].blocks[:2] == cached
        suffix = torch.full((2, 2, 2), 7.0)
        kv.write(0, rid, 8, suffix, suffix, prefill=True)
        got_k, _ = kv.read(0, rid, 10, prefill=True)  # history read through the cached blocks
        assert torch.equal(got_k[:8], k) and torch.equal(got_k[8:], suffix)
        if finish == "hand_over":
            kv.hand_over(rid, 10)
            assert kv.decode[rid].blocks[:2] == cached and kv.num_free_blocks == 5
        kv.check_invariants({rid})
        kv.free(rid)
        assert kv.num_free_blocks == 6 and kv.cache.lookup((11, 12)) == cached
        kv.check_invariants(set())
    with pytest.raises(RuntimeError, match="one layout"):
        XPKVCache(1, 8, 4, 3, 2, 2).share_prefix("x")


def test_decode_batch_tables_follow_growing_requests() -> None:
    """The decode table (built from each request's incrementally kept id array) equals the block
    lists, padded with block 0, as requests grow past blocks and the array's capacity, step by step."""
    kv = XPKVCache(1, 400, 2, 1, 1, 2)  # 2 tokens per block
    kv.reserve_decode("a", 1)
    kv.reserve_decode("b", 33)  # 17 blocks: past the array's first capacity
    kv.decode["a"].length, kv.decode["b"].length = 0, 32
    kv._free.reverse()  # hand out ids from the top, so a table is not just 0, 1, 2, ...
    for step in range(70):
        rids = ["a", "b"] if step % 3 else ["b", "a"]
        for r in rids:
            kv.reserve_decode(r, kv.decode[r].length + 1)
        batch = kv.decode_batch(rids)
        want = [kv.decode[r].blocks[: kv.decode[r].length // 2 + 1] for r in rids]
        width = max(len(w) for w in want)
        assert batch.max_blocks == width
        assert batch.table.tolist() == [w + [0] * (width - len(w)) for w in want]
        assert batch.lengths.tolist() == [kv.decode[r].length + 1 for r in rids]
        assert batch.write_block.tolist() == [w[-1] for w in want]
        assert kv.block_ids("b", kv.decode["b"].length + 1, prefill=False).tolist() == want[rids.index("b")]
        for r in rids:
            kv.decode[r].length += 1
    kv.free("a")
    kv.free("b")
    kv.check_invariants(set())
