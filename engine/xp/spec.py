"""What an XP instance is made of, and how one device builds its runner from it.

``XPInstanceSpec`` is small and picklable: it travels to every worker process, which loads the
model itself (random weights for presets are seeded, so every device gets the same ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plan import StepResult
from .attention import XPAttention
from .comm import XPGroups
from .heads import DeviceHeads
from .kv import XPKVCache
from .meta import XPMode
from .runner import XPRunner, XPStepInput
from .tp import apply_tp


@dataclass(frozen=True)
class XPInstanceSpec:
    """One XP instance: ``num_ranks`` logical ranks, each a TP group of ``tp_size`` devices."""

    model: str  # built-in name, GGUF file or HF directory (engine.loader.resolve_model)
    num_ranks: int = 1  # N: logical ranks (Ulysses SP degree for prefill)
    tp_size: int = 1  # k: devices per logical rank (base TP, paper App. C)
    mode: XPMode = XPMode.XP
    config: object | None = None  # ModelConfig overriding ``model`` (random weights; tests)
    dtype: str = "float32"  # torch dtype name of weights, activations and KV
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL, one GPU per worker)
    block_size: int = 16  # tokens per KV block in the decode layout
    num_blocks: int = 256  # KV blocks per device
    seed: int = 0  # random-weight seed (presets / config override)
    weights: str | None = None  # file from ``export_weights``: devices mmap it instead of loading
    threads_per_worker: int = 1  # torch intra-op threads per worker process

    def __post_init__(self) -> None:
        mode = XPMode(self.mode)
        object.__setattr__(self, "mode", mode)
        if self.num_ranks < 1 or self.tp_size < 1:
            raise ValueError(f"ranks={self.num_ranks} and tp_size={self.tp_size} must be >= 1")
        if mode == XPMode.UNIFORM_TP and self.num_ranks > 1:  # one logical rank, TP over all devices
            object.__setattr__(self, "tp_size", self.num_ranks * self.tp_size)
            object.__setattr__(self, "num_ranks", 1)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} must be 'cpu' or 'cuda'")

    @property
    def world_size(self) -> int:
        return self.num_ranks * self.tp_size


def export_weights(model: torch.nn.Module, path: str) -> str:
    """Save a loaded model (config + tensors) once, so N x k workers need not each load/dequantize."""
    torch.save({"config": model.config, "state_dict": model.state_dict()}, path)
    return path


def _load(spec: XPInstanceSpec, device: torch.device):
    from ..loader import ModelSource, load_model, resolve_model  # pydantic: only where a model loads

    if spec.weights is not None:
        from ..models.weights import build_empty

        blob = torch.load(spec.weights, map_location="cpu", mmap=True, weights_only=False)
        model = build_empty(blob["config"], getattr(torch, spec.dtype), device)
        model.load_state_dict(blob["state_dict"])
        return model.eval()
    source = (ModelSource(spec.model, "preset", None, spec.config) if spec.config is not None
              else resolve_model(spec.model))
    return load_model(source, getattr(torch, spec.dtype), device, progress=False, seed=spec.seed)


def build_runner(spec: XPInstanceSpec, world_rank: int) -> XPRunner:
    """Build device ``world_rank``'s model, KV pool, XP attention and runner (after joining the group)."""
    if spec.world_size > 1:
        groups = XPGroups.create(spec.num_ranks, spec.tp_size)
    else:
        groups = XPGroups.single()
    device = torch.device("cpu")
    if spec.device == "cuda":
        device = torch.device("cuda", world_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model = _load(spec, device)
    cfg = model.config
    heads = DeviceHeads.build(cfg.num_attention_heads, cfg.num_key_value_heads, spec.num_ranks,
                              spec.tp_size, groups.rank, groups.tp_rank)
    apply_tp(model, heads, groups.tp_rank, spec.tp_size, groups.tp)
    kv = XPKVCache(cfg.num_hidden_layers, spec.num_blocks, spec.block_size, heads.num_kv,
                   heads.sp_shard.num_kv, cfg.head_dim, getattr(torch, spec.dtype), device)
    attn = XPAttention(heads, kv, groups, cfg.head_dim ** -0.5, spec.mode)
    return XPRunner(model, attn, spec.mode, device, report=groups.tp_rank == 0)


class LocalXPExecutor:
    """One logical rank of one device, in this process (the N = 1 reference; no process group)."""

    def __init__(self, spec: XPInstanceSpec) -> None:
        if spec.world_size != 1:
            raise ValueError("LocalXPExecutor runs exactly one device; use MultiprocExecutor")
        self.spec = spec
        self.runner = build_runner(spec, 0)

    def execute(self, step_input: XPStepInput) -> StepResult:
        return self.runner.execute(step_input)

    def kv_free(self) -> list[bool]:
        return [self.runner.kv_is_free()]

    def set_mode(self, mode: XPMode | str) -> None:
        self.runner.set_mode(XPMode(mode))

    def shutdown(self) -> None:
        pass
