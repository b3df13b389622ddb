"""Hardware and model figures for the analytical (roofline) cost model. Facts, not fits.

Efficiencies turn datasheet peaks into what kernels reach; the H200 values are anchored on the
measurements in DESIGN §6 (bf16 GEMM ≈ 785 TFLOP/s of 989, weight streaming ≈ 3.6 TB/s of 4.8,
causal SDPA ≈ 580 TFLOP/s, NCCL all-to-all ≈ 255 GB/s bus bandwidth and ≈ 45 µs for a small
message). H100 uses the same efficiencies on its own datasheet peaks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU and its NVLink fabric."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s (datasheet)
    hbm_bw: float  # bytes/s (datasheet)
    hbm_bytes: float  # HBM capacity in bytes
    link_bw: float  # bytes/s per GPU that collectives reach (NCCL bus bandwidth)
    gemm_eff: float = 0.79  # fraction of peak_flops a large GEMM reaches
    attn_eff: float = 0.59  # fraction of peak_flops causal prefill attention reaches
    bw_eff: float = 0.75  # fraction of hbm_bw streaming weights / KV reaches
    a2a_latency: float = 45e-6  # s, one small all-to-all (measured on H200, NCCL)
    allreduce_latency: float = 12e-6  # s, one small all-reduce (custom one-shot all-reduce, as vLLM)
    allreduce_bw: float = 360e9  # bytes/s all-reduce bus bandwidth (nccl-tests on NVLink 4: 360-480; low end)
    step_overhead: float = 0.5e-3  # s per iteration outside the layers (sampling, launch, bookkeeping)
    mem_util: float = 0.9  # fraction of HBM a server claims (vLLM's gpu_memory_utilization)
    activation_reserve: float = 4e9  # bytes kept for activations and graphs per GPU

    @property
    def gemm_flops(self) -> float:
        return self.peak_flops * self.gemm_eff

    @property
    def attn_flops(self) -> float:
        return self.peak_flops * self.attn_eff

    @property
    def mem_bw(self) -> float:
        return self.hbm_bw * self.bw_eff


HARDWARE = {
    "h200": HardwareSpec("h200", peak_flops=989e12, hbm_bw=4.8e12, hbm_bytes=141e9, link_bw=255e9),
    "h100": HardwareSpec("h100", peak_flops=989e12, hbm_bw=3.35e12, hbm_bytes=80e9, link_bw=255e9),
}


@dataclass(frozen=True)
class ModelSpec:
    """The shapes the cost model needs (decoder-only, GQA, SwiGLU FFN, bf16)."""

    name: str
    num_layers: int  # L
    hidden: int  # H
    num_q_heads: int
    num_kv_heads: int
    head_dim: int  # d
    ffn: int  # intermediate size of the gated FFN
    vocab: int
    max_context: int  # max_position_embeddings
    dtype_bytes: int = 2

    @property
    def linear_params(self) -> int:
        """Parameters of the linear layers of one decoder layer (QKV, O, gate/up/down)."""
        qd, kvd = self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden * (qd + 2 * kvd) + qd * self.hidden + 3 * self.hidden * self.ffn

    @property
    def weight_bytes(self) -> float:
        return (self.num_layers * self.linear_params + 2 * self.vocab * self.hidden) * self.dtype_bytes

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K and V of one token in one layer, all KV heads."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_bytes_per_token_layer


MODELS = {
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, 131072),
    "qwen3-14b": ModelSpec("qwen3-14b", 40, 5120, 40, 8, 128, 17408, 151936, 40960),
    "qwen3-32b": ModelSpec("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936, 40960),
}
ALIASES = {"llama-8b": "llama-3.1-8b", "qwen-14b": "qwen3-14b", "qwen-32b": "qwen3-32b"}


def get_model(name: str) -> ModelSpec:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS) + sorted(ALIASES))}")
    return MODELS[key]


def get_hardware(name: str) -> HardwareSpec:
    if name.lower() not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE))}")
    return HARDWARE[name.lower()]


def kv_tokens_per_group(model: ModelSpec, hw: HardwareSpec, tp: int) -> int:
    """KV capacity (tokens) of a TP-``tp`` group after weights and activations (each GPU holds 1/tp of a token)."""
    free = hw.hbm_bytes * hw.mem_util - model.weight_bytes / tp - hw.activation_reserve
    if free <= 0:
        raise ValueError(f"{model.name} does not fit on {hw.name} with TP{tp}")
    return int(free // (model.kv_bytes_per_token / tp))
