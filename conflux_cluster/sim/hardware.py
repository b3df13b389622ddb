"""Hardware and model figures for the simulator.

Compute, bandwidth and interconnect figures are the engine's roofline presets
(``conflux_cluster.engine.scheduler.roofline``: H100 / H200, efficiencies anchored on DESIGN §6),
so the simulator and the engine's roofline profiles share one source. What a serving simulation
needs on top — HBM capacity for KV limits, the all-reduce latency of TP baselines, per-step
overhead outside the layers, vocabulary and context length — lives here.
"""

from __future__ import annotations

from dataclasses import dataclass

from conflux_cluster.engine.scheduler import roofline


@dataclass(frozen=True)
class SimHardware:
    """One GPU type: the engine's roofline figures plus serving facts."""

    roofline: roofline.HardwareSpec  # FLOP/s, HBM and link bandwidth, efficiencies, latencies
    hbm_bytes: float  # HBM capacity per GPU
    allreduce_latency: float = 12e-6  # s per small all-reduce in TP groups (one-shot custom all-reduce,
    #                                   as vLLM uses on NVLink; generous to TP baselines vs NCCL's ≈45 µs)
    allreduce_busbw: float = 360e9  # bytes/s all-reduce bus bandwidth in TP groups (nccl-tests on NVLink 4
    #                                 reach 360-480 GB/s; the roofline's all-to-all figure is 256: generous to TP)
    step_overhead: float = 0.5e-3  # s per iteration outside the layers (sampling, launch, bookkeeping)
    mem_util: float = 0.9  # fraction of HBM a server claims (vLLM's gpu_memory_utilization)
    activation_reserve: float = 4e9  # bytes kept for activations and graphs per GPU

    @property
    def name(self) -> str:
        return self.roofline.name

    @property
    def link_bw(self) -> float:
        """Achieved bytes/s per GPU of collectives and KV moves."""
        return self.roofline.link_bandwidth * self.roofline.link_efficiency

    @property
    def mem_bw(self) -> float:
        return self.roofline.hbm_bandwidth * self.roofline.hbm_efficiency

    @property
    def gemm_flops(self) -> float:
        return self.roofline.peak_flops * self.roofline.gemm_efficiency


HARDWARE = {
    "h200": SimHardware(roofline.H200, hbm_bytes=141e9),
    "h100": SimHardware(roofline.H100, hbm_bytes=80e9),
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

    @classmethod
    def from_config(cls, name: str, config, dtype_bytes: int = 2) -> "ModelSpec":
        """The shapes of an engine ``ModelConfig`` (engine/models/config.py: presets, HF configs)."""
        c = config
        return cls(name, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                   c.head_dim, c.intermediate_size, c.vocab_size, c.max_position_embeddings, dtype_bytes)

    def dims(self) -> roofline.ModelDims:
        return roofline.ModelDims(self.name, self.num_layers, self.hidden, self.num_q_heads, self.num_kv_heads,
                                  self.head_dim, self.ffn, self.dtype_bytes)

    @property
    def linear_params(self) -> int:
        """Parameters of the linear layers of one decoder layer (QKV, O, gate/up/down)."""
        return self.dims().linear_params_per_layer

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


def get_hardware(name: str) -> SimHardware:
    if name.lower() not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE))}")
    return HARDWARE[name.lower()]


def kv_tokens_per_group(model: ModelSpec, hw: SimHardware, tp: int) -> int:
    """KV capacity (tokens) of a TP-``tp`` group after weights and activations (each GPU holds 1/tp)."""
    free = hw.hbm_bytes * hw.mem_util - model.weight_bytes / tp - hw.activation_reserve
    if free <= 0:
        raise ValueError(f"{model.name} does not fit on {hw.name} with TP{tp}")
    return int(free // (model.kv_bytes_per_token / tp))
