"""Split-history prefill attention (engine/xp/split_history.py): the merged partitions equal the
unsplit causal attention, on CPU with the math partials and on CUDA with the flash kernel."""

from __future__ import annotations

import pytest
import torch

from conflux_cluster.engine.xp.ops import causal_attention, prepare_history_attention
from conflux_cluster.engine.xp.split_history import (MIN_HISTORY, PART_KEYS, QUERY_BLOCK, TUNE_BLOCKS, TUNE_PARTS,
                                                     SplitTable, cudnn_history_attention, history_splits, in_pieces,
                                                     split_history_attention, warm_cudnn)

HQ, HKV, D = 8, 2, 16
KV_OF_Q = [i // (HQ // HKV) for i in range(HQ)]


def _qkv(start: int, chunk: int, device: str = "cpu", dtype: torch.dtype = torch.float32, hq: int = HQ,
         hkv: int = HKV, d: int = D):
    g = torch.Generator(device=device).manual_seed(start * 7919 + chunk)
    q = torch.randn(chunk, hq, d, generator=g, device=device, dtype=dtype)
    k = torch.randn(start + chunk, hkv, d, generator=g, device=device, dtype=dtype)
    v = torch.randn(start + chunk, hkv, d, generator=g, device=device, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("start,chunk,parts", [
    (100, 7, 1), (100, 7, 3), (64, 16, 4), (1000, 1, 8),  # even and uneven partitions, one query
    (5, 3, 8),  # fewer history keys than partitions: the chunk's causal call takes them all
    (37, 40, 2),  # a chunk longer than the history
])
def test_split_equals_unsplit(start: int, chunk: int, parts: int) -> None:
    q, k, v = _qkv(start, chunk)
    want = causal_attention(q, k, v, start, KV_OF_Q, D ** -0.5, parts=0)
    got = split_history_attention(q, k, v, start, parts, D ** -0.5)
    assert got.shape == want.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("start,chunk,part_keys", [
    (100, 7, 50),  # two whole partitions, no rest
    (130, 7, 50),  # two partitions and 30 history keys that join the chunk's causal call
    (64, 130, 64),  # a chunk of two query tiles (padded to 256 rows), one partition
    (1000, 1, 128),  # one query over seven partitions
])
def test_fixed_partitions_equal_unsplit(start: int, chunk: int, part_keys: int) -> None:
    """The cuDNN layout (partitions of exactly ``part_keys`` keys, queries padded to whole tiles), run
    with the math partials on CPU, merges to the unsplit causal attention."""
    q, k, v = _qkv(start, chunk)
    want = causal_attention(q, k, v, start, KV_OF_Q, D ** -0.5, parts=0)
    got = cudnn_history_attention(q, k, v, start, D ** -0.5, part_keys=part_keys)
    assert got.shape == want.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("start,chunk,piece", [(130, 300, 128), (100, 7, 4), (64, 256, 128), (200, 50, 64)])
def test_pieces_equal_one_call(start: int, chunk: int, piece: int) -> None:
    """A long chunk run as consecutive pieces, each over the history and the chunk's earlier pieces (and
    each through the fixed partitions, as the engine runs them), equals one causal call."""
    q, k, v = _qkv(start, chunk)
    want = causal_attention(q, k, v, start, KV_OF_Q, D ** -0.5, parts=0)
    got = in_pieces(q, k, v, start, piece, lambda qp, kp, vp, at: cudnn_history_attention(
        qp, kp, vp, at, D ** -0.5, part_keys=50))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_table_runs_long_chunks_in_pieces() -> None:
    """Pieces of the table's query tiles, only where cuDNN won that tile count and the history splits."""
    rows = TUNE_BLOCKS * QUERY_BLOCK
    won = SplitTable((1,) * TUNE_BLOCKS, cudnn=frozenset(range(1, TUNE_BLOCKS + 1)))
    assert won.piece(rows + 1, MIN_HISTORY) == rows and won.piece(4 * rows, 65536) == rows
    assert won.piece(rows, 65536) == 0  # one call holds it
    assert won.piece(4 * rows, MIN_HISTORY - 1) == 0  # a history too short to split
    assert SplitTable((1,) * TUNE_BLOCKS, cudnn=frozenset({1})).piece(4 * rows, 65536) == 0  # flash won
    assert won.uses_cudnn(rows, MIN_HISTORY)  # so every whole piece over a split history goes to cuDNN


def test_fixed_partitions_need_a_whole_partition() -> None:
    q, k, v = _qkv(40, 4)
    with pytest.raises(AssertionError):
        cudnn_history_attention(q, k, v, 40, D ** -0.5, part_keys=50)


def test_table_routes_to_cudnn_by_query_tiles() -> None:
    """cuDNN only for the query-tile counts it won, over histories of at least one partition, within the
    split's limits; past the table, flash."""
    table = SplitTable((1, 1, 2), cudnn=frozenset({2}))
    assert table.uses_cudnn(QUERY_BLOCK + 1, 65536) and table.parts(QUERY_BLOCK + 1, 65536) == 1
    assert not table.uses_cudnn(QUERY_BLOCK, 65536)  # one tile: flash won
    assert not table.uses_cudnn(QUERY_BLOCK + 1, MIN_HISTORY - 1)  # too short a history to split
    assert not table.uses_cudnn(4096, 65536)  # past the table
    assert MIN_HISTORY >= PART_KEYS  # every split history holds one whole cuDNN partition
    assert warm_cudnn(SplitTable((1,)), KV_OF_Q, D, torch.float32, torch.device("cpu"), 10 ** 6) == 0


def test_split_attends_only_the_visible_keys() -> None:
    """A key after a query's position must not count: changing the chunk's last key moves only the
    last query's output."""
    q, k, v = _qkv(300, 8)
    base = split_history_attention(q, k, v, 300, 3, D ** -0.5)
    k2, v2 = k.clone(), v.clone()
    k2[-1] += 5.0
    v2[-1] += 5.0
    moved = split_history_attention(q, k2, v2, 300, 3, D ** -0.5)
    torch.testing.assert_close(moved[:-1], base[:-1])
    assert not torch.allclose(moved[-1], base[-1])


def test_history_splits_rule() -> None:
    sms = 132
    assert history_splits(128, MIN_HISTORY - 1, 32, sms) == 0  # short history: unsplit
    assert history_splits(4096, MIN_HISTORY, 32, sms) == 0  # a chunk of more than history / 8
    assert history_splits(128, 65536, 32, sms) == 1  # 32 thread blocks: one unmasked call
    assert history_splits(512, 65536, 32, sms) == 2  # 128 blocks: between half and all of the SMs
    assert history_splits(2048, 65536, 32, sms) == 1


def test_cpu_attention_never_splits() -> None:
    """Without CUDA the engine's path is the one it always was (the split is a flash-kernel path)."""
    q, k, v = _qkv(MIN_HISTORY, 16)
    auto = causal_attention(q, k, v, MIN_HISTORY, KV_OF_Q, D ** -0.5)
    unsplit = causal_attention(q, k, v, MIN_HISTORY, KV_OF_Q, D ** -0.5, parts=0)
    assert torch.equal(auto, unsplit)


def test_split_table_parts() -> None:
    """A tuned table answers per query-block count; the split's own limits still apply."""
    table = SplitTable((1, 1, 1, 2, 4))
    assert table.parts(128, MIN_HISTORY - 1) == 0  # short history: unsplit
    assert table.parts(4096, MIN_HISTORY) == 0  # a chunk of more than history / 8
    assert table.parts(128, 65536) == 1  # one query block
    assert table.parts(513, 65536) == 4  # five blocks
    assert table.parts(512, 65536) == 2  # four
    assert table.parts(2048, 65536) == 1  # past the table


def test_causal_attention_takes_the_table_only_where_flash_splits() -> None:
    """On CPU the table changes nothing (the split is a flash-kernel path)."""
    q, k, v = _qkv(MIN_HISTORY, 16)
    got = causal_attention(q, k, v, MIN_HISTORY, KV_OF_Q, D ** -0.5, table=SplitTable((4,)))
    assert torch.equal(got, causal_attention(q, k, v, MIN_HISTORY, KV_OF_Q, D ** -0.5, parts=0))


@pytest.mark.parametrize("kv_of_q", [[0, 0, 1, 1], [0, 0, 0, 1, 1]])  # plain GQA, an uneven shard
def test_prepare_runs_on_any_device(kv_of_q: list[int]) -> None:
    """XPAttention prepares the split path when it is built; where it would not split, this runs the SDPA
    path once and there is no table."""
    assert prepare_history_attention(kv_of_q, D, torch.float32, torch.device("cpu")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tuned_table_on_cuda() -> None:
    """Llama-3.1-8B heads in bf16: a table entry per tuned query-block count, each a timed candidate."""
    table = prepare_history_attention([i // 4 for i in range(32)], 128, torch.bfloat16, torch.device("cuda"),
                                      max_history=3 * PART_KEYS)
    assert table is not None and len(table.best) == TUNE_BLOCKS and set(table.best) <= set(TUNE_PARTS)
    assert table.cudnn <= set(range(1, TUNE_BLOCKS + 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("start,chunk", [(PART_KEYS, 128), (PART_KEYS + 3000, 264), (4 * PART_KEYS + 5, 1000)])
def test_cudnn_partitions_equal_unsplit_on_cuda(start: int, chunk: int) -> None:
    """bf16, Llama-3.1-8B heads: cuDNN's fixed partitions merged agree with SDPA's unsplit attention, and
    a table that picks cuDNN routes ``causal_attention`` there."""
    hq, hkv, d = 32, 8, 128
    q, k, v = _qkv(start, chunk, "cuda", torch.bfloat16, hq, hkv, d)
    kv_of_q = [i // (hq // hkv) for i in range(hq)]
    want = causal_attention(q, k, v, start, kv_of_q, d ** -0.5, parts=0).float()
    got = cudnn_history_attention(q, k, v, start, d ** -0.5).float()
    assert (got - want).abs().max().item() < 2e-2
    table = SplitTable((1,) * TUNE_BLOCKS, cudnn=frozenset(range(1, TUNE_BLOCKS + 1)))
    routed = causal_attention(q, k, v, start, kv_of_q, d ** -0.5, table=table).float()
    assert torch.equal(routed, got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("start,chunk", [(PART_KEYS, 8192), (3 * PART_KEYS + 77, 2049), (MIN_HISTORY + 5, 4100)])
def test_long_chunks_in_cudnn_pieces_on_cuda(start: int, chunk: int) -> None:
    """bf16, Llama-3.1-8B heads: a chunk past the table's tiles, routed in pieces through cuDNN, agrees with
    SDPA's unsplit attention."""
    hq, hkv, d = 32, 8, 128
    q, k, v = _qkv(start, chunk, "cuda", torch.bfloat16, hq, hkv, d)
    kv_of_q = [i // (hq // hkv) for i in range(hq)]
    table = SplitTable((1,) * TUNE_BLOCKS, cudnn=frozenset(range(1, TUNE_BLOCKS + 1)))
    assert table.piece(chunk, start)
    want = causal_attention(q, k, v, start, kv_of_q, d ** -0.5, parts=0).float()
    got = causal_attention(q, k, v, start, kv_of_q, d ** -0.5, table=table).float()
    assert (got - want).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("start,chunk,parts", [(20000, 128, 1), (20000, 512, 2), (70000, 256, 4), (3000, 64, 2)])
def test_flash_split_equals_unsplit_on_cuda(start: int, chunk: int, parts: int) -> None:
    """bf16, Llama-3.1-8B heads: the flash partials merged agree with SDPA's unsplit causal attention."""
    hq, hkv, d = 32, 8, 128
    q, k, v = _qkv(start, chunk, "cuda", torch.bfloat16, hq, hkv, d)
    kv_of_q = [i // (hq // hkv) for i in range(hq)]
    want = causal_attention(q, k, v, start, kv_of_q, d ** -0.5, parts=0).float()
    got = causal_attention(q, k, v, start, kv_of_q, d ** -0.5, parts=parts).float()
    assert (got - want).abs().max().item() < 2e-2
