"""Engine configuration (validated at start-up; unknown fields are rejected with their name).

Imports no torch at module level (the CLI builds its flags from these fields).
"""

from __future__ import annotations

import logging
import re
from enum import Enum
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .kv.layout import KVLayout
from .scheduler.config import SchedulerConfig
from .xp.modes import XPMode

if TYPE_CHECKING:  # engine.models imports torch: keep it out of the CLI's start (flags come from here)
    import torch

    from .models.config import ModelConfig

log = logging.getLogger(__name__)

CPU_KV_CACHE_GB = 1.0  # the KV pool per CPU rank when kv_cache_memory_gb is None
GPU_MAX_NUM_BATCHED_TOKENS = 2048  # default fixed token budget per rank and step on GPUs


class Device(str, Enum):
    """Where ranks run: ``ServeConfig.device`` and ``EngineConfig.device`` (whose ``device_index`` may pin
    one CUDA device, spelled ``cuda:<i>``). Code asks the properties below, never compares spellings."""

    AUTO = "auto"  # serving only: cuda when the cluster has GPUs
    CPU = "cpu"
    CUDA = "cuda"

    def __str__(self) -> str:
        return self.value  # "cuda", as the flag and the logs spell it

    @classmethod
    def of(cls, device: str) -> "Device":
        """The kind of ``cpu``, ``cuda`` or ``cuda:<i>``."""
        return cls(str(device).partition(":")[0])

    @property
    def has_gpus(self) -> bool:
        """Ranks take one GPU each (NCCL between them, CUDA graphs, flash kernels)."""
        return self is Device.CUDA

    @property
    def supports_graphs(self) -> bool:
        """Steps can replay captured CUDA graphs (``EngineConfig.cuda_graphs``)."""
        return self is Device.CUDA

    @property
    def default_dtype(self) -> str:
        """The torch dtype (by name) of ``dtype: auto``: bfloat16 on GPUs, float32 on CPU."""
        return "bfloat16" if self.has_gpus else "float32"

    @property
    def collective_backend(self) -> str:
        """The torch.distributed backend between an instance's ranks: NCCL on GPUs, gloo on CPU."""
        return "nccl" if self.has_gpus else "gloo"

    def rank_bundle(self, cpus_per_rank: float) -> dict[str, float]:
        """One rank actor's placement-group bundle: a GPU (and one CPU) each on GPUs, ``cpus_per_rank``
        CPUs on CPU."""
        return {"CPU": 1.0, "GPU": 1.0} if self.has_gpus else {"CPU": cpus_per_rank}


