"""XP attention on CUDA (NCCL between GPUs, decode side stream, Triton paged decode): same check
as test_xp_attention.py with Llama-like GQA (32 q / 8 kv heads). Skipped without a GPU."""

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
from conflux_cluster.engine.xp import paged_prefill

from .random_plans import PlanReq, random_plans

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HQ, HKV, D, LAYERS, BLOCK, BLOCKS = 32, 8, 64, 2, 16, 256


def _reqs() -> list[PlanReq]:
    return [PlanReq(f"r{i}", n, 3, arrive_step=i) for i, n in enumerate([70, 9, 130, 33])]


def _run(rank: int, rdv: Rendezvous | None, n: int, mode: str, dtype: torch.dtype = torch.float32) -> None:
    """One rank's check; always leaves the process group, so the child exits cleanly."""
    with leaving_group():
        _check(rank, rdv, n, mode, dtype)


def _check(rank: int, rdv: Rendezvous | None, n: int, mode: str, dtype: torch.dtype) -> None:
    """``dtype`` bf16: the KV pool and q/k/v in bf16, where the chunks take the FlashInfer paged kernel."""
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    if rdv is not None:
        join_group(rdv, rank)
    groups = XPGroups.create(n, 1) if rdv is not None else XPGroups.single()
    heads = DeviceHeads.build(HQ, HKV, n, rank=rank)
    kv = XPKVCache(LAYERS, BLOCKS, BLOCK, heads.num_kv, heads.sp_shard.num_kv, D, dtype, dev)
    tol = 2e-2 if dtype == torch.float32 else 6e-2
    attn = XPAttention(heads, kv, groups, D ** -0.5, XPMode(mode))
    g = torch.Generator().manual_seed(0)
    data = {r.rid: [torch.randn(LAYERS, r.prompt_len + 3, h, D, generator=g) for h in (HQ, HKV, HKV)]
            for r in _reqs()}
    dec_pos = {r.rid: r.prompt_len for r in _reqs()}
    for plan in random_plans(3, n, _reqs(), max_chunk=40):
        meta = build_step_meta(plan, rank, mode == "uniform-sp",
                               {rid: kv.prefill_len(rid) for ids in plan.decode for rid in ids})
        attn.begin_step(meta)
        toks = [(s.request_id, p) for s in plan.prefill if s.rank == rank for p in range(s.start, s.end)]
        toks += [(rid, dec_pos[rid]) for rid in plan.decode[rank]]
        for layer in range(LAYERS):
            qkv = [torch.stack([data[r][j][layer, p] for r, p in toks]) if toks else torch.empty(0, h, D)
                   for j, h in enumerate((HQ, HKV, HKV))]
            out = attn(layer, *(t.to(dev, dtype) for t in qkv), meta).float().cpu()
            for i, (rid, p) in enumerate(toks):
                q, k, v = (t[layer].to(dtype).float() for t in data[rid])
                kk = k[: p + 1].repeat_interleave(HQ // HKV, 1)
                w = torch.einsum("hd,shd->hs", q[p], kk) * D ** -0.5
                ref = torch.einsum("hs,shd->hd", w.softmax(-1), v[: p + 1].repeat_interleave(HQ // HKV, 1))
                err = (out[i] - ref).abs().max().item()
                assert err < tol, f"rank {rank} step {plan.step} {rid}@{p}: err {err}"
        attn.end_step(meta)
        for ids in plan.decode:
            for rid in ids:
                dec_pos[rid] += 1
    assert kv.num_free_blocks == BLOCKS
    if dtype == torch.bfloat16 and paged_prefill.available():
        assert attn.prefill_kernel == "flashinfer", "the paged prefill kernel fell back to torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["xp", "uniform-sp"])
def test_xp_attention_cuda(mode: str, dtype: torch.dtype) -> None:
    n = min(2, torch.cuda.device_count())
    if n == 1:
        _run(0, None, 1, mode, dtype)
        return
    store, rdv = host_store(n, "nccl")
    mp.spawn(_run, args=(rdv, n, mode, dtype), nprocs=n, join=True)
    del store
