"""Shared helpers for the engine tests: tiny HF checkpoints written by the tests themselves,
and an engine over a model with the byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.tokenizer import ByteTokenizer

TINY_COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                   bos_token_id=256, eos_token_id=257, pad_token_id=0)


def hf_tiny_model(kind: str, seed: int = 0):
    """A random-init transformers model, weights scaled so logits are O(1) (a meaningful tolerance)."""
    import transformers

    torch.manual_seed(seed)
    if kind == "llama-rope-scaling":
        cfg = transformers.LlamaConfig(
            **TINY_COMMON, head_dim=16, tie_word_embeddings=False, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


def save_hf(model, path: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    return path


def byte_engine(model: str, chunk: int = 16, num_kv_blocks: int | None = 256, block_size: int = 4,
                dtype: str = "float32", max_num_seqs: int = 256, pipelined: bool = False,
                enable_prefix_caching: bool = False) -> EngineCore:
    """EngineCore (one rank, CPU) with the byte-level tokenizer over any model (preset or directory).
    Not pipelined by default: white-box tests look at the rank between steps (nothing runs then)."""
    cfg = EngineConfig(model=model, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
                       load_progress=False, async_scheduling=pipelined,
                       scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=max_num_seqs,
                                                 enable_prefix_caching=enable_prefix_caching))
    src = resolve_model(model)
    return EngineCore(cfg, LocalExecutor(cfg, src, overlap=pipelined), source=src, tokenizer=ByteTokenizer())


def drain(core: EngineCore, plans: list | None = None) -> dict[str, list[int]]:
    """Step until nothing is left; returns output tokens per request (optionally records plans)."""
    tokens: dict[str, list[int]] = {}
    execute = core.executor.execute
    if plans is not None:
        def recording(step_input):
            plans.append(step_input.plan)
            return execute(step_input)
        core.executor.execute = recording
    for _ in range(100000):
        if not core.has_unfinished():
            break
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    if plans is not None:
        core.executor.execute = execute
    return tokens


def tiny_long_source(max_position_embeddings: int = 8192):
    """A one-layer random model ('tiny-long') whose context allows prompts of several thousand tokens."""
    from conflux_cluster.engine.loader import ModelSource
    from conflux_cluster.engine.models.config import ModelConfig

    mc = ModelConfig(architecture="llama", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                     max_position_embeddings=max_position_embeddings, tie_word_embeddings=False)
    return ModelSource("tiny-long", "preset", None, mc)


class SlowExecutor:
    """``inner`` with every step ``delay_s`` longer (a host stall the estimate does not know of)."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def execute(self, step_input):
        import time

        time.sleep(self.delay_s)
        return self.inner.execute(step_input)
