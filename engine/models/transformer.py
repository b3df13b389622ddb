"""Dense decoder-only transformer (Llama family incl. SmolLM2, and Qwen3), written for ONE device.

The model runs one flat batch of ``T`` tokens (this rank's prefill-slice tokens and decode tokens
concatenated, in any order) and never looks at request structure itself. Attention is the only
operator that needs to know which rows belong to which request; it is a pluggable call::

    out = attn(layer_idx, q, k, v, meta)   # q: [T, H_q, D]; k, v: [T, H_kv, D] -> out: [T, H_q, D]

``meta`` is opaque to the model (see ``conflux_cluster.engine.attention.base.AttentionMetadata`` for
the local one). The local backend writes k/v to the paged KV cache and attends over history +
current chunk; an XP backend may instead all-to-all the prefill rows to head shards first. Rows
are already rotated (RoPE applied with each row's absolute position) when ``attn`` is called.
Parallelism is never applied inside this file.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .fused import rms_norm, silu_mul, use_fused
from .rope import Rotary, apply_rotary
from .skinny import ON_BY_DEFAULT, Linear, linear


class AttentionFn(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: Any) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x) and x.dim() == 2 and x.stride(-1) == 1 and self.weight.dtype == x.dtype:
            return rms_norm(x, self.weight, self.eps)  # one kernel, same arithmetic (CUDA)
        # Same arithmetic as the reference: normalise in fp32, cast back, then scale.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class Attention(nn.Module):
    """QKV projection (one fused GEMM), optional q/k norm, RoPE, pluggable attention, output projection."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn,
                meta: Any) -> torch.Tensor:
        # x: [T, hidden]
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # [T, H_q, D]
        k = k.view(T, self.num_kv, self.head_dim)  # [T, H_kv, D]
        v = v.view(T, self.num_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn(self.layer_idx, q, k, v, meta)  # [T, H_q, D]
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if use_fused(gate_up):
            return self.down_proj(silu_mul(gate_up, self.inter))  # one kernel, same arithmetic (CUDA)
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn,
                meta: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Embedding -> layers -> final norm -> LM head. Parameter names mirror HF (with fused qkv/gate_up)."""

    skinny: bool = ON_BY_DEFAULT  # the LM head's few-row kernel (skinny.py; set_skinny turns all of them off)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, bias=False)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn,
                      meta: Any) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn, meta)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] -> float32 logits [S, vocab] (only rows that need a token are passed)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight, skinny=self.skinny).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn, meta: Any,
                sample_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``sample_rows`` (all rows when None): [S, vocab] float32."""
        h = self.hidden_states(input_ids, positions, attn, meta)
        return self.logits(h if sample_rows is None else h[sample_rows])
