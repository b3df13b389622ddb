"""Rotary position embeddings (rotate-half convention, as in Hugging Face Llama/Qwen3).

Frequencies are computed in float32 and cast to the activation dtype at the end, exactly like
the reference, so fp32 logits match it to rounding.
"""

from __future__ import annotations

import math

import torch

from . import fused
from .config import ModelConfig, RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[D/2] float32 inverse frequencies, with Llama-3 scaling when given."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotary(torch.nn.Module):
    """Holds ``inv_freq``; ``cos_sin(positions)`` is computed once per forward and shared by all layers."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64 -> cos, sin: [T, 1, D] (broadcast over heads)
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]
    if fused.can_rope(x, cos):
        return fused.rope(x, cos, sin)  # one kernel, same arithmetic (CUDA)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
