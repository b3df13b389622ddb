"""Attention math on gathered KV: causal prefill over history + chunk, and batched paged decode.

Shapes: ``q [T, hq, D]``, ``k/v [S, hkv, D]``; ``kv_of_q[i]`` is the kv head (index into the
``hkv`` heads) that q head ``i`` reads (GQA with possibly uneven shards).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from ..attention.sdpa import prefill_kernels
from . import split_history
from ..util.transfer import to_device
from .split_history import SplitTable, cudnn_history_attention, history_splits, in_pieces, split_history_attention


log = logging.getLogger(__name__)

def expand_kv(k: torch.Tensor, kv_of_q: list[int]) -> torch.Tensor:
    """k [S, hkv, D] -> [hq, S, D], one kv head per q head (GQA expansion, uneven-safe)."""
    s, hkv, d = k.shape
    if len(kv_of_q) == hkv and kv_of_q == list(range(hkv)):
        return k.transpose(0, 1)
    g = _regular_groups(kv_of_q, hkv)
    if g is not None:  # no index tensor: a host->device copy would synchronize the stream
        return k[:, :, None, :].expand(s, hkv, g, d).reshape(s, hkv * g, d).transpose(0, 1)
    idx = to_device(kv_of_q, k.device)  # pinned, asynchronous
    return k.index_select(1, idx).transpose(0, 1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                     kv_of_q: list[int], scale: float, parts: int | None = None,
                     table: SplitTable | None = None) -> torch.Tensor:
    """Chunk queries at positions ``[start, start+T)`` over keys ``[0, start+T)``; returns [T, hq, D].

    On CUDA (flash-capable, plain GQA) a chunk over a long history runs split along the history
    (``split_history.py``): ``parts`` partitions; by default as ``table`` (tuned on the device: flash
    partitions, or cuDNN's fixed ones; a chunk longer than its query tiles in pieces that are) or else the
    static ``history_splits`` picks; 0: never.
    Otherwise SDPA: with plain GQA the kv heads go to its flash kernel as they are (``enable_gqa``)
    when it accepts them (a first chunk); else they are expanded.
    """
    t, s = q.shape[0], k.shape[0]
    assert s == start + t, f"keys {s} != history {start} + chunk {t}"
    if start > 0 and parts != 0 and flash_splits(q, kv_of_q, k.shape[1]):
        if parts is None and table is not None and (piece := table.piece(t, start)):
            return in_pieces(q, k, v, start, piece, lambda qp, kp, vp, at: causal_attention(
                qp, kp, vp, at, kv_of_q, scale, table=table))
        if parts is None and table is not None and table.uses_cudnn(t, start):
            return cudnn_history_attention(q, k, v, start, scale)
        if parts is None and table is not None:
            parts = table.parts(t, start)
        elif parts is None:
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            parts = history_splits(t, start, q.shape[1], sms)
        if parts:
            return split_history_attention(q, k, v, start, parts, scale)
    qh = q.transpose(0, 1)[None]  # [1, hq, T, D]
    kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, hkv, S, D]
    gqa = q.is_cuda and _regular_groups(kv_of_q, k.shape[1]) is not None and _flash_takes_gqa(qh, kh, vh)
    if not gqa:
        kh, vh = expand_kv(k, kv_of_q)[None], expand_kv(v, kv_of_q)[None]  # [1, hq, S, D]
    if start == 0:
        with prefill_kernels(q.device):
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    elif q.is_cuda:  # bottom-right aligned causal without a materialized mask (flash / mem-efficient)
        from torch.nn.attention.bias import causal_lower_right

        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(t, s), scale=scale,
                                           enable_gqa=gqa)
    else:
        pos_q = torch.arange(start, s, device=q.device)[:, None]
        mask = torch.arange(s, device=q.device)[None, :] <= pos_q  # [T, S]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


def flash_splits(q: torch.Tensor, kv_of_q: list[int], hkv: int) -> bool:
    """Whether torch's flash kernel can take a chunk over history itself: fp16/bf16, plain GQA kv heads
    (no expanded copy), head dim it supports, an Ampere or newer GPU. SDPA's own check refuses flash for
    a causal mask with more keys than queries; it then expanded the kv heads and ran a slower kernel
    (2.6× the split's time for a 128-token chunk over 64K keys on an H200)."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256
            and _regular_groups(kv_of_q, hkv) is not None and torch.backends.cuda.flash_sdp_enabled()
            and torch.cuda.get_device_capability(q.device)[0] >= 8)  # flash needs Ampere or newer


def _flash_takes_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's flash kernel runs these shapes with fewer kv heads than q heads."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    try:
        return can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, True, True))
    except (TypeError, RuntimeError):  # older SDPAParams signature
        return False