class EngineConfig(BaseModel):
    """One XP instance: which model, where, in what precision, how much KV, how scheduled."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("smollm2-135m-instruct",
                       description="built-in name, random preset, local HF directory or .gguf file")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights, activations and KV; auto = float32 on CPU, bfloat16 on CUDA")
    device: Device = Field(Device.CPU, description="'cpu', 'cuda' or 'cuda:<i>' (rank r of N uses cuda:r)",
                           json_schema_extra={"choices": ["cpu", "cuda", "cuda:<i>"]})
    device_index: int | None = Field(
        None, ge=0, description="the one CUDA device every rank uses ('cuda:<i>' sets it); None: rank r uses cuda:r")
    num_ranks: int = Field(1, ge=1, description="logical ranks N of the XP instance")
    tp_size: int = Field(1, ge=1, description="devices per logical rank (base TP, paper App. C); N x tp_size processes")
    xp_mode: XPMode = Field(
        XPMode.XP, description="execution mode of an XP instance (engine/xp/modes.py XPMode): ablations and baselines")
    block_size: int = Field(16, ge=1, description="tokens per KV block (decode layout)")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="CUDA: fraction of each GPU's memory the engine may use for weights, "
        "activations, CUDA graphs and the KV pool; the pool gets what is left after the weights, memory other "
        "processes hold and an activation reserve (engine/kv/sizing.py). Ignored on CPU and when "
        "kv_cache_memory_gb or num_kv_blocks is set")
    kv_cache_memory_gb: float | None = Field(
        None, gt=0, le=1e6, description="KV pool budget per rank in GiB; None: 1 GiB on CPU, sized from "
        "gpu_memory_utilization on CUDA")
    num_kv_blocks: int | None = Field(None, ge=1, description="blocks per rank; overrides the memory budget")
    max_model_len: int | None = Field(None, ge=1, description="longest prompt+output; default: the model's")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    seed: int = Field(0, ge=0, description="random weights of presets and seeds of unseeded requests")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (None: leave as is)")
    load_progress: bool = Field(True, description="show a progress bar while loading weights")
    cuda_graphs: bool | None = Field(
        None, description="replay piecewise CUDA graphs of the shared-linear segments (everything between "
        "attention calls, engine/runtime/cuda_graphs.py) for bucketed token counts; attention stays eager. None (default): "
        "on for CUDA devices without base TP; True: on where possible (warns when ignored); False: off. "
        "Never on CPU or with tp_size > 1 (the TP all-reduce is not captured)")
    async_scheduling: bool = Field(
        True, description="plan and launch the next step while the ranks run this one (engine/core.py, pipelined): "
        "Ray rank actors over a compiled graph, worker processes, and one in-process rank on CUDA (engine/runtime/"
        "executor.py); a GPU rank launches step k+1 before it reads step k's tokens (engine/runtime/worker.py), so "
        "the device does not wait for token processing, streaming or the next step's host work; the same "
        "tokens either way")
    cuda_graph_max_tokens: int | None = Field(
        None, ge=1, description="largest captured token count (cuda_graphs); larger batches run eagerly. None "
        "(default): 1024, or 512 / 256 where the graphs' static buffers would take more than 5 % of the device's "
        "memory (engine/kv/sizing.py graph_max_tokens)")
    step_log: str | None = Field(
        None, description="append one JSON line per executed step to this file: its shape, measured and estimated "
        "seconds (engine/scheduler/fitting/step_log.py; samples for `conflux profile --fit-only` and benchmarks/step_logs/estimator.py). "
        "Served, instance i writes <stem>.<i>.jsonl")

    @model_validator(mode="after")
    def _gpu_token_budget(self) -> "EngineConfig":
        """On GPUs a step of 256 tokens per rank leaves the device idle between kernel launches:
        unless set explicitly, the fixed token budget (also the 'budget' profile's level) is
        ``GPU_MAX_NUM_BATCHED_TOKENS``. A fitted estimator profile picks its own level anyway."""
        if self.on_cuda and "max_num_batched_tokens" not in self.scheduler.model_fields_set:
            self.scheduler = self.scheduler.model_copy(update={"max_num_batched_tokens": GPU_MAX_NUM_BATCHED_TOKENS})
        return self

    @model_validator(mode="after")
    def _prefix_caching_mode(self) -> "EngineConfig":
        """The prefix cache when unset: on, except under uniform-sp, which keeps decode KV head-sharded (there
        is no decode layout for cached blocks to live in) and refuses it when asked for."""
        if self.scheduler.enable_prefix_caching is None:
            on = self.xp_mode is not XPMode.UNIFORM_SP
            self.scheduler = self.scheduler.model_copy(update={"enable_prefix_caching": on})
        elif self.xp_mode is XPMode.UNIFORM_SP and self.scheduler.enable_prefix_caching:
            raise ValueError("scheduler.enable_prefix_caching: not supported with xp_mode='uniform-sp' (decode "
                             "KV stays head-sharded there); turn one of them off")
        return self

    @model_validator(mode="before")
    @classmethod
    def _split_device(cls, data: object) -> object:
        """``device`` as given (a flag, a file, an argument) may be ``cuda:<i>``: that is ``device`` cuda
        and ``device_index`` i."""
        if isinstance(data, dict) and isinstance(data.get("device"), str):
            m = re.fullmatch(r"cuda:(\d+)", data["device"])
            if m is not None:
                data = {**data, "device": Device.CUDA, "device_index": int(m[1])}
        return data

    @field_validator("device", mode="before")
    @classmethod
    def _check_device(cls, v: object) -> object:
        """``auto`` is the serving layer's to resolve (``ServeConfig.device``), not an engine's device."""
        if str(v.value if isinstance(v, Device) else v) not in (Device.CPU.value, Device.CUDA.value):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<i>', got {v!r}")
        return v

    @model_validator(mode="after")
    def _index_is_cuda(self) -> "EngineConfig":
        if self.device_index is not None and not self.device.has_gpus:
            raise ValueError(f"device_index: {self.device_index} names a CUDA device but device is {self.device}")
        return self

    @property
    def on_cuda(self) -> bool:
        """Ranks run on CUDA devices (``cuda`` or ``cuda:<i>``)."""
        return self.device.has_gpus

    @property
    def device_name(self) -> str:
        """``device`` as torch and the logs spell it: ``cpu``, ``cuda`` or ``cuda:<i>``."""
        return str(self.device) if self.device_index is None else f"{self.device}:{self.device_index}"

    def require_device(self, index: bool = True) -> None:
        """ValueError naming ``device`` where this process cannot run on it: CUDA asked for but none is
        available, or (``index``) ``cuda:<i>`` past the devices present. Called where ranks are built in
        this process, not at validation: a CPU-only Ray driver configures GPU ranks it never runs."""
        if not self.on_cuda:
            return
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = "" if torch.version.cuda else f" (this torch {torch.__version__} is built without CUDA)"
            raise ValueError(f"device: {self.device_name} requested but no CUDA device is available{why}; "
                             "use device 'cpu'")
        i = self.device_index or 0
        if index and i >= count:
            raise ValueError(f"device: {self.device_name} requested but this machine has {count} CUDA device(s) "
                             f"(cuda:0..cuda:{count - 1})")

    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.device.default_dtype if self.dtype == "auto" else self.dtype)

    def rank_device(self, rank: int) -> torch.device:
        import torch

        if not self.on_cuda:
            return torch.device("cpu")
        return torch.device("cuda", rank if self.device_index is None else self.device_index)

    def blocks_per_rank(self, model: ModelConfig) -> int | None:
        """Physical KV blocks in each rank's pool, or None where each rank sizes it from device memory
        after loading its weights (CUDA without ``kv_cache_memory_gb``/``num_kv_blocks``; engine/kv/sizing.py).
        The scheduler is given the number the ranks used (``Executor.blocks_per_rank``)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        if self.kv_cache_memory_gb is None and self.on_cuda:
            return None
        from .kv.cache import blocks_for_budget

        gb = CPU_KV_CACHE_GB if self.kv_cache_memory_gb is None else self.kv_cache_memory_gb
        n = blocks_for_budget(model, self.torch_dtype(), self.block_size, int(gb * 2**30))
        if n < 1:
            raise ValueError(f"kv_cache_memory_gb={gb} holds no KV block of this model")
        return n

    def kv_sizing_rule(self) -> str:
        """How ``blocks_per_rank`` is decided (for the start-up log)."""
        if self.num_kv_blocks is not None:
            return "num_kv_blocks (set)"
        if self.kv_cache_memory_gb is not None:
            return f"kv_cache_memory_gb={self.kv_cache_memory_gb:g}"
        if not self.on_cuda:
            return f"kv_cache_memory_gb={CPU_KV_CACHE_GB:g} (CPU default)"
        return (f"gpu_memory_utilization={self.gpu_memory_utilization:g} (measured on each rank after loading "
                "weights, minimum over the ranks)")

    def cuda_graphs_enabled(self) -> bool:
        """Whether ranks replay piecewise CUDA graphs (``cuda_graphs``: None = auto)."""
        return self.device.supports_graphs and self.tp_size == 1 and self.cuda_graphs is not False

    def describe(self, model: ModelConfig, blocks_per_rank: int, max_model_len: int) -> str:
        """The effective configuration of a built engine, one aspect a line (the start-up log)."""
        from .kv.cache import bytes_per_block

        dtype = str(self.torch_dtype()).removeprefix("torch.")
        pool_gib = blocks_per_rank * bytes_per_block(model, self.torch_dtype(), self.block_size) / 2**30
        graphs = (f"on, up to {self.cuda_graph_max_tokens or 'auto (by device memory)'} tokens"
                  if self.cuda_graphs_enabled() else "off")
        sched = ", ".join(f"{k}={v}" for k, v in self.scheduler.model_dump().items())
        return "\n".join([
            f"  model          {self.model} ({model.architecture}, {model.num_hidden_layers} layers, hidden "
            f"{model.hidden_size}, {model.num_attention_heads}/{model.num_key_value_heads} q/kv heads)",
            f"  placement      {self.num_ranks} logical ranks x tp_size {self.tp_size} on {self.device_name}, "
            f"dtype {dtype}, xp_mode {self.xp_mode}",
            f"  KV pool        {blocks_per_rank} blocks/rank x {self.block_size} tokens = "
            f"{blocks_per_rank * self.block_size} tokens/rank ({pool_gib:.2f} GiB/rank); sized by "
            f"{self.kv_sizing_rule()}",
            f"  max_model_len  {max_model_len} (model: {model.max_position_embeddings}, "
            f"config: {self.max_model_len})",
            f"  cuda graphs    {graphs} (cuda_graphs={self.cuda_graphs})",
            f"  scheduler      {sched}",
        ] + ([f"  step log       {self.step_log} (served: <stem>.<instance>.jsonl)"] if self.step_log else []))

    def kv_layout(self, model: ModelConfig) -> KVLayout:
        return KVLayout.build(self.block_size, model.num_attention_heads, model.num_key_value_heads, self.num_ranks)

    def pool_context_limit(self, model: ModelConfig, blocks_per_rank: int) -> int:
        """Longest prompt+output one rank's pool of ``blocks_per_rank`` blocks admits (0: none): the
        scheduler's own admission rule (``KVAccounting.max_context_alone``: the decode rank holds the
        whole context plus, while prefill finishes, its head-sharded prompt shard (one rank: the prompt's
        blocks become the decode's), and the headroom)."""
        from .scheduler.kv_accounting import KVAccounting

        fit = KVAccounting(self.kv_layout(model), blocks_per_rank).max_context_alone(self.scheduler.headroom_blocks)
        return min(fit, model.max_position_embeddings)

    def context_limit(self, model: ModelConfig, blocks_per_rank: int | None = None) -> int:
        """Effective max_model_len: the config's (or the model's) context, capped, given ``blocks_per_rank``,
        by what one rank's KV pool holds. Start-up errors: an explicit ``max_model_len`` longer than the
        model's context (as vLLM: positions past it were never trained) or than the pool holds; a pool that
        holds no request at all."""
        if self.max_model_len is not None and self.max_model_len > model.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} is longer than the model's context "
                             f"({model.max_position_embeddings} tokens, max_position_embeddings of {self.model}); "
                             "lower max_model_len or leave it unset")
        limit = self.max_model_len or model.max_position_embeddings
        if blocks_per_rank is None:
            return limit
        fit = self.pool_context_limit(model, blocks_per_rank)
        if fit >= limit:
            return limit
        pool = (f"one rank's KV pool ({blocks_per_rank} blocks of {self.block_size} tokens, sized by "
                f"{self.kv_sizing_rule()}) holds requests of at most {fit} tokens")
        if fit < 1 or self.max_model_len is not None:
            raise ValueError(f"max_model_len={limit}: {pool}; lower max_model_len or give the pool more memory "
                             "(gpu_memory_utilization, kv_cache_memory_gb or num_kv_blocks)")
        log.warning("max_model_len capped to %d tokens (the model allows %d): %s; raise gpu_memory_utilization, "
                    "kv_cache_memory_gb or num_kv_blocks, or set max_model_len", fit, limit, pool)
        return fit


def xp_topology(config: EngineConfig) -> EngineConfig:
    """``uniform-tp`` is one logical rank with TP over all N x k devices (vLLM-style baseline)."""
    if config.xp_mode is XPMode.UNIFORM_TP and config.num_ranks > 1:
        return config.model_copy(update={"tp_size": config.num_ranks * config.tp_size, "num_ranks": 1})
    return config
