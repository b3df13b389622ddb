"""Paged attention with plain PyTorch (SDPA): causal prefill over paged history + current chunk,
and batched paged decode. Runs on CPU and CUDA; used at N=1 and as the reference for kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kv_cache import KVCache
from .base import RowSpan


@dataclass
class PrefillMeta:
    rows: slice  # rows of the batch
    pos_start: int
    context_slots: torch.Tensor | None  # [pos_end] flat slots of positions 0..pos_end-1; None if no history
    mask: torch.Tensor | None  # [n, pos_end] bool (True = attend); None -> plain causal


@dataclass
class LocalAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot each row's k/v is written to
    prefills: list[PrefillMeta]
    decode_rows: torch.Tensor  # [B_d] row of each decode token
    decode_slots: torch.Tensor  # [B_d, L_max] context slots (padded with slot 0)
    decode_mask: torch.Tensor  # [B_d, 1, 1, L_max] bool, True = real context


class TorchPagedAttention:
    """``AttentionBackend`` over one rank's ``KVCache`` (decode layout)."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def prepare(self, spans: list[RowSpan], num_tokens: int) -> LocalAttentionMetadata:
        dev = self.cache.k.device
        slot_mapping = torch.empty(num_tokens, dtype=torch.int64)
        prefills, dec_rows, dec_slots = [], [], []
        for s in spans:
            ctx = self.cache.slots(s.request_id, 0, s.pos_end)  # [pos_end]
            slot_mapping[s.row_start:s.row_end] = ctx[s.pos_start:]
            if s.is_decode:
                dec_rows.append(s.row_start)
                dec_slots.append(ctx)
                continue
            mask = None
            if s.pos_start > 0:  # bottom-right aligned causal mask over history + chunk
                q_pos = torch.arange(s.pos_start, s.pos_end)[:, None]
                mask = (torch.arange(s.pos_end)[None, :] <= q_pos).to(dev)
            prefills.append(PrefillMeta(slice(s.row_start, s.row_end), s.pos_start,
                                        ctx.to(dev) if s.pos_start > 0 else None, mask))
        lmax = max((len(c) for c in dec_slots), default=0)
        slots = torch.zeros(len(dec_slots), lmax, dtype=torch.int64)
        valid = torch.zeros(len(dec_slots), lmax, dtype=torch.bool)
        for i, c in enumerate(dec_slots):
            slots[i, :len(c)] = c
            valid[i, :len(c)] = True
        return LocalAttentionMetadata(slot_mapping.to(dev), prefills, torch.tensor(dec_rows, device=dev),
                                      slots.to(dev), valid[:, None, None, :].to(dev))

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: LocalAttentionMetadata) -> torch.Tensor:
        # q: [T, H_q, D]; k, v: [T, H_kv, D]
        kc, vc = self.cache.decode_view(layer_idx)  # [slots, H_kv, D]
        kc.index_copy_(0, meta.slot_mapping, k)
        vc.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for p in meta.prefills:
            qs = q[p.rows].transpose(0, 1)[None]  # [1, H_q, n, D]
            if p.context_slots is None:  # first chunk: attend within the chunk only
                ks, vs = k[p.rows], v[p.rows]
            else:
                ks, vs = kc[p.context_slots], vc[p.context_slots]  # [pos_end, H_kv, D]
            o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                                               attn_mask=p.mask, is_causal=p.mask is None, enable_gqa=True)
            out[p.rows] = o[0].transpose(0, 1)
        if meta.decode_rows.numel():
            qd = q[meta.decode_rows][:, :, None, :]  # [B_d, H_q, 1, D]
            kd = kc[meta.decode_slots].transpose(1, 2)  # [B_d, H_kv, L_max, D]
            vd = vc[meta.decode_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, enable_gqa=True)
            out[meta.decode_rows] = o[:, :, 0, :]
        return out
