"""The roofline-derived lower bound on a burst's time: what ``benchmarks/gpu_serve.py`` and
``python -m benchmarks.steps trace`` print their measured times against.

Derived from the model's own config (``ModelConfig``), so the "8B" and the KV bytes per token are
the preset's, not constants written here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from conflux_cluster.engine.models.config import ModelConfig


def param_count(m: ModelConfig) -> int:
    """All parameters of the model (embedding, layers, norms, lm_head unless tied): the "8B"."""
    h, d, qd, kvd = m.hidden_size, m.head_dim, m.q_size, m.kv_size
    attn = h * (qd + 2 * kvd) + qd * h + ((qd + 2 * kvd) if m.attention_bias else 0)
    layer = attn + 3 * h * m.intermediate_size + 2 * h + (2 * d if m.qk_norm else 0)
    embed = m.vocab_size * h
    return embed + m.num_hidden_layers * layer + h + (0 if m.tie_word_embeddings else embed)


def roofline_limit(m: ModelConfig, num_requests: int, prompt_len: int, output_len: int, ranks: int,
                   dtype_bytes: int, peak_flops: float, hbm_bw: float) -> dict:
    """Lower bound on the burst's time on ``ranks`` GPUs (weights replicated per rank)::

        prefill_s = [2·P·prompt + L·2·H_q·d·prompt·(prompt+1)] · requests / (ranks · peak_flops)
        decode_s  = Σ_{j=1}^{output−1} [W + (requests/ranks)·(prompt + j)·kv_per_token] / hbm_bw

    P: parameters, W = P·dtype_bytes, kv_per_token = 2·L·H_kv·d·dtype_bytes. The first output token
    comes out of prefill; each later one costs a decode step that reads the weights and the KV of
    the rank's share of the requests. Prefill runs sequence-parallel over all ranks.
    """
    p, layers = param_count(m), m.num_hidden_layers
    attn = layers * 2 * m.q_size * prompt_len * (prompt_len + 1)  # QKᵀ and PV, causal, one prompt
    prefill_flops = num_requests * (2 * p * prompt_len + attn)
    prefill_s = prefill_flops / (ranks * peak_flops)
    kv_token = 2 * layers * m.kv_size * dtype_bytes
    per_rank = num_requests / ranks
    decode_bytes = sum(p * dtype_bytes + per_rank * (prompt_len + j) * kv_token for j in range(1, output_len))
    decode_s = decode_bytes / hbm_bw
    total = prefill_s + decode_s
    return {"parameters": p, "prefill_flops": prefill_flops, "prefill_s": prefill_s,
            "decode_steps": max(0, output_len - 1), "decode_bytes_per_rank": decode_bytes, "decode_s": decode_s,
            "total_s": total, "output_tok_s": num_requests * output_len / total,
            "peak_flops_per_gpu": peak_flops, "hbm_bytes_per_s": hbm_bw, "dtype_bytes": dtype_bytes}
