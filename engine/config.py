"""Engine configuration (validated at start-up; unknown fields are rejected with their name)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .kv_cache import blocks_for_budget
from .models.config import ModelConfig
from .scheduler.config import SchedulerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineConfig(BaseModel):
    """One XP instance: which model, where, in what precision, how much KV, how scheduled."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("smollm2-135m-instruct",
                       description="built-in name, random preset, local HF directory or .gguf file")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights, activations and KV; auto = float32 on CPU, bfloat16 on CUDA")
    device: str = Field("cpu", description="'cpu', 'cuda' or 'cuda:<i>' (rank r of N uses cuda:r)")
    num_ranks: int = Field(1, ge=1, description="logical ranks N of the XP instance")
    tp_size: int = Field(1, ge=1, description="devices per logical rank (base TP, paper App. C); N x tp_size processes")
    xp_mode: Literal["xp", "xp-no-overlap", "uniform-sp", "uniform-tp", "no-cobatch"] = Field(
        "xp", description="execution mode of an XP instance (engine/xp/meta.py XPMode): ablations and baselines")
    block_size: int = Field(16, ge=1, description="tokens per KV block (decode layout)")
    kv_cache_memory_gb: float = Field(1.0, gt=0, description="KV pool budget per rank in GiB")
    num_kv_blocks: int | None = Field(None, ge=1, description="blocks per rank; overrides the memory budget")
    max_model_len: int | None = Field(None, ge=1, description="longest prompt+output; default: the model's")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    seed: int = Field(0, ge=0, description="random weights of presets and seeds of unseeded requests")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (None: leave as is)")
    load_progress: bool = Field(True, description="show a progress bar while loading weights")
    cuda_graphs: bool | None = Field(
        None, description="replay piecewise CUDA graphs of the shared-linear segments (everything between "
        "attention calls, engine/cuda_graphs.py) for bucketed token counts; attention stays eager. None (default): "
        "on for CUDA devices without base TP; True: on where possible (warns when ignored); False: off. "
        "Never on CPU or with tp_size > 1 (the TP all-reduce is not captured)")
    cuda_graph_max_tokens: int = Field(512, ge=1, description="largest captured token count (cuda_graphs); "
                                       "larger batches run eagerly")

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if v != "cpu" and not v.startswith("cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<i>', got {v!r}")
        return v

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        return _DTYPES[self.dtype]

    def rank_device(self, rank: int) -> torch.device:
        if self.device == "cpu":
            return torch.device("cpu")
        if self.device == "cuda":
            return torch.device("cuda", rank)
        return torch.device(self.device)

    def blocks_per_rank(self, model: ModelConfig) -> int:
        """Physical KV blocks in each rank's pool (the scheduler is given the same number)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        n = blocks_for_budget(model, self.torch_dtype(), self.block_size, int(self.kv_cache_memory_gb * 2**30))
        if n < 1:
            raise ValueError(f"kv_cache_memory_gb={self.kv_cache_memory_gb} holds no KV block of this model")
        return n

    def context_limit(self, model: ModelConfig) -> int:
        return min(self.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
