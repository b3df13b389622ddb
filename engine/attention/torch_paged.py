"""Paged attention with plain PyTorch (SDPA): causal prefill over paged history + current chunk,
and batched paged decode. Runs on CPU and CUDA; used at N=1 and as the reference for kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kv.cache import KVCache
from ..contracts.step import StepPlan
from ..kv.prefix_blocks import insert_on_rank
from .base import RowSpan
from .sdpa import prefill_kernels


@dataclass
class PrefillMeta:
    rows: slice  # rows of the batch
    pos_start: int
    context_blocks: torch.Tensor | None  # [ceil(pos_end / bs)] block ids of positions 0..pos_end-1; None if no history
    pos_end: int
    mask: torch.Tensor | None  # [n, pos_end] bool (True = attend); None -> plain causal


@dataclass
class LocalAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot each row's k/v is written to
    prefills: list[PrefillMeta]
    decode_rows: torch.Tensor  # [B_d] row of each decode token
    decode_blocks: torch.Tensor  # [B_d, M] block tables (padded with block 0); L_max = M * block_size
    decode_mask: torch.Tensor  # [B_d, 1, 1, L_max] bool, True = real context


class TorchPagedAttention:
    """``AttentionBackend`` over one rank's ``KVCache`` (decode layout)."""

    manages_kv = False  # the worker reserves each row's block

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def begin_plan(self, plan: StepPlan) -> None:
        """Prefix cache, before the step: free evicted blocks, start hit requests' tables."""
        if plan.evicted:
            self.cache.evict(plan.evicted[self.cache.rank])
        for hit in plan.prefix_hits:
            if hit.rank == self.cache.rank:
                self.cache.adopt(hit.request_id, hit.hashes)

    def end_plan(self, plan: StepPlan) -> None:
        """After the step: the plan's cache inserts on this rank."""
        insert_on_rank(self.cache, plan.cache_inserts, self.cache.rank)

    def needs_forward(self) -> bool:
        return False

    def capture_decode_graphs(self, model, max_batch: int, max_context: int) -> None:
        return None  # decode steps use the piecewise graphs with eager attention

    def check_invariants(self, live_requests: set[str] | None = None) -> None:
        self.cache.check_invariants(live_requests)

    def prepare(self, spans: list[RowSpan], num_tokens: int) -> LocalAttentionMetadata:
        dev, bs = self.cache.k.device, self.cache.block_size
        slot_mapping = torch.empty(num_tokens, dtype=torch.int64)
        prefills, dec_rows, dec_tables, dec_lens = [], [], [], []
        for s in spans:
            slot_mapping[s.row_start:s.row_end] = self.cache.slots(s.request_id, s.pos_start, s.pos_end)
            blocks = self.cache.tables[s.request_id][:-(-s.pos_end // bs)]
            if s.is_decode:
                dec_rows.append(s.row_start)
                dec_tables.append(blocks)
                dec_lens.append(s.pos_end)
                continue
            mask = None
            if s.pos_start > 0:  # bottom-right aligned causal mask over history + chunk
                q_pos = torch.arange(s.pos_start, s.pos_end)[:, None]
                mask = (torch.arange(s.pos_end)[None, :] <= q_pos).to(dev)
            prefills.append(PrefillMeta(slice(s.row_start, s.row_end), s.pos_start,
                                        torch.tensor(blocks, device=dev) if s.pos_start > 0 else None,
                                        s.pos_end, mask))
        m = max((len(t) for t in dec_tables), default=0)
        tables = torch.zeros(len(dec_tables), m, dtype=torch.int64)
        for i, t in enumerate(dec_tables):
            tables[i, :len(t)] = torch.tensor(t, dtype=torch.int64)
        valid = torch.arange(m * bs)[None, :] < torch.tensor(dec_lens, dtype=torch.int64)[:, None]
        return LocalAttentionMetadata(slot_mapping.to(dev), prefills, torch.tensor(dec_rows, device=dev),
                                      tables.to(dev), valid[:, None, None, :].to(dev))

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: LocalAttentionMetadata) -> torch.Tensor:
        # q: [T, H_q, D]; k, v: [T, H_kv, D]
        kc, vc = self.cache.decode_view(layer_idx)  # [slots, H_kv, D]
        kc.index_copy_(0, meta.slot_mapping, k)
        vc.index_copy_(0, meta.slot_mapping, v)
        bs, h, d = self.cache.block_size, k.shape[1], k.shape[2]
        kb, vb = kc.view(-1, bs, h, d), vc.view(-1, bs, h, d)  # [num_blocks, bs, H_kv, D]
        out = torch.empty_like(q)
        for p in meta.prefills:
            qs = q[p.rows].transpose(0, 1)[None]  # [1, H_q, n, D]
            if p.context_blocks is None:  # first chunk: attend within the chunk only
                ks, vs = k[p.rows], v[p.rows]
            else:  # whole blocks gathered, then cut to the context: [pos_end, H_kv, D]
                ks = kb.index_select(0, p.context_blocks).view(-1, h, d)[:p.pos_end]
                vs = vb.index_select(0, p.context_blocks).view(-1, h, d)[:p.pos_end]
            with prefill_kernels(q.device):
                o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                                                   attn_mask=p.mask, is_causal=p.mask is None, enable_gqa=True)
            out[p.rows] = o[0].transpose(0, 1)
        if meta.decode_rows.numel():
            b, m = meta.decode_blocks.shape
            # GQA without expanding K/V: the G query heads sharing a KV head become G query rows
            # (q head j reads kv head j // G, so [H_q] -> [H_kv, G] is a plain view).
            qd = q[meta.decode_rows].view(b, h, q.shape[1] // h, d)  # [B_d, H_kv, G, D]
            flat = meta.decode_blocks.flatten()
            kd = kb.index_select(0, flat).view(b, m * bs, h, d).transpose(1, 2)  # [B_d, H_kv, L_max, D]
            vd = vb.index_select(0, flat).view(b, m * bs, h, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)  # [B_d, H_kv, G, D]
            out[meta.decode_rows] = o.reshape(b, q.shape[1], d)
        return out
