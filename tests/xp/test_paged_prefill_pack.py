"""The packed form FlashInfer's paged prefill takes (engine/xp/paged_prefill.py), on CPU: query and page
offsets, the last page's fill, and the row order of segments that are not in received order."""

from __future__ import annotations

import torch

from conflux_cluster.engine.xp.meta import SPSegment
from conflux_cluster.engine.xp.paged_prefill import pack_segments


def test_segments_pack_into_query_and_page_offsets():
    tpb = 16
    segs = [SPSegment("a", 0, 20, torch.arange(0, 20)),  # a first chunk: 2 pages, 4 keys in the last
            SPSegment("b", 40, 48, torch.arange(20, 28))]  # 8 queries over 48 keys: 3 pages, full last page
    tables = [[7, 3, 99], [5, 6, 2, 11]]  # tables may hold more blocks than the keys need
    p = pack_segments(segs, tables, tpb)
    assert p.qo_indptr == [0, 20, 28]
    assert p.kv_indptr == [0, 2, 5]
    assert p.kv_indices == [7, 3, 5, 6, 2]
    assert p.last_page_len == [4, 16]
    assert p.perm is None  # rows 0..27 in order: no gather


def test_rows_out_of_received_order_get_a_permutation():
    segs = [SPSegment("a", 0, 3, torch.tensor([4, 5, 6])), SPSegment("b", 16, 18, torch.tensor([0, 1]))]
    p = pack_segments(segs, [[1], [2, 3]], 16)
    assert p.qo_indptr == [0, 3, 5] and p.kv_indices == [1, 2, 3] and p.last_page_len == [3, 2]
    assert p.perm == [4, 5, 6, 0, 1]
