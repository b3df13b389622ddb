"""Copying checkpoint tensors (Hugging Face names) into ``CausalLM``'s fused parameters.

Each HF name maps to (our parameter, slice of its output rows)::

    q_proj [H_q*D, hidden]  ─┐
    k_proj [H_kv*D, hidden] ─┼─> qkv_proj.weight rows [0:q) [q:q+kv) [q+kv:q+2kv)
    v_proj [H_kv*D, hidden] ─┘
    gate_proj, up_proj      ───> gate_up_proj.weight rows [0:I) [I:2I)
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .transformer import CausalLM


def _target(config: ModelConfig, name: str) -> tuple[str, int, int] | None:
    """HF name -> (our parameter name, first row, end row); None for tensors we do not use."""
    name = name.removeprefix("model.")
    if name.endswith("rotary_emb.inv_freq"):
        return None
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    fused = {
        "self_attn.q_proj.": ("self_attn.qkv_proj.", 0, q),
        "self_attn.k_proj.": ("self_attn.qkv_proj.", q, q + kv),
        "self_attn.v_proj.": ("self_attn.qkv_proj.", q + kv, q + 2 * kv),
        "mlp.gate_proj.": ("mlp.gate_up_proj.", 0, inter),
        "mlp.up_proj.": ("mlp.gate_up_proj.", inter, 2 * inter),
    }
    for src, (dst, lo, hi) in fused.items():
        if src in name:
            return name.replace(src, dst), lo, hi
    return name, -1, -1


def expected_names(config: ModelConfig) -> list[str]:
    """Every HF tensor name a complete checkpoint of ``config`` provides."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"]
    per_layer += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    if config.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(config.num_hidden_layers):
        names += [f"model.layers.{i}.{p}" for p in per_layer]
    return names


class WeightLoader:
    """Copies tensors one by one (keeps peak memory at one tensor) and reports what is missing."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.loaded: set[str] = set()

    def load(self, hf_name: str, tensor: torch.Tensor) -> None:
        target = _target(self.model.config, hf_name)
        if target is None:
            return
        name, lo, hi = target
        if name == "lm_head.weight" and self.model.lm_head is None:
            return  # tied checkpoint that also stores lm_head
        param = self.params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
        dst = param.data if lo < 0 else param.data[lo:hi]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                             f"the config implies {tuple(dst.shape)}")
        dst.copy_(tensor.to(dtype=dst.dtype))
        self.loaded.add(hf_name if hf_name.startswith(("model.", "lm_head")) else "model." + hf_name)

    def missing(self) -> list[str]:
        return [n for n in expected_names(self.model.config) if n not in self.loaded]


def build_empty(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Model with uninitialised parameters on ``device`` (no double allocation)."""
    with torch.device("meta"):
        model = CausalLM(config).to(dtype)  # cast on meta: the device only ever holds `dtype` weights
    model = model.to_empty(device=device)
    from .rope import inv_frequencies

    model.rotary.inv_freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
    return model


def init_random(model: CausalLM, seed: int = 0) -> None:
    """Random weights for speed work: N(0, 0.02) matrices, unit norms (deterministic per seed)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device).mul_(0.02))
