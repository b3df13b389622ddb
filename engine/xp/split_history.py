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

cuDNN's attention ran the unmasked history call 1.4-1.9x faster than flash on an H200 (a 640-token
chunk over 98K keys: 1.93 ms against flash's 4.68 ms with one partition and 2.99 ms with the tuned
four; docs/xp.md, "Split-history prefill attention"), but it builds an
execution plan per new shape: 67 ms for a new query length or partition count, 0.8 s for a new key
length. So its history is cut into partitions of exactly ``PART_KEYS`` keys (the batch axis) and the
queries padded to whole 128-row tiles; a server meets at most (query tiles) × (partition counts)
shapes, and ``ops.prepare_history_attention`` builds each plan before the first request. The rest of the history
(fewer than ``PART_KEYS`` keys) joins the chunk's causal call.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..util.cuda_timing import median_seconds

log = logging.getLogger(__name__)

QUERY_BLOCK = 128  # queries per flash thread block (FA2, head_dim 128)
MIN_HISTORY = 16384  # shorter histories ran slower split (the merge's launches cost more than they save)
MAX_CHUNK_SHARE = 8  # split only a chunk of at most history / 8 tokens (larger ones ran as fast unsplit)
PART_KEYS = 16384  # keys per cuDNN partition: fixed, so cuDNN sees few shapes (a new one costs a plan)


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
    fill the SMs in waves, which a static rule got wrong by up to 1.4× (one H200: a
    264-token chunk over a 64K history took 1.92 ms per layer with the rule's two partitions and
    1.47 ms with one; a 520-token chunk 3.28 ms with one and 2.35 ms with four). Query-block counts
    past the table take one partition (their blocks fill the SMs in several waves already)."""

    best: tuple[int, ...]  # best[i]: flash partitions for i + 1 query blocks
    cudnn: frozenset[int] = frozenset()  # query-block counts for which cuDNN's partitions timed fastest

    def parts(self, chunk: int, history: int) -> int:
        if not splits(chunk, history):
            return 0
        qb = math.ceil(chunk / QUERY_BLOCK)
        return self.best[qb - 1] if qb <= len(self.best) else 1

    def uses_cudnn(self, chunk: int, history: int) -> bool:
        """Whether the history call of this chunk goes to cuDNN (in ``PART_KEYS`` partitions)."""
        return splits(chunk, history) and history >= PART_KEYS and math.ceil(chunk / QUERY_BLOCK) in self.cudnn

    def piece(self, chunk: int, history: int) -> int:
        """Queries per piece for a chunk longer than the table's query tiles over a split-length history:
        it runs as consecutive pieces of ``TUNE_BLOCKS`` tiles (``in_pieces``), each through cuDNN, whose
        plans for that tile count exist; 0: one call. Flash ran such chunks at ~5·10⁻¹¹ s per causal pair,
        cuDNN the tuned ones at ~3.5·10⁻¹¹ (one H200, the profiler's samples)."""
        rows = TUNE_BLOCKS * QUERY_BLOCK
        return rows if chunk > rows and history >= MIN_HISTORY and TUNE_BLOCKS in self.cudnn else 0


TUNE_HISTORY = 4 * PART_KEYS  # keys per timed call: the history call dominates; 256 MiB of bf16 KV (8 kv heads)
TUNE_BLOCKS = 16  # query-block counts tuned (chunks of up to 2,048 tokens)
TUNE_PARTS = (1, 2, 4)


def tune(kv_of_q: list[int], head_dim: int, dtype: torch.dtype, device: torch.device,
         repeats: int = 3) -> SplitTable:
    """Time each of ``TUNE_PARTS`` flash partitions, and cuDNN's fixed partitions where this torch has
    them, for 1..``TUNE_BLOCKS`` query blocks over a ``TUNE_HISTORY``-key history (this rank's heads,
    CUDA events, median of ``repeats`` after one warm call each) and keep the fastest: 256 calls of
    1-10 ms each on an H200 (about a second)."""
    hq, hkv = len(kv_of_q), max(kv_of_q) + 1
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(TUNE_HISTORY + TUNE_BLOCKS * QUERY_BLOCK, hkv, head_dim, generator=g, device=device,
                    dtype=dtype)
    q = torch.randn(TUNE_BLOCKS * QUERY_BLOCK, hq, head_dim, generator=g, device=device, dtype=dtype)
    scale = head_dim ** -0.5
    use_cudnn = cudnn_available(q, k)
    best, fastest_cudnn = [], set()
    for qb in range(1, TUNE_BLOCKS + 1):
        qt, kt = q[:qb * QUERY_BLOCK], k[:TUNE_HISTORY + qb * QUERY_BLOCK]
        times = {p: median_seconds(lambda: split_history_attention(qt, kt, kt, TUNE_HISTORY, p, scale), repeats)
                 for p in TUNE_PARTS}
        best.append(min(times, key=times.get))
        if use_cudnn and median_seconds(lambda: cudnn_history_attention(qt, kt, kt, TUNE_HISTORY, scale),
                                        repeats) < min(times.values()):
            fastest_cudnn.add(qb)
    return SplitTable(tuple(best), frozenset(fastest_cudnn))


def cudnn_available(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether this torch's cuDNN attention takes the partitions' shapes (GQA kv heads as they are,
    the log-sum-exp returned); versions differ in what they accept."""
    if not (q.is_cuda and torch.backends.cudnn.is_available()
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")):
        return False
    try:
        cudnn_history_attention(q[:QUERY_BLOCK], k[:PART_KEYS + QUERY_BLOCK], k[:PART_KEYS + QUERY_BLOCK],
                                PART_KEYS, q.shape[-1] ** -0.5)
        return True
    except RuntimeError as e:  # not supported for these shapes / this GPU
        log.info("cuDNN attention not used for split histories: %s", str(e).splitlines()[0][:200])
        return False


def warm_cudnn(table: SplitTable, kv_of_q: list[int], head_dim: int, dtype: torch.dtype,
               device: torch.device, max_history: int) -> int:
    """Build cuDNN's plan for every shape ``table`` can send it for histories shorter than
    ``max_history`` (each query-tile count it took × 1..(max_history − 1) // PART_KEYS partitions), so
    no request pays one (≈ 67 ms each on an H200); returns the number of shapes."""
    most = (max_history - 1) // PART_KEYS
    if not table.cudnn or most < 1:
        return 0
    hq, hkv = len(kv_of_q), max(kv_of_q) + 1
    k = torch.zeros(most * PART_KEYS, hkv, head_dim, device=device, dtype=dtype)
    q = torch.zeros(max(table.cudnn) * QUERY_BLOCK, hq, head_dim, device=device, dtype=dtype)
    for qb in sorted(table.cudnn):
        for parts in range(1, most + 1):
            cudnn_partials(q[:qb * QUERY_BLOCK], k[:parts * PART_KEYS], k[:parts * PART_KEYS], parts,
                           head_dim ** -0.5)
    torch.cuda.synchronize(device)
    return len(table.cudnn) * most


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
    partials = []
    if part:
        qp = (q[None] if parts == 1 else q[None].expand(parts, t, hq, d).contiguous()).transpose(1, 2)  # [P, hq, T, D]
        kp = k[:cut].reshape(parts, part, hkv, d).transpose(1, 2)  # [P, hkv, L, D]: no copy when k is contiguous
        vp = v[:cut].reshape(parts, part, hkv, d).transpose(1, 2)
        partials.append(partial_attention(qp, kp, vp, causal=False, scale=scale))
    partials.append(_causal_rest(q, k, v, cut, scale))
    return _merge(partials, q.dtype)


def in_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, piece: int,
              attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """Causal attention of ``q`` [T, hq, D] at positions ``[start, start + T)`` as consecutive pieces of
    ``piece`` queries, each by ``attend(q_piece, k, v, its start)`` over the keys before its own end (the
    history and the chunk's earlier pieces): the same result as one call, in shapes of at most
    ``piece`` queries."""
    t = q.shape[0]
    ends = [start + min(a + piece, t) for a in range(0, t, piece)]
    return torch.cat([attend(q[a:a + piece], k[:end], v[:end], start + a) for a, end in zip(range(0, t, piece), ends)])


def cudnn_history_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                            part_keys: int = PART_KEYS) -> torch.Tensor:
    """``split_history_attention`` with the history in ``start // part_keys`` partitions of exactly
    ``part_keys`` keys through cuDNN (plain math off CUDA); the rest of the history attends with the
    chunk, causally."""
    t, hq, d = q.shape
    parts = start // part_keys
    assert k.shape[0] == start + t and parts >= 1 and hq % k.shape[1] == 0
    cut = parts * part_keys
    history = cudnn_partials(q, k[:cut], v[:cut], parts, scale)
    return _merge([history, _causal_rest(q, k, v, cut, scale)], q.dtype)


def cudnn_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parts: int,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [P, hq, T, D], lse [P, hq, T]) of q [T, hq, D] over each of ``parts`` equal partitions of
    k/v [P·L, hkv, D], no mask. The queries are padded to whole ``QUERY_BLOCK`` tiles (the padded rows'
    results are dropped), so the kernel's shape depends on the tile count, not the chunk length."""
    t, hq, d = q.shape
    hkv, tiles = k.shape[1], -(-t // QUERY_BLOCK) * QUERY_BLOCK
    qp = F.pad(q, (0, 0, 0, 0, 0, tiles - t))[None].expand(parts, tiles, hq, d).contiguous().transpose(1, 2)
    kp = k.reshape(parts, -1, hkv, d).transpose(1, 2)  # [P, hkv, L, D]: no copy when k is contiguous
    vp = v.reshape(parts, -1, hkv, d).transpose(1, 2)
    if q.is_cuda:
        o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(qp, kp, vp, None, True, 0.0, False, False,
                                                                    scale=scale)[:2]
    else:
        o, lse = partial_attention(qp, kp, vp, causal=False, scale=scale)
    return o[:, :, :t], lse.reshape(parts, hq, tiles)[..., :t]


def _causal_rest(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cut: int,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk over keys ``[cut, start + T)``, bottom-right causal: (out [1, hq, T, D], lse [1, hq, T])."""
    return partial_attention(q.transpose(0, 1)[None], k[cut:].transpose(0, 1)[None], v[cut:].transpose(0, 1)[None],
                             causal=True, scale=scale)


def _merge(partials: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """One attention output [T, hq, D] from partials over disjoint keys, weighted by their log-sum-exps."""
    o_all = torch.cat([o for o, _ in partials]).float()  # [P+1, hq, T, D]
    lse_all = torch.cat([lse for _, lse in partials]).float()  # [P+1, hq, T]
    w = torch.softmax(lse_all, dim=0)  # exp(lse_i − m) / Σ exp(lse_j − m)
    merged = (w[..., None] * o_all).sum(0)  # [hq, T, D]
    return merged.transpose(0, 1).to(dtype)


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
