"""Model definitions: ``ModelConfig`` (Llama family, Qwen3) and the single-device ``CausalLM``."""

from .config import PRESETS, ModelConfig, RopeScaling
from .transformer import AttentionFn, CausalLM

__all__ = ["PRESETS", "AttentionFn", "CausalLM", "ModelConfig", "RopeScaling"]