def _regular_groups(kv_of_q: list[int], hkv: int) -> int | None:
    """G when q head i reads kv head i // G for all i (plain GQA), else None (uneven shard)."""
    hq = len(kv_of_q)
    if hq % hkv:
        return None
    g = hq // hkv
    return g if kv_of_q == [i // g for i in range(hq)] else None


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     kv_of_q: list[int], scale: float) -> torch.Tensor:
    """One query per request over its own keys.

    q [B, hq, D]; k/v [B, S_max, hkv, D] padded; lengths [B] valid keys per request -> [B, hq, D].
    Plain GQA folds the G query heads of a kv head into the query axis (no KV expansion).
    """
    b, smax, hkv = k.shape[0], k.shape[1], k.shape[2]
    mask = torch.arange(smax, device=k.device)[None, :] < lengths[:, None]  # [B, S]
    g = _regular_groups(kv_of_q, hkv)
    if g is not None:
        qg = q.view(b, hkv, g, q.shape[-1])  # [B, hkv, G, D]
        o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask[:, None, None, :], scale=scale)  # [B, hkv, G, D]
        return o.reshape(b, hkv * g, q.shape[-1])
    idx = to_device(kv_of_q, k.device)  # pinned, asynchronous
    kh = k.index_select(2, idx).transpose(1, 2)  # [B, hq, S, D]
    vh = v.index_select(2, idx).transpose(1, 2)
    o = F.scaled_dot_product_attention(q[:, :, None, :], kh, vh, attn_mask=mask[:, None, None, :],
                                       scale=scale)  # [B, hq, 1, D]
    return o[:, :, 0, :]


def prepare_history_attention(kv_of_q: list[int], head_dim: int, dtype: torch.dtype, device: torch.device,
            max_history: int = 0) -> SplitTable | None:
    """The device's ``SplitTable`` for these heads (``split_history.tune``: which also loads the split path's kernels, so
    the first chunk over a 16K history in serving does not pay for it), with cuDNN's plans built for
    histories shorter than ``max_history`` (``split_history.warm_cudnn``); None where ``causal_attention`` would not
    split (CPU, fp32, uneven GQA shards), after running its path once on tiny inputs."""
    hq, hkv = len(kv_of_q), max(kv_of_q) + 1
    q = torch.zeros(8, hq, head_dim, dtype=dtype, device=device)
    if flash_splits(q, kv_of_q, hkv):
        t0 = time.perf_counter()
        table = split_history.tune(kv_of_q, head_dim, dtype, device)
        t1 = time.perf_counter()
        shapes = split_history.warm_cudnn(table, kv_of_q, head_dim, dtype, device, max_history)
        log.info("split-history attention tuned in %.1f s: flash partitions %s, cuDNN for %d of %d query-tile "
                 "counts (%d plans built in %.1f s)", t1 - t0, table.best, len(table.cudnn), split_history.TUNE_BLOCKS, shapes,
                 time.perf_counter() - t1)
        return table
    k = torch.zeros(64 + 8, hkv, head_dim, dtype=dtype, device=device)
    causal_attention(q, k, k, 64, kv_of_q, head_dim ** -0.5)
    return None
