"""Paged decode attention in Triton (GPU path): reads each request's KV blocks in place, once.

The torch path (``ops.decode_attention`` after ``XPKVCache.read_decode``) gathers the blocks into a
padded copy first, so KV crosses HBM three times; this kernel reads it once (flash-decoding)::

    grid (B, H_kv, S): program (b, h, s) takes blocks [s * per_split, (s+1) * per_split) of request b
      q tile   [G (padded to 16), D]   the G query heads that share kv head h
      for each block: k, v [block_size, D] straight from the pool view via block_table[b]
      online softmax -> partial (acc [G, D], m [G], l [G]); splits merged in torch (small)

Only plain GQA (q head i reads kv head i // G) and block_size >= 16 take this path. The kernel
is validated against the torch path on first use by ``XPAttention`` and runs in Triton's
interpreter on CPU for tests.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _paged_decode(Q, K, V, BT, LENS, ACC, M, L, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                      stride_btb, stride_ab, stride_ah, stride_as, stride_ag, stride_mb, stride_mh, stride_ms,
                      scale, PER_SPLIT: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        length = tl.load(LENS + b)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        offs_t = tl.arange(0, BS)
        gmask = offs_g < G
        q = tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                    mask=gmask[:, None], other=0.0)  # [GP, D]
        m_i = tl.full([GP], -1.0e30, tl.float32)  # finite: fully masked blocks never make NaNs
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for i in range(0, PER_SPLIT):
            blk = sp * PER_SPLIT + i
            tmask = (blk * BS + offs_t) < length  # also false for blocks past the request's end
            pb = tl.load(BT + b * stride_btb + blk, mask=blk * BS < length, other=0).to(tl.int64)
            off = pb * stride_kb + offs_t[:, None] * stride_kt + h * stride_kh + offs_d[None, :]
            k = tl.load(K + off, mask=tmask[:, None], other=0.0)  # [BS, D]
            v = tl.load(V + off, mask=tmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # [GP, BS] fp32
            s = tl.where(tmask[None, :], s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.where(tmask[None, :], tl.exp(s - m_new[:, None]), 0.0)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        base = b * stride_ab + h * stride_ah + sp * stride_as
        tl.store(ACC + base + offs_g[:, None] * stride_ag + offs_d[None, :], acc, mask=gmask[:, None])
        mbase = b * stride_mb + h * stride_mh + sp * stride_ms
        tl.store(M + mbase + offs_g, m_i, mask=gmask)
        tl.store(L + mbase + offs_g, l_i, mask=gmask)


def paged_decode_attention(q: torch.Tensor, k_view: torch.Tensor, v_view: torch.Tensor, table: torch.Tensor,
                           lengths: torch.Tensor, scale: float, max_blocks: int) -> torch.Tensor:
    """q [B, hq, D]; k/v_view [num_blocks, bs, hkv, D] (pool views, last two dims contiguous);
    table [B, >= max_blocks] block ids; lengths [B] valid keys -> [B, hq, D]."""
    b, hq, d = q.shape
    bs, hkv = k_view.shape[1], k_view.shape[2]
    g = hq // hkv
    # ~512 keys per program: thousands of balanced programs for long contexts; a power of two
    # (constexpr loop bound) keeps the number of compiled variants small
    per_split = min(triton.next_power_of_2(max_blocks), max(1, 512 // bs))
    splits = -(-max_blocks // per_split)
    acc = torch.empty(b, hkv, splits, g, d, dtype=torch.float32, device=q.device)
    m = torch.empty(b, hkv, splits, g, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    q = q.contiguous()
    _paged_decode[(b, hkv, splits)](
        q, k_view, v_view, table, lengths, acc, m, l, q.stride(0), q.stride(1), k_view.stride(0),
        k_view.stride(1), k_view.stride(2), table.stride(0), acc.stride(0), acc.stride(1), acc.stride(2),
        acc.stride(3), m.stride(0), m.stride(1), m.stride(2), scale, PER_SPLIT=per_split,
        G=g, GP=max(16, triton.next_power_of_2(g)), BS=bs, D=d)
    w = torch.exp(m - m.amax(dim=2, keepdim=True))  # [B, hkv, S, G]; empty splits (m = -1e30) -> 0
    out = (acc * w[..., None]).sum(2) / (l * w).sum(2)[..., None]  # [B, hkv, G, D]
    return out.reshape(b, hq, d).to(q.dtype)
