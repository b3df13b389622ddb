"""Paged decode attention in Triton (GPU path): reads each request's KV blocks in place, once.

The torch path (``ops.decode_attention`` after ``XPKVCache.read_decode``) gathers the blocks into a
padded copy first, so KV crosses HBM three times; this kernel reads it once (flash-decoding)::

    work items: (b, s) for every split s of every request b (splits of ``split`` keys, or shorter
                ones where ``min_splits`` asks a short request for more; host-built)
    grid (P, H_kv): program (p, h) takes items p, p + P, p + 2P, ...; for item (b, s):
      q tile   [G (padded to 16), D]   the G query heads that share kv head h
      per tile of T keys (T / block_size pool blocks, block ids read from the table):
          k, v [T, D] straight from the pool view; online softmax
      -> partial (acc [G, D], m [G], l [G]) in row w of the partial buffers (w: the item's index);
         a second small kernel merges a request's splits in order (they are consecutive items)

A work list, not a grid over (request, split): a batch mixing one 128K-token request with short
ones keeps every program busy, and no program is launched for splits past a request's end (a
CUDA graph captured for the longest context would otherwise launch thousands of empty ones). A
split's keys and the merge's order depend on the request alone, so results do not depend on the
batch, the table width or the grid. Only plain GQA (q head i reads kv
head i // G) with power-of-two block size and head dim takes this path. ``DecodeKernelConfig``
holds the tile sizes; ``python -m benchmarks.steps decode-kernel`` measures them on a GPU. The kernel is
validated against the torch path on first use by ``XPAttention`` and runs in Triton's
interpreter on CPU for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..util.transfer import to_device

try:  # Triton ships with CUDA builds of torch; absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    return triton is not None


@dataclass(frozen=True)
class DecodeKernelConfig:
    """Launch shape of the paged decode kernel (defaults: fastest measured on H200, min_splits on an H100;
    see docs/xp.md)."""

    tile_keys: int = 64  # keys per inner iteration (a multiple of the pool block size is read)
    split_keys: int = 2048  # keys per work item (flash-decoding split); rounded to a multiple of tile_keys
    num_warps: int = 4
    num_stages: int = 3
    programs: int = 1024  # programs per launch (over kv heads and work items), at most one per item
    # 0: every split holds split_keys keys. k > 0: a request whose context would make fewer than k splits
    # gets k shorter ones (whole tiles), so a small batch of short contexts gives the SMs more programs;
    # the split length depends on the request's own length only, so its keys' order does not depend on
    # its batch
    min_splits: int = 8

    def programs_for(self, num_items: int, num_kv_heads: int) -> int:
        """Grid size along the work items: ``programs`` over the kv heads, at most one per item."""
        return max(1, min(num_items, self.programs // num_kv_heads))

    def split_len(self, block_size: int) -> int:
        """Keys per split (the longest split, ``min_splits`` aside): a multiple of the tile, itself at
        least one pool block."""
        tile = max(block_size, self.tile_keys)
        return max(1, self.split_keys // tile) * tile

    def splits_of(self, num_keys: int, block_size: int) -> int:
        """Work items of a request with ``num_keys`` keys (the kernels' rule, ``_tiles_per_split_host``)."""
        tile = max(block_size, self.tile_keys)
        return _splits_host(num_keys, tile, self.split_len(block_size) // tile, self.min_splits)


def _splits_host(num_keys: int, tile: int, max_tiles: int, min_splits: int) -> int:
    """Work items of a request with ``num_keys`` keys in tiles of ``tile`` keys (``splits_of`` with its
    per-config constants given, so a step's loop computes them once)."""
    tiles = -(-num_keys // tile)
    return -(-tiles // _tiles_per_split_host(tiles, max_tiles, min_splits))


def _tiles_per_split_host(tiles: int, max_tiles: int, min_splits: int) -> int:
    """Tiles in each split of a request of ``tiles`` tiles: ``max_tiles``, or fewer so that it makes at
    least ``min_splits`` splits (0: no minimum); at least one. The kernels' ``_short_split``."""
    if min_splits <= 0:
        return max_tiles
    return max(1, min(max_tiles, -(-tiles // min_splits)))


_ITEM_B = 1 << 16  # a work item is b * _ITEM_B + s (s < 65536 splits: contexts up to 134M keys at 2048)


@dataclass(frozen=True)
class DecodeWork:
    """A decode batch's split list on the device (the same for every layer of a step)."""

    items: torch.Tensor  # [>= num_items] int64: b * 65536 + s, request by request, splits in order
    count: torch.Tensor  # [1] int64: num_items on the device (a CUDA graph reads it at replay)
    first: torch.Tensor  # [B] int64: index of request b's first item (its splits follow it)
    num_items: int
    programs: int  # grid size along the items (P)
    capacity: int  # rows of the partial-result buffers (>= num_items)


def decode_work(lengths: list[int], block_size: int, num_kv_heads: int, config: DecodeKernelConfig,
                device: torch.device) -> DecodeWork:
    """The work list of requests with ``lengths`` keys (built on the host, one asynchronous copy)."""
    items, first = [], []
    tile = max(block_size, config.tile_keys)  # splits_of's constants, once per step
    max_tiles, min_splits = config.split_len(block_size) // tile, config.min_splits
    for b, n in enumerate(lengths):
        first.append(len(items))
        items += [b * _ITEM_B + s for s in range(_splits_host(n, tile, max_tiles, min_splits))]
    programs = config.programs_for(len(items), num_kv_heads)
    vec = to_device([len(items), *first, *(items or [0])], device)  # [count | first | items]
    b = len(lengths)
    return DecodeWork(vec[1 + b:], vec[:1], vec[1:1 + b], len(items), programs, max(1, len(items)))


if triton is not None:

    @triton.jit
    def _short_split(tiles, MAX_TILES: tl.constexpr, MIN_SPLITS: tl.constexpr):
        """``_tiles_per_split_host`` on the device, for MIN_SPLITS > 0 (the kernels use MAX_TILES at 0)."""
        return tl.maximum(tl.minimum(tl.cdiv(tiles, MIN_SPLITS), MAX_TILES), 1)

    # the block table's row stride is its width, the longest request's blocks in this step: specializing
    # on it (== 1, a multiple of 16) compiled a new kernel mid-serving, a 0.8 s step on an H200
    @triton.jit(do_not_specialize=["stride_btb"])
    def _paged_decode(Q, K, V, BT, LENS, WORK, NWORK, ACC, M, L, stride_qb, stride_qh, stride_kb, stride_kt,
                      stride_kh, stride_btb, stride_aw, stride_ah, stride_ag, stride_mw, stride_mh, scale, TILES: tl.constexpr, T: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                      BS: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, ITEM_B: tl.constexpr,
                      MIN_SPLITS: tl.constexpr):
        pid = tl.program_id(0)
        h = tl.program_id(1)
        nprog = tl.num_programs(0)
        n_work = tl.load(NWORK)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        offs_t = tl.arange(0, T)
        gmask = offs_g < G
        for w in range(pid, n_work, nprog):
            item = tl.load(WORK + w)
            b = item // ITEM_B
            sp = item % ITEM_B
            length = tl.load(LENS + b)
            q = tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                        mask=gmask[:, None], other=0.0)  # [GP, D]
            m_i = tl.full([GP], -1.0e30, tl.float32)  # finite: masked keys never make NaNs
            l_i = tl.zeros([GP], tl.float32)
            acc = tl.zeros([GP, D], tl.float32)
            n_tiles = tl.cdiv(length, T)
            if MIN_SPLITS == 0:  # compile-time: the fixed splits' code exactly
                per = TILES
            else:
                per = _short_split(n_tiles, TILES, MIN_SPLITS)
            first = sp * per
            last = tl.minimum(first + per, n_tiles)  # stop at the request's end
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
            base = w * stride_aw + h * stride_ah
            tl.store(ACC + base + offs_g[:, None] * stride_ag + offs_d[None, :], acc, mask=gmask[:, None])
            mbase = w * stride_mw + h * stride_mh
            tl.store(M + mbase + offs_g, m_i, mask=gmask)
            tl.store(L + mbase + offs_g, l_i, mask=gmask)

    @triton.jit
    def _merge_splits(ACC, M, L, OUT, LENS, FIRST, stride_aw, stride_ah, stride_ag, stride_mw, stride_mh,
                      stride_ob, stride_oh, T: tl.constexpr, TILES: tl.constexpr, MIN_SPLITS: tl.constexpr,
                      G: tl.constexpr, D: tl.constexpr):
        """out[b, h*G + g] = sum_s w_s acc_s / sum_s w_s l_s, w_s = exp(m_s - max m), over request b's
        splits in order (one program per (b, h, g); a request without keys gets zeros)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.program_id(2)
        offs_d = tl.arange(0, D)
        n_tiles = tl.cdiv(tl.load(LENS + b), T)
        if MIN_SPLITS == 0:
            n = tl.cdiv(n_tiles, TILES)
        else:
            n = tl.cdiv(n_tiles, _short_split(n_tiles, TILES, MIN_SPLITS))
        w0 = tl.load(FIRST + b)
        mb = h * stride_mh + g
        m_max = tl.full([], -1.0e30, tl.float32)
        for s in range(0, n):
            m_max = tl.maximum(m_max, tl.load(M + (w0 + s) * stride_mw + mb))
        o = tl.zeros([D], tl.float32)
        den = tl.zeros([], tl.float32)
        ab = h * stride_ah + g * stride_ag
        for s in range(0, n):
            w = tl.exp(tl.load(M + (w0 + s) * stride_mw + mb) - m_max)
            o += w * tl.load(ACC + (w0 + s) * stride_aw + ab + offs_d)
            den += w * tl.load(L + (w0 + s) * stride_mw + mb)
        o = tl.where(den > 0, o / den, 0.0)
        tl.store(OUT + b * stride_ob + (h * G + g) * stride_oh + offs_d, o.to(OUT.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, k_view: torch.Tensor, v_view: torch.Tensor, table: torch.Tensor,
                           lengths: torch.Tensor, scale: float, work: DecodeWork | None = None,
                           config: DecodeKernelConfig = DecodeKernelConfig()) -> torch.Tensor:
    """q [B, hq, D]; k/v_view [num_blocks, bs, hkv, D] (pool views, last two dims contiguous);
    table [B, >= blocks of the longest request] block ids; lengths [B] valid keys;
    work: ``decode_work`` of these lengths (None: built here, which reads ``lengths`` back to the host)
    -> [B, hq, D] in q's dtype."""
    b, hq, d = q.shape
    bs, hkv = k_view.shape[1], k_view.shape[2]
    g = hq // hkv
    if work is None:
        work = decode_work(lengths.tolist(), bs, hkv, config, q.device)
    tile = max(bs, config.tile_keys)
    split = config.split_len(bs)
    acc = torch.empty(work.capacity, hkv, g, d, dtype=torch.float32, device=q.device)  # one row per work item
    m = torch.empty(work.capacity, hkv, g, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    q = q.contiguous()
    _paged_decode[(work.programs, hkv)](
        q, k_view, v_view, table, lengths, work.items, work.count, acc, m, l, q.stride(0), q.stride(1),
        k_view.stride(0), k_view.stride(1), k_view.stride(2), table.stride(0), acc.stride(0), acc.stride(1),
        acc.stride(2), m.stride(0), m.stride(1), scale, TILES=split // tile, T=tile,
        G=g, GP=max(16, triton.next_power_of_2(g)), BS=bs, D=d,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",  # fp32: no TF32 rounding (16-bit: no-op)
        ITEM_B=_ITEM_B, MIN_SPLITS=config.min_splits, num_warps=config.num_warps, num_stages=config.num_stages)
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    _merge_splits[(b, hkv, g)](
        acc, m, l, out, lengths, work.first, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        out.stride(0), out.stride(1), T=tile, TILES=split // tile, MIN_SPLITS=config.min_splits, G=g, D=d)
    return out
