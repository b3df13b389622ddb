"""The execution modes of the XP engine (no torch: the scheduling side names them too)."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import EngineConfig


class XPMode(str, Enum):
    """Execution modes of the same engine (ablations and baselines of the paper)."""

    XP = "xp"  # phase-specific parallelism, co-batched, decode attention overlapped (GPU)
    XP_NO_OVERLAP = "xp-no-overlap"  # same, decode and prefill attention one after the other
    UNIFORM_SP = "uniform-sp"  # decode attention also sequence-parallel (no phase-specific)
    UNIFORM_TP = "uniform-tp"  # one logical rank, TP over all devices (vLLM-style chunked prefill)
    NO_COBATCH = "no-cobatch"  # prefill and decode in separate iterations (LoongServe-style)


def xp_topology(config: EngineConfig) -> EngineConfig:
    """``uniform-tp`` is one logical rank with TP over all N x k devices (vLLM-style baseline)."""
    if config.xp_mode == XPMode.UNIFORM_TP.value and config.num_ranks > 1:
        return config.model_copy(update={"tp_size": config.num_ranks * config.tp_size, "num_ranks": 1})
    return config
