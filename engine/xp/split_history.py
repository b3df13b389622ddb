"""Prefill attention of a short chunk over a long history, split along the history (split-KV).

Served steps that ran a few hundred prompt tokens over a 40-80K-token history reached ~10 % of
the FLOP roofline in attention. SDPA refuses its flash kernel for a causal mask with more keys than
queries unless the kv heads are expanded, and the path it then takes is slow. Here the history
is attended without a mask, in P equal parts (a batch of P calls), and the chunk over its own keys
with a bottom-right causal mask; the partial results are merged with their log-sum-exps, as
flash-decoding does for one query:

    keys [0, P·L)          P partitions of L keys, every query sees all of them (no mask)
    keys [P·L, start + T)  the history's remainder and the chunk: causal, bottom-right aligned
    o = Σ_i exp(lse_i − m) · o_i / Σ_i exp(lse_i − m),  m = max_i lse_i

On CUDA the partials come from torch's flash kernel (which returns the log-sum-exp and takes GQA
keys as they are); elsewhere from plain math (the tests hold the merge to the unsplit attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..cuda_timing import median_seconds

QUERY_BLOCK = 128  # queries per flash thread block (FA2, head_dim 128)
MIN_HISTORY = 16384  # shorter histories ran slower split (the merge's launches cost more than they save)
MAX_CHUNK_SHARE = 8  # split only a chunk of at most history / 8 tokens (larger ones ran as fast unsplit)


def history_splits(chunk: int, history: int, q_heads: int, sms: int) -> int:
    """How many partitions to split ``history`` into for a ``chunk``-token query; 0: do not split.
    The static rule, where no ``SplitTable`` was tuned on the device.

    Measured on an H200 (docs/xp.md, "Split-history prefill attention"): the unmasked history call is
    what pays, one partition is within ~10 % of the best count everywhere, and two partitions help
    where the chunk's thread blocks fill between half and all of the SMs."""
    if not splits(chunk, history):
        return 0
    blocks = math.ceil(chunk / QUERY_BLOCK) * q_heads
    return 2 if sms / 2 < blocks < sms else 1


def splits(chunk: int, history: int) -> bool:
    """Whether a ``chunk`` over ``history`` keys takes the split path at all."""
    return history >= MIN_HISTORY and chunk * MAX_CHUNK_SHARE <= history


@dataclass(frozen=True)
class SplitTable:
    """The partition count per query-block count, timed on this device for this rank's heads (``tune``).

    Which count is fastest depends on how the chunk's thread blocks (query blocks × heads × parts)
    fill the SMs in waves, which a static rule got wrong by up to 1.4× (one H200, 2026-12-03: a
    264-token chunk over a 64K history took 1.92 ms per layer with the rule's two partitions and
    1.47 ms with one; a 520-token chunk 3.28 ms with one and 2.35 ms with four). Query-block counts
    past the table take one partition (their blocks fill the SMs in several waves already)."""

    best: tuple[int, ...]  # best[i]: partitions for i + 1 query blocks

    def parts(self, chunk: int, history: int) -> int:
        if not splits(chunk, history):
            return 0
        qb = math.ceil(chunk / QUERY_BLOCK)
        return self.best[qb - 1] if qb <= len(self.best) else 1


TUNE_HISTORY = 32768  # keys per timed call: long enough that the history call dominates, 128 MiB of bf16 KV
TUNE_BLOCKS = 16  # query-block counts tuned (chunks of up to 2,048 tokens)
TUNE_PARTS = (1, 2, 4)


