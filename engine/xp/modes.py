"""The execution modes of the XP engine (no torch: the scheduling side names them too)."""

from __future__ import annotations

from enum import Enum


class XPMode(str, Enum):
    """Execution modes of the same engine (ablations and baselines of the paper)."""

    XP = "xp"  # phase-specific parallelism, co-batched, decode attention overlapped (GPU)
    XP_NO_OVERLAP = "xp-no-overlap"  # same, decode and prefill attention one after the other
    UNIFORM_SP = "uniform-sp"  # decode attention also sequence-parallel (no phase-specific)
    UNIFORM_TP = "uniform-tp"  # one logical rank, TP over all devices (vLLM-style chunked prefill)
    NO_COBATCH = "no-cobatch"  # prefill and decode in separate iterations (LoongServe-style)


    def __str__(self) -> str:
        return self.value  # "xp", as the flag and the logs spell it

    @property
    def cobatches(self) -> bool:
        """Prefill and decode run in one iteration (all but ``no-cobatch``)."""
        return self is not XPMode.NO_COBATCH
