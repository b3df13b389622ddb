"""Executors run a ``StepInput`` on all ranks of an instance and return one ``StepResult``.

``LocalExecutor`` is the N=1 case: one ``RankWorker`` in this process. Multi-rank executors
(torch.multiprocessing workers, Ray actors) implement the same protocol elsewhere.
"""

from __future__ import annotations

from typing import Protocol

from .config import EngineConfig
from .loader import ModelSource
from .plan import StepResult
from .worker import RankWorker, StepInput


class Executor(Protocol):
    # physical KV blocks in every rank's pool, as the ranks allocated them (on CUDA each rank sizes
    # its pool after loading weights, engine/kv_sizing.py); the scheduler mirrors this number
    blocks_per_rank: int

    def execute(self, step_input: StepInput) -> StepResult: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """One rank, in-process."""

    def __init__(self, config: EngineConfig, source: ModelSource | None = None,
                 worker: RankWorker | None = None) -> None:
        """``worker`` None: the torch paged backend (the reference); ``engine.xp.spec.local_worker``
        picks the fastest backend for the device."""
        if config.num_ranks != 1:
            raise ValueError(f"LocalExecutor runs one rank; num_ranks={config.num_ranks} needs an XP executor")
        self.worker: RankWorker | None = worker if worker is not None else RankWorker(config, rank=0, source=source)
        self.blocks_per_rank = self.worker.kv.num_blocks

    def execute(self, step_input: StepInput) -> StepResult:
        if self.worker is None:
            raise RuntimeError("LocalExecutor.execute after shutdown")
        return self.worker.execute(step_input)

    def check_invariants(self) -> None:
        self.worker.check_invariants()

    def shutdown(self) -> None:
        """Release the rank's weights, KV pool and graphs (GPU memory back to the device); the
        executor cannot run steps afterwards."""
        import gc

        import torch

        self.worker = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
