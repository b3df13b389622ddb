"""Model definitions: ``ModelConfig`` and the presets (Llama family, Qwen3; ``config``, torch-free,
so the scheduler's roofline and the simulator read shapes from here without torch) and the
single-device ``CausalLM`` (``transformer``, torch: import it from there)."""

from .config import PRESETS, ModelConfig, RopeScaling

__all__ = ["PRESETS", "ModelConfig", "RopeScaling"]
