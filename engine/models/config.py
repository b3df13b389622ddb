"""One model description for every supported architecture (Llama family, Qwen3).

Built from a Hugging Face ``config.json`` dict, from GGUF metadata, or from a named preset.
Only dense decoder-only models with RMSNorm, SwiGLU and rotary embeddings are covered.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class RopeScaling(BaseModel):
    """Llama-3 style frequency scaling (``rope_type: llama3``); other types are rejected."""

    model_config = ConfigDict(extra="forbid")

    factor: float = Field(8.0, gt=0, description="wavelength stretch for low frequencies")
    low_freq_factor: float = Field(1.0, gt=0, description="below old_ctx/low_freq_factor: scaled")
    high_freq_factor: float = Field(4.0, gt=0, description="above old_ctx/high_freq_factor: unscaled")
    original_max_position_embeddings: int = Field(8192, ge=1, description="pre-extension context")


class ModelConfig(BaseModel):
    """Architecture facts the engine needs; field names follow Hugging Face where they exist."""

    model_config = ConfigDict(extra="forbid")

    architecture: Literal["llama", "qwen3"] = Field(description="llama: Llama/SmolLM2; qwen3: q/k RMSNorm")
    vocab_size: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1, description="SwiGLU inner width")
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1, description="query heads H_q")
    num_key_value_heads: int = Field(ge=1, description="KV heads H_kv (GQA when < H_q)")
    head_dim: int = Field(ge=1, description="D, per head")
    rms_norm_eps: float = Field(1e-6, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = Field(None, description="llama3 scaling, or None for plain RoPE")
    max_position_embeddings: int = Field(4096, ge=1, description="longest context (prompt + output)")
    tie_word_embeddings: bool = Field(False, description="lm_head shares the embedding matrix")
    attention_bias: bool = Field(False, description="bias on q/k/v projections")
    qk_norm: bool = Field(False, description="RMSNorm over head_dim on q and k before RoPE (Qwen3)")
    bos_token_id: int | None = None
    eos_token_ids: list[int] = Field(default_factory=list, description="any of these ends a request")

    def model_post_init(self, __context: Any) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face ``config.json`` dict (transformers 4.x and 5.x spellings)."""
        mtype = cfg.get("model_type", "")
        arch = {"llama": "llama", "qwen3": "qwen3"}.get(mtype)
        if arch is None:
            raise ValueError(f"model_type={mtype!r} is not supported (supported: llama, qwen3)")
        heads = int(cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=_parse_scaling(scaling),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )


def _parse_scaling(scaling: dict[str, Any] | None) -> RopeScaling | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: llama3)")
    keys = RopeScaling.model_fields.keys()
    return RopeScaling(**{k: v for k, v in scaling.items() if k in keys})


_LLAMA3_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)

# Named presets with random weights (for speed work; configs are the published facts, DESIGN §7).
PRESETS: dict[str, ModelConfig] = {
    "llama-3.1-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=[128001, 128008, 128009]),
    "qwen3-14b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=17408,
        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, qk_norm=True,
        eos_token_ids=[151645, 151643]),
    "qwen3-32b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
        num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, qk_norm=True,
        eos_token_ids=[151645, 151643]),
    # Tiny configs for tests (byte-level tokenizer: vocab covers 256 bytes + specials).
    "tiny-llama": ModelConfig(
        architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
        max_position_embeddings=2048, eos_token_ids=[257]),
    "tiny-qwen3": ModelConfig(
        architecture="qwen3", vocab_size=320, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=2048, qk_norm=True,
        tie_word_embeddings=True, eos_token_ids=[257]),
}
