"""Base-TP logical ranks (paper App. C), applied to the one-device model afterwards (gpt-fast style).

``apply_tp(model, heads, tp_rank, tp_size, group)`` cuts each layer's weights to device ``t``'s
shard and adds the all-reduces; the model code itself stays single-device::

    qkv_proj   column-parallel: rows of the TP shard's q heads, kv heads (uneven / replicated ok)
    o_proj     row-parallel:    columns of those q heads, then all-reduce over the TP group
    gate_up    column-parallel: rows [I_lo, I_hi) of gate and of up
    down_proj  row-parallel:    columns [I_lo, I_hi), then all-reduce
    embedding, norms, lm_head:  replicated

Attention then sees ``q [T, hq_t, D]``, ``k/v [T, hkv_t, D]``: the TP shard's heads only.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.skinny import Linear
from .comm import all_reduce
from .heads import DeviceHeads


def _even_range(total: int, parts: int, index: int) -> tuple[int, int]:
    base, extra = divmod(total, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def _rows(linear: nn.Linear, rows: list[slice]) -> nn.Linear:
    """A new Linear made of the given output-row ranges of ``linear``."""
    w = torch.cat([linear.weight.data[s] for s in rows])
    out = Linear(w.shape[1], w.shape[0], bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    out.weight.data.copy_(w)
    if linear.bias is not None:
        out.bias.data.copy_(torch.cat([linear.bias.data[s] for s in rows]))
    return out


def _cols(linear: nn.Linear, cols: slice) -> nn.Linear:
    w = linear.weight.data[:, cols]
    out = Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    out.weight.data.copy_(w)
    return out


def _all_reduce_hook(group):
    def hook(_module, _inputs, output):
        return all_reduce(output, group)
    return hook


@torch.no_grad()
def apply_tp(model: nn.Module, heads: DeviceHeads, tp_rank: int, tp_size: int, group) -> nn.Module:
    """Shard ``model`` (a ``CausalLM``) in place for TP index ``tp_rank`` of ``tp_size``."""
    if tp_size == 1:
        return model
    cfg = model.config
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    s = heads.tp_shard
    q_rows = slice(s.q_lo * d, s.q_hi * d)
    k_rows = slice(hq * d + s.kv_lo * d, hq * d + s.kv_hi * d)
    v_rows = slice((hq + hkv) * d + s.kv_lo * d, (hq + hkv) * d + s.kv_hi * d)
    i_lo, i_hi = _even_range(cfg.intermediate_size, tp_size, tp_rank)
    inter = cfg.intermediate_size
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _rows(attn.qkv_proj, [q_rows, k_rows, v_rows])
        attn.o_proj = _cols(attn.o_proj, q_rows)
        attn.num_heads, attn.num_kv = s.num_q, s.num_kv
        attn.q_size, attn.kv_size = s.num_q * d, s.num_kv * d
        attn.o_proj.register_forward_hook(_all_reduce_hook(group))
        mlp.gate_up_proj = _rows(mlp.gate_up_proj, [slice(i_lo, i_hi), slice(inter + i_lo, inter + i_hi)])
        mlp.down_proj = _cols(mlp.down_proj, slice(i_lo, i_hi))
        mlp.inter = i_hi - i_lo
        mlp.down_proj.register_forward_hook(_all_reduce_hook(group))
    return model
