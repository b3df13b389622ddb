"""Analytical (roofline) estimator profiles from hardware figures and model dimensions.

For when no profile was measured (the simulator at N=4/8, hardware we do not have). Each base
function of the latency model (App. D) gets an affine form, per layer and per logical rank of
``tp`` GPUs::

    f_GEMM(n) = n · 2·P_layer / (F·e_gemm·tp)          + W_layer / (M·e_hbm·tp) + k_lin·λ_kernel
                [+ TP all-reduces: n · 2·2(tp−1)/tp·H·b / (I·e_link) + 2·λ_coll]
    f_D(W)    = W · 2·H_kv·d·b / (M·e_hbm·tp)           + λ_kernel       (KV bytes read)
    f_P(W)    = W · 4·H_q·d / (F·e_attn·tp)             + λ_kernel       (QKᵀ and PV FLOPs)
    f_comm(n) = n · (B_QKV + B_O)·(N−1)/N / (I·e_link·tp) + 2·λ_coll     (Eq. 12, two all-to-alls)

F: peak dense FLOP/s, M: HBM bytes/s, I: per-GPU interconnect bytes/s (one direction), b: bytes
per element, P_layer / W_layer: linear parameters / bytes of one layer, B_QKV = (H_q+2H_kv)·d·b,
B_O = H_q·d·b. The memory floor and the compute slope are *added* (not max'ed), which makes the
affine GEMM model conservative in the middle of its range (≈+20-50% near the ridge point, a few
% at 4K tokens against the H200 GEMM figures in DESIGN §6). α, β are not derivable from a roofline
and default to mild contention.

Presets: ``H200`` uses the efficiencies measured on the project's 2×H200 host (DESIGN §6:
785 TFLOP/s GEMM, 580 TFLOP/s SDPA, 4.3 TB/s copy, 255 GB/s all-to-all, 45 µs small all-to-all);
``H100`` applies the same efficiencies to the H100 SXM data-sheet figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.config import PRESETS, ModelConfig
from .estimator import Affine, EstimatorProfile


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU's data-sheet figures plus achieved fractions."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    link_bandwidth: float  # bytes/s per GPU per direction (NVLink)
    gemm_efficiency: float = 0.79  # achieved fraction of peak in large GEMMs
    attn_efficiency: float = 0.59  # achieved fraction of peak in causal attention
    hbm_efficiency: float = 0.9  # achieved fraction of HBM bandwidth
    link_efficiency: float = 0.57  # achieved all-to-all bus bandwidth / link bandwidth
    kernel_latency: float = 5e-6  # seconds of fixed cost per kernel
    collective_latency: float = 45e-6  # seconds of fixed cost per collective (small message)


@dataclass(frozen=True)
class ModelDims:
    """What the latency model needs of a decoder-only transformer (Llama-style, gated FFN)."""

    name: str
    num_layers: int
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    dtype_bytes: int = 2

    @property
    def linear_params_per_layer(self) -> int:
        """QKV + O projections + gate/up/down of the FFN."""
        h, d = self.hidden, self.head_dim
        return h * (self.num_q_heads + 2 * self.num_kv_heads) * d + self.num_q_heads * d * h + 3 * h * self.ffn

    @classmethod
    def from_config(cls, name: str, config: ModelConfig, dtype_bytes: int = 2) -> "ModelDims":
        """The dims of an engine model config (``engine.models.config``: the one source of shapes)."""
        return cls(name, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, config.head_dim, config.intermediate_size, dtype_bytes)


H100 = HardwareSpec("h100", peak_flops=989e12, hbm_bandwidth=3.35e12, link_bandwidth=450e9)
H200 = HardwareSpec("h200", peak_flops=989e12, hbm_bandwidth=4.8e12, link_bandwidth=450e9)
HARDWARE = {"h100": H100, "h200": H200}

# the engine's large presets (random-weight configs of the published models)
MODELS = {name: ModelDims.from_config(name, PRESETS[name]) for name in ("llama-3.1-8b", "qwen3-14b", "qwen3-32b")}


def roofline_profile(model: ModelDims | str, hardware: HardwareSpec | str, num_ranks: int, tp: int = 1,
                     alpha: float = 1.1, beta: float = 1.1, prefill_kv_read: bool = False) -> EstimatorProfile:
    """An ``EstimatorProfile`` for ``num_ranks`` logical ranks of ``tp`` GPUs each.

    ``prefill_kv_read`` adds the (optional) KV-read term of prefill attention: per rank, its head
    shard of the (c_i + ℓ_i) history+chunk tokens, ``2·H_kv·d·b`` bytes per token of Σ(c+ℓ)/N.
    """
    m = MODELS[model] if isinstance(model, str) else model
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    if num_ranks < 1 or tp < 1:
        raise ValueError(f"num_ranks={num_ranks} and tp={tp} must be >= 1")
    b, d = m.dtype_bytes, m.head_dim
    flops, hbm = hw.peak_flops * tp, hw.hbm_bandwidth * hw.hbm_efficiency * tp
    link = hw.link_bandwidth * hw.link_efficiency
    params = m.linear_params_per_layer
    gemm = Affine(2 * params / (flops * hw.gemm_efficiency),
                  params * b / hbm + 5 * hw.kernel_latency)  # QKV, O, gate/up, down, act
    if tp > 1:  # two row-parallel all-reduces per layer inside the logical rank
        gemm = Affine(gemm.slope + 2 * 2 * (tp - 1) / tp * m.hidden * b / link,
                      gemm.intercept + 2 * hw.collective_latency)
    decode = Affine(2 * m.num_kv_heads * d * b / hbm, hw.kernel_latency)
    prefill = Affine(4 * m.num_q_heads * d / (flops * hw.attn_efficiency), hw.kernel_latency)
    if num_ranks > 1:
        per_token = ((m.num_q_heads + 2 * m.num_kv_heads) * d + m.num_q_heads * d) * b
        comm = Affine(per_token * (num_ranks - 1) / num_ranks / (link * tp), 2 * hw.collective_latency)
    else:
        comm = Affine(0.0, 0.0)
    kv_read = Affine(2 * m.num_kv_heads * d * b / hbm if prefill_kv_read else 0.0, 0.0)
    return EstimatorProfile(model=m.name, hardware=f"{hw.name}-roofline", num_ranks=num_ranks,
                            num_layers=m.num_layers, f_gemm=gemm, f_prefill_attn=prefill,
                            f_decode_attn=decode, f_comm=comm, alpha=alpha, beta=beta, f_prefill_kv=kv_read,
                            meta={"kind": "roofline", "tp": tp, "hardware": hw.__dict__.copy()})
