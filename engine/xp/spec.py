"""What an XP instance is made of: its config after ``xp_topology`` and its model source, picklable
so that each spawned worker gets it (``engine/runtime/build.py`` builds a device's worker from it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..loader import ModelSource

@dataclass(frozen=True)
class XPInstanceSpec:
    """Everything a worker process needs (picklable; sent to each spawned worker)."""

    config: EngineConfig  # after ``xp_topology``
    source: ModelSource  # resolved once in the parent (config + where weights live)
    weights: str | None = None  # file from ``export_weights``: workers mmap it instead of loading

    @property
    def world_size(self) -> int:
        return self.config.num_ranks * self.config.tp_size

def export_weights(model: torch.nn.Module, path: str) -> str:
    """Save a loaded model's tensors once, so N x k workers need not each load/dequantize."""
    torch.save(model.state_dict(), path)
    return path
