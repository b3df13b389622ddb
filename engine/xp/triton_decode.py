"""Paged decode attention in Triton (GPU path): reads each request's KV blocks in place, once.

The torch path (``ops.decode_attention`` after ``XPKVCache.read_decode``) gathers the blocks into a
padded copy first, so KV crosses HBM three times; this kernel reads it once (flash-decoding)::

    grid (B, H_kv, S): program (b, h, s) takes keys [s * split, (s+1) * split) of request b
      q tile   [G (padded to 16), D]   the G query heads that share kv head h
      per tile of T keys (T / block_size pool blocks, block ids read from the table):
          k, v [T, D] straight from the pool view; online softmax
      -> partial (acc [G, D], m [G], l [G]);  a second small kernel merges the S splits

Programs stop at the request's length (no work on padding). Only plain GQA (q head i reads kv
head i // G) with power-of-two block size and head dim takes this path. ``DecodeKernelConfig``
holds the tile sizes; ``benchmarks/tune_decode_kernel.py`` measures them on a GPU. The kernel is
validated against the torch path on first use by ``XPAttention`` and runs in Triton's
interpreter on CPU for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # Triton ships with CUDA builds of torch; absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    return triton is not None


@dataclass(frozen=True)
class DecodeKernelConfig:
    """Launch shape of the paged decode kernel (defaults: fastest measured on H200, see docs/xp.md)."""

    tile_keys: int = 64  # keys per inner iteration (a multiple of the pool block size is read)
    split_keys: int = 2048  # keys per program (flash-decoding split); rounded to a multiple of tile_keys
    num_warps: int = 4
    num_stages: int = 3


if triton is not None:

    @triton.jit
    def _paged_decode(Q, K, V, BT, LENS, ACC, M, L, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                      stride_btb, stride_ab, stride_ah, stride_as, stride_ag, stride_mb, stride_mh, stride_ms,
                      scale, TILES: tl.constexpr, T: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                      BS: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        length = tl.load(LENS + b)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        offs_t = tl.arange(0, T)
        gmask = offs_g < G
        q = tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                    mask=gmask[:, None], other=0.0)  # [GP, D]
        m_i = tl.full([GP], -1.0e30, tl.float32)  # finite: fully masked splits never make NaNs
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        first = sp * TILES
        last = tl.minimum(first + TILES, tl.cdiv(length, T))  # stop at the request's end
        for i in range(first, last):
            key = i * T + offs_t  # [T] positions
            tmask = key < length
            pb = tl.load(BT + b * stride_btb + key // BS, mask=tmask, other=0).to(tl.int64)
            off = pb[:, None] * stride_kb + (key % BS)[:, None] * stride_kt + h * stride_kh + offs_d[None, :]
            k = tl.load(K + off, mask=tmask[:, None], other=0.0)  # [T, D]
            v = tl.load(V + off, mask=tmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # [GP, T] fp32
            s = tl.where(tmask[None, :], s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.where(tmask[None, :], tl.exp(s - m_new[:, None]), 0.0)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        base = b * stride_ab + h * stride_ah + sp * stride_as
        tl.store(ACC + base + offs_g[:, None] * stride_ag + offs_d[None, :], acc, mask=gmask[:, None])
        mbase = b * stride_mb + h * stride_mh + sp * stride_ms
        tl.store(M + mbase + offs_g, m_i, mask=gmask)
        tl.store(L + mbase + offs_g, l_i, mask=gmask)

    @triton.jit
    def _merge_splits(ACC, M, L, OUT, stride_ab, stride_ah, stride_as, stride_ag, stride_mb, stride_mh, stride_ms,
                      stride_ob, stride_oh, S, SP: tl.constexpr, G: tl.constexpr, D: tl.constexpr):
        """out[b, h*G + g] = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max m) (one program per (b, h, g))."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.program_id(2)
        offs_s = tl.arange(0, SP)
        offs_d = tl.arange(0, D)
        smask = offs_s < S
        mb = b * stride_mb + h * stride_mh + g
        m = tl.load(M + mb + offs_s * stride_ms, mask=smask, other=-1.0e30)  # [SP]
        l = tl.load(L + mb + offs_s * stride_ms, mask=smask, other=0.0)
        w = tl.where(smask, tl.exp(m - tl.max(m, 0)), 0.0)  # splits past the end: m = -1e30 -> 0
        ab = b * stride_ab + h * stride_ah + g * stride_ag
        acc = tl.load(ACC + ab + offs_s[:, None] * stride_as + offs_d[None, :], mask=smask[:, None], other=0.0)
        o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)  # [D]
        tl.store(OUT + b * stride_ob + (h * G + g) * stride_oh + offs_d, o.to(OUT.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, k_view: torch.Tensor, v_view: torch.Tensor, table: torch.Tensor,
                           lengths: torch.Tensor, scale: float, max_blocks: int,
                           config: DecodeKernelConfig = DecodeKernelConfig()) -> torch.Tensor:
    """q [B, hq, D]; k/v_view [num_blocks, bs, hkv, D] (pool views, last two dims contiguous);
    table [B, >= max_blocks] block ids; lengths [B] valid keys -> [B, hq, D] in q's dtype."""
    b, hq, d = q.shape
    bs, hkv = k_view.shape[1], k_view.shape[2]
    g = hq // hkv
    max_keys = max_blocks * bs
    tile = max(bs, min(config.tile_keys, triton.next_power_of_2(max_keys)))  # >= one pool block
    tiles = max(1, min(-(-max_keys // tile), config.split_keys // tile))  # tiles per program
    splits = -(-max_keys // (tiles * tile))
    acc = torch.empty(b, hkv, splits, g, d, dtype=torch.float32, device=q.device)
    m = torch.empty(b, hkv, splits, g, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    q = q.contiguous()
    _paged_decode[(b, hkv, splits)](
        q, k_view, v_view, table, lengths, acc, m, l, q.stride(0), q.stride(1), k_view.stride(0),
        k_view.stride(1), k_view.stride(2), table.stride(0), acc.stride(0), acc.stride(1), acc.stride(2),
        acc.stride(3), m.stride(0), m.stride(1), m.stride(2), scale, TILES=tiles, T=tile,
        G=g, GP=max(16, triton.next_power_of_2(g)), BS=bs, D=d,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",  # fp32: no TF32 rounding (16-bit: no-op)
        num_warps=config.num_warps, num_stages=config.num_stages)
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    _merge_splits[(b, hkv, g)](
        acc, m, l, out, acc.stride(0), acc.stride(1), acc.stride(2), acc.stride(3), m.stride(0), m.stride(1),
        m.stride(2), out.stride(0), out.stride(1), splits, SP=triton.next_power_of_2(splits), G=g, D=d)
    return out
