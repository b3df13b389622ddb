"""The Triton paged decode kernel equals the torch gather path (Triton's interpreter on CPU;
skipped where Triton is not installed, e.g. CPU-only torch)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = textwrap.dedent('''
    import dataclasses
    import torch
    from conflux_cluster.engine.xp import triton_decode as td
    from conflux_cluster.engine.xp.ops import decode_attention
    import os
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    torch.set_default_device(dev)
    torch.manual_seed(0)
    B, hq, hkv, D, bs, NB = 3, 8, 2, 16, 16, 20
    pool_k, pool_v = torch.randn(NB, bs * hkv * D + 7), torch.randn(NB, bs * hkv * D + 7)  # aliased rows
    kv = pool_k[:, : bs * hkv * D].view(NB, bs, hkv, D)
    vv = pool_v[:, : bs * hkv * D].view(NB, bs, hkv, D)
    lens = torch.tensor([5, 40, 33])
    table = torch.tensor([[3, 0, 0], [7, 1, 12], [19, 4, 2]])
    q = torch.randn(B, hq, D)
    kp, vp = kv[table].reshape(B, 3 * bs, hkv, D), vv[table].reshape(B, 3 * bs, hkv, D)
    ref = decode_attention(q, kp, vp, lens, [i // (hq // hkv) for i in range(hq)], D ** -0.5)
    # one tile per program (many splits), tiles of several pool blocks, one split per request
    # and (min_splits) shorter splits for short contexts: 40 keys in 3 splits of one tile, or 2 of two
    # (the default config: min_splits 8, tiles of 64 keys, so one split per request of these lengths)
    splits = {td.DecodeKernelConfig(16, 64, min_splits=3): [1, 3, 3], td.DecodeKernelConfig(16, 1024, min_splits=2):
              [1, 2, 2], td.DecodeKernelConfig(16, 1024, min_splits=8): [1, 3, 3], td.DecodeKernelConfig(): [1, 1, 1]}
    for cfg in (td.DecodeKernelConfig(16, 16, min_splits=0), td.DecodeKernelConfig(32, 32, min_splits=0),
                td.DecodeKernelConfig(64, 1024, min_splits=0), *splits):
        out = td.paged_decode_attention(q, kv, vv, table, lens, D ** -0.5, config=cfg)
        err = (out - ref).abs().max().item()
        assert err < (1e-4 if dev == "cpu" else 3e-3), (cfg, err)  # GPU: TF32 if the IEEE request is ignored
        # a wider table (a CUDA graph's, sized for the longest context) sums the same keys in the same order
        wide = torch.cat([table, torch.zeros(B, 9, dtype=table.dtype)], 1)
        assert torch.equal(td.paged_decode_attention(q, kv, vv, wide, lens, D ** -0.5, config=cfg), out), cfg
        # fewer programs than work items (each takes several splits), and a padding row without keys
        few = dataclasses.replace(cfg, programs=2)
        assert torch.equal(td.paged_decode_attention(q, kv, vv, table, lens, D ** -0.5, config=few), out), cfg
        pad = td.paged_decode_attention(torch.cat([q, q[:1]]), kv, vv, torch.cat([table, table[:1]]),
                                        torch.cat([lens, torch.zeros(1, dtype=lens.dtype)]), D ** -0.5, config=cfg)
        assert torch.equal(pad[:B], out) and not pad[B].any(), cfg
        # a request's result does not depend on its batch (its splits follow from its own length)
        alone = td.paged_decode_attention(q[1:2], kv, vv, table[1:2], lens[1:2], D ** -0.5, config=cfg)
        assert torch.equal(alone[0], out[1]), cfg
        if cfg.min_splits:
            assert [cfg.splits_of(n, bs) for n in (5, 40, 33)] == splits[cfg], cfg
    print("ok", err)
''')


def test_paged_decode_kernel_matches_torch() -> None:
    env = dict(os.environ, TRITON_F32_DEFAULT="ieee")  # fp32 dots (GPU default: TF32)
    env.setdefault("TRITON_INTERPRET", "0" if _has_cuda() else "1")
    r = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


CHECK_KV = textwrap.dedent('''
    import os
    import torch
    from conflux_cluster.engine.xp import triton_kv
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    torch.manual_seed(0)
    NB, bs, h, D, T = 9, 8, 3, 16, 21
    pool_k = torch.zeros(NB, bs * h * D + 5, device=dev)  # leftover elements per block, as in aliasing
    pool_v = torch.zeros_like(pool_k)
    kv = pool_k[:, : bs * h * D].view(NB, bs, h, D)
    vv = pool_v[:, : bs * h * D].view(NB, bs, h, D)
    slot = torch.randperm(NB * bs, device=dev)[:T]  # distinct slots
    blocks, offsets = slot // bs, slot % bs
    k, v = torch.randn(T, h, D, device=dev), torch.randn(T, h, D, device=dev)
    want_k, want_v = kv.clone(), vv.clone()
    want_k[blocks, offsets], want_v[blocks, offsets] = k, v
    triton_kv.scatter_kv(kv, vv, triton_kv.row_offsets(kv, blocks, offsets), k, v)
    assert torch.equal(kv, want_k) and torch.equal(vv, want_v)
    assert torch.equal(pool_k[:, bs * h * D:], torch.zeros(NB, 5, device=dev))  # leftovers untouched
    rows = triton_kv.row_offsets(kv, blocks, offsets)
    rows[::2] = -1  # padding rows of a CUDA graph's batch: not written
    triton_kv.scatter_kv(kv, vv, rows, 2 * k, 2 * v)
    want_k[blocks[1::2], offsets[1::2]] = 2 * k[1::2]
    assert torch.equal(kv, want_k)
    print("ok")
''')


def test_kv_row_scatter_matches_index_put() -> None:
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "0" if _has_cuda() else "1")
    r = subprocess.run([sys.executable, "-c", CHECK_KV], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
