"""Executors run a ``StepInput`` on all ranks of an instance and return one ``StepResult``.

``LocalExecutor`` is the N=1 case: one ``RankWorker`` in this process. Multi-rank executors
(torch.multiprocessing workers, Ray actors) implement the same protocol elsewhere.

``submit`` hands a step over and returns at once where the executor can run it in the background
(``overlaps``); the engine then plans the next step while this one runs (``EngineCore``,
pipelined). Steps run in submission order; results are collected in that order.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

from ..config import EngineConfig
from ..loader import ModelSource
from ..contracts.step import StepInput, StepResult

if TYPE_CHECKING:
    from .worker import RankWorker  # imports torch: a process that only schedules (an XP replica) needs none


class Executor(Protocol):
    # physical KV blocks in every rank's pool, as the ranks allocated them (on CUDA each rank sizes
    # its pool after loading weights, engine/kv/sizing.py); the scheduler mirrors this number
    blocks_per_rank: int

    # True: ``submit`` returns before the step ran (the engine may pipeline steps)
    overlaps: bool

    # True: the ranks launch a submitted step before they read the step before it (CUDA), so that step's
    # tokens come back only once the new one is launched; the engine keeps a step that carries prefill
    # from being launched over an unread decode-only step (``EngineCore._reads_decode_step_first``)
    launches_ahead: bool

    def execute(self, step_input: StepInput) -> StepResult: ...

    def submit(self, step_input: StepInput) -> PendingStep: ...

    def shutdown(self) -> None: ...


class PendingStep(Protocol):
    """A submitted step; ``result()`` waits for its ``StepResult`` (call once, in submission order)."""

    def result(self) -> StepResult: ...


class LocalExecutor:
    """One rank, in-process. ``overlap``: ``submit`` launches the step (``RankWorker.launch``: its work
    queued on the device) and returns; its ``result()`` reads the tokens. The engine then plans and
    launches step k+1 while the device still runs step k, in the caller's thread (no step thread whose
    kernel launches would contend with token processing for the GIL). None (default): on CUDA with
    ``async_scheduling``; on a CPU the step runs inside ``launch``, so there is nothing to overlap."""

    def __init__(self, config: EngineConfig, source: ModelSource | None = None,
                 worker: RankWorker | None = None, overlap: bool | None = None) -> None:
        """``worker`` None: the torch paged backend (the reference); ``runtime.build.local_worker``
        picks the fastest backend for the device."""
        if config.num_ranks != 1:
            raise ValueError(f"LocalExecutor runs one rank; num_ranks={config.num_ranks} needs an XP executor")
        if worker is None:
            from .worker import RankWorker

            worker = RankWorker(config, rank=0, source=source)
        self.worker: RankWorker | None = worker
        self.blocks_per_rank = self.worker.kv.num_blocks
        if overlap is None:
            overlap = config.async_scheduling and worker.device.type == "cuda"
        self.overlaps = overlap
        self.launches_ahead = overlap  # ``launch`` queues the step and returns (on a CPU it runs it in place)

    def execute(self, step_input: StepInput) -> StepResult:
        if self.worker is None:
            raise RuntimeError("LocalExecutor.execute after shutdown")
        return self.worker.execute(step_input)

    def submit(self, step_input: StepInput) -> PendingStep:
        if not self.overlaps:
            done: Future = Future()
            done.set_result(self.execute(step_input))
            return done
        if self.worker is None:
            raise RuntimeError("LocalExecutor.submit after shutdown")
        return _LaunchedStep(self.worker, self.worker.launch(step_input))

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


class _LaunchedStep:
    """A step ``LocalExecutor.submit`` launched; ``result()`` waits for its tokens."""

    def __init__(self, worker: RankWorker, launched) -> None:
        self._worker, self._launched = worker, launched

    def result(self) -> StepResult:
        return self._worker.finish(self._launched)


def instance_executor(config: EngineConfig, source: ModelSource | None = None):
    """The executor of one instance as ``conflux serve`` runs it outside Ray: one device in process
    (``local_worker``), N ranks as worker processes (gloo / NCCL). ``LLM``, ``conflux profile`` and
    the benchmarks build it here, so what they run and measure is what is served."""
    from ..loader import resolve_model  # torch-free; the two below import torch
    from .build import local_worker
    from .multiproc import MultiprocExecutor

    config.require_device()
    source = source or resolve_model(config.model)
    if config.num_ranks * config.tp_size == 1:
        return LocalExecutor(config, source, worker=local_worker(config, source))
    return MultiprocExecutor(config, source)
