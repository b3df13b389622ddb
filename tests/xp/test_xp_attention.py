"""XP attention across real gloo processes (N = 1..4) against single-process attention.

Random q/k/v per (request, position, layer); random plans with uneven/empty rank slices,
chunked prompts, transitions to random decode ranks and decodes running alongside. Every
device's output for its own tokens must equal plain causal GQA attention over the request's
full sequence, and every pool must be entirely free at the end.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from conflux_cluster.engine.xp.attention import XPAttention
from conflux_cluster.engine.xp.comm import XPGroups
from conflux_cluster.engine.xp.heads import DeviceHeads
from conflux_cluster.engine.xp.kv import XPKVCache
from conflux_cluster.engine.contracts.step import Rendezvous
from conflux_cluster.engine.xp.launch import host_store, join_group, leaving_group
from conflux_cluster.engine.xp.meta import build_step_meta
from conflux_cluster.engine.xp.modes import XPMode

from .random_plans import PlanReq, random_plans

HQ, HKV, D, LAYERS, BLOCK, BLOCKS = 9, 3, 8, 2, 4, 96


def _requests(seed: int) -> list[PlanReq]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 60, (5,), generator=g).tolist()
    return [PlanReq(f"r{i}", n, 1 + i % 3, arrive_step=2 * i) for i, n in enumerate(lens)]


def _data(seed: int, reqs: list[PlanReq]) -> dict[str, tuple[torch.Tensor, ...]]:
    """rid -> (Q [L, S, HQ, D], K [L, S, HKV, D], V [L, S, HKV, D])."""
    out = {}
    for i, r in enumerate(reqs):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        s = r.prompt_len + r.decode_steps
        out[r.rid] = (torch.randn(LAYERS, s, HQ, D, generator=g), torch.randn(LAYERS, s, HKV, D, generator=g),
                      torch.randn(LAYERS, s, HKV, D, generator=g))
    return out


def _reference(data, rid: str, layer: int, pos: int) -> torch.Tensor:
    """Plain causal GQA attention of token ``pos``: [HQ, D]."""
    q, k, v = (t[layer] for t in data[rid])
    kk = k[: pos + 1].repeat_interleave(HQ // HKV, dim=1)  # [pos+1, HQ, D]
    vv = v[: pos + 1].repeat_interleave(HQ // HKV, dim=1)
    w = torch.einsum("hd,shd->hs", q[pos], kk) * D ** -0.5
    return torch.einsum("hs,shd->hd", w.softmax(-1), vv)


def _run(rank: int, rdv: Rendezvous | None, num_ranks: int, seed: int, mode: str) -> None:
    """One rank's check; always leaves the process group, so the child exits cleanly."""
    with leaving_group():
        _check(rank, rdv, num_ranks, seed, mode)


def _check(rank: int, rdv: Rendezvous | None, num_ranks: int, seed: int, mode: str) -> None:
    torch.set_num_threads(1)
    if rdv is not None:
        join_group(rdv, rank)
        groups = XPGroups.create(num_ranks, 1)
    else:
        groups = XPGroups.single()
    uniform_sp = mode == XPMode.UNIFORM_SP.value
    heads = DeviceHeads.build(HQ, HKV, num_ranks, rank=rank)
    kv = XPKVCache(LAYERS, BLOCKS, BLOCK, heads.num_kv, heads.sp_shard.num_kv, D)
    attn = XPAttention(heads, kv, groups, D ** -0.5, XPMode(mode))
    reqs = _requests(seed)
    data = _data(seed, reqs)
    plans = random_plans(seed, num_ranks, _requests(seed))
    dec_pos = {r.rid: r.prompt_len for r in reqs}  # next decode position per request
    for plan in plans:
        pos = {rid: kv.prefill_len(rid) for ids in plan.decode for rid in ids}
        meta = build_step_meta(plan, rank, uniform_sp, pos)
        attn.begin_step(meta)
        toks = [(s.request_id, p) for s in plan.prefill if s.rank == rank for p in range(s.start, s.end)]
        toks += [(rid, dec_pos[rid]) for rid in plan.decode[rank]]
        for layer in range(LAYERS):
            q = torch.stack([data[r][0][layer, p] for r, p in toks]) if toks else torch.empty(0, HQ, D)
            k = torch.stack([data[r][1][layer, p] for r, p in toks]) if toks else torch.empty(0, HKV, D)
            v = torch.stack([data[r][2][layer, p] for r, p in toks]) if toks else torch.empty(0, HKV, D)
            out = attn(layer, q, k, v, meta)
            for i, (rid, p) in enumerate(toks):
                ref = _reference(data, rid, layer, p)
                err = (out[i] - ref).abs().max().item()
                assert err < 1e-5, f"rank {rank} step {plan.step} layer {layer} {rid}@{p}: err {err}"
        attn.end_step(meta)
        for ids in plan.decode:
            for rid in ids:
                dec_pos[rid] += 1
    assert kv.num_free_blocks == BLOCKS and not kv.prefill and not kv.decode, (
        f"rank {rank}: {BLOCKS - kv.num_free_blocks} KV blocks still held")


def _launch(num_ranks: int, seed: int, mode: str) -> None:
    if num_ranks == 1:
        _run(0, None, 1, seed, mode)
        return
    store, rdv = host_store(num_ranks, "gloo")
    mp.spawn(_run, args=(rdv, num_ranks, seed, mode), nprocs=num_ranks, join=True)
    del store


@pytest.mark.parametrize("num_ranks", [1, 2, 4])  # N=3: uniform-sp below and the engine tests
def test_xp_attention_matches_reference(num_ranks: int) -> None:
    _launch(num_ranks, seed=10 + num_ranks, mode="xp")


def test_uniform_sp_attention_matches_reference() -> None:
    _launch(3, seed=7, mode="uniform-sp")