def tune(kv_of_q: list[int], head_dim: int, dtype: torch.dtype, device: torch.device,
         repeats: int = 3) -> SplitTable:
    """Time each of ``TUNE_PARTS`` for 1..``TUNE_BLOCKS`` query blocks over a ``TUNE_HISTORY``-key
    history (this rank's heads, CUDA events, median of ``repeats`` after one warm call each) and keep
    the fastest: 192 calls of 0.6-3.7 ms each on an H200 (under a second, not timed on its own)."""
    hq, hkv = len(kv_of_q), max(kv_of_q) + 1
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(TUNE_HISTORY + TUNE_BLOCKS * QUERY_BLOCK, hkv, head_dim, generator=g, device=device,
                    dtype=dtype)
    q = torch.randn(TUNE_BLOCKS * QUERY_BLOCK, hq, head_dim, generator=g, device=device, dtype=dtype)
    best = []
    for qb in range(1, TUNE_BLOCKS + 1):
        qt, kt = q[:qb * QUERY_BLOCK], k[:TUNE_HISTORY + qb * QUERY_BLOCK]
        times = {p: median_seconds(lambda: split_history_attention(qt, kt, kt, TUNE_HISTORY, p, head_dim ** -0.5),
                                   repeats)
                 for p in TUNE_PARTS}
        best.append(min(times, key=times.get))
    return SplitTable(tuple(best))


def split_history_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, parts: int,
                            scale: float) -> torch.Tensor:
    """Causal attention of ``q`` [T, hq, D] (positions ``[start, start + T)``) over ``k``/``v``
    [start + T, hkv, D] (plain GQA: hq a multiple of hkv), the history split into ``parts``; returns
    [T, hq, D] in q's dtype."""
    t, hq, d = q.shape
    s, hkv = k.shape[0], k.shape[1]
    assert s == start + t and parts >= 1 and hq % hkv == 0
    part = start // parts
    cut = part * parts
    outs, lses = [], []
    if part:
        qp = (q[None] if parts == 1 else q[None].expand(parts, t, hq, d).contiguous()).transpose(1, 2)  # [P, hq, T, D]
        kp = k[:cut].reshape(parts, part, hkv, d).transpose(1, 2)  # [P, hkv, L, D]: no copy when k is contiguous
        vp = v[:cut].reshape(parts, part, hkv, d).transpose(1, 2)
        o, lse = partial_attention(qp, kp, vp, causal=False, scale=scale)
        outs.append(o)
        lses.append(lse)
    o, lse = partial_attention(q.transpose(0, 1)[None], k[cut:].transpose(0, 1)[None], v[cut:].transpose(0, 1)[None],
                               causal=True, scale=scale)
    outs.append(o)
    lses.append(lse)
    o_all = torch.cat(outs).float()  # [P+1, hq, T, D]
    lse_all = torch.cat(lses).float()  # [P+1, hq, T]
    w = torch.softmax(lse_all, dim=0)  # exp(lse_i − m) / Σ exp(lse_j − m)
    merged = (w[..., None] * o_all).sum(0)  # [hq, T, D]
    return merged.transpose(0, 1).to(q.dtype)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, hq, T, D], lse [B, hq, T]) of q [B, hq, T, D] over k/v [B, hkv, S, D]; ``causal`` is
    bottom-right aligned (query i sees keys up to S − T + i)."""
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse[..., :q.shape[2]]
    g = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(g, dim=1).float(), v.repeat_interleave(g, dim=1).float()
    scores = torch.matmul(q.float(), kx.transpose(-1, -2)) * scale  # [B, hq, T, S]
    if causal:
        t, s = q.shape[2], k.shape[2]
        seen = torch.arange(s, device=q.device)[None, :] <= torch.arange(s - t, s, device=q.device)[:, None]  # [T, S]
        scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), vx)
    return out.to(q.dtype), lse


def prepare(kv_of_q: list[int], head_dim: int, dtype: torch.dtype, device: torch.device) -> SplitTable | None:
    """The device's ``SplitTable`` for these heads (``tune``: which also loads the split path's kernels, so
    the first chunk over a 16K history in serving does not pay for it); None where ``causal_attention``
    would not split (CPU, fp32, uneven GQA shards), after running its path once on tiny inputs."""
    from .ops import causal_attention, flash_splits  # ops imports this module

    hq, hkv = len(kv_of_q), max(kv_of_q) + 1
    q = torch.zeros(8, hq, head_dim, dtype=dtype, device=device)
    if flash_splits(q, kv_of_q, hkv):
        return tune(kv_of_q, head_dim, dtype, device)
    k = torch.zeros(64 + 8, hkv, head_dim, dtype=dtype, device=device)
    causal_attention(q, k, k, 64, kv_of_q, head_dim ** -0.5)
    return None
