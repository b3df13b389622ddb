"""Executors run a ``StepInput`` on all ranks of an instance and return one ``StepResult``.

``LocalExecutor`` is the N=1 case: one ``RankWorker`` in this process. Multi-rank executors
(torch.multiprocessing workers, Ray actors) implement the same protocol elsewhere.

``submit`` hands a step over and returns at once where the executor can run it in the background
(``overlaps``); the engine then plans the next step while this one runs (``EngineCore``,
pipelined). Steps run in submission order; results are collected in that order.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from ..config import EngineConfig
from ..loader import ModelSource
from ..contracts.step import StepInput, StepResult

if TYPE_CHECKING:
    import torch

    from .worker import RankWorker  # imports torch: a process that only schedules (an XP replica) needs none


class Executor(Protocol):
    # physical KV blocks in every rank's pool, as the ranks allocated them (on CUDA each rank sizes
    # its pool after loading weights, engine/kv/sizing.py); the scheduler mirrors this number
    blocks_per_rank: int

    # True: ``submit`` returns before the step ran (the engine may pipeline steps)
    overlaps: bool

    def execute(self, step_input: StepInput) -> StepResult: ...

    def submit(self, step_input: StepInput) -> PendingStep: ...

    def shutdown(self) -> None: ...


class PendingStep(Protocol):
    """A submitted step; ``result()`` waits for its ``StepResult`` (call once, in submission order)."""

    def result(self) -> StepResult: ...


class LocalExecutor:
    """One rank, in-process. ``threaded``: ``submit`` runs steps on one background thread, so the caller
    plans the next step while this one runs (torch releases the GIL while it computes or waits for the
    device). Off by default: on one H200 (1 x Llama-3.1-8B, 64 x 2K/128) the step thread's
    kernel launches and the caller's token processing contend for the GIL, and the offline burst ran at
    1,205 output tok/s threaded vs 1,316 not (medians of 3); rank actors and worker processes overlap
    without sharing a GIL."""

    def __init__(self, config: EngineConfig, source: ModelSource | None = None,
                 worker: RankWorker | None = None, threaded: bool = False) -> None:
        """``worker`` None: the torch paged backend (the reference); ``runtime.build.local_worker``
        picks the fastest backend for the device."""
        if config.num_ranks != 1:
            raise ValueError(f"LocalExecutor runs one rank; num_ranks={config.num_ranks} needs an XP executor")
        if worker is None:
            from .worker import RankWorker

            worker = RankWorker(config, rank=0, source=source)
        self.worker: RankWorker | None = worker
        self.blocks_per_rank = self.worker.kv.num_blocks
        self.overlaps = threaded
        self._thread: ThreadPoolExecutor | None = None  # created by the first submit (threaded)

    def execute(self, step_input: StepInput) -> StepResult:
        if self.worker is None:
            raise RuntimeError("LocalExecutor.execute after shutdown")
        return self.worker.execute(step_input)

    def submit(self, step_input: StepInput) -> Future:
        if not self.overlaps:
            done: Future = Future()
            done.set_result(self.execute(step_input))
            return done
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="rank0-step", initializer=_bind_device,
                                              initargs=(self.worker.device,))
        return self._thread.submit(self.execute, step_input)

    def check_invariants(self) -> None:
        self.worker.check_invariants()

    def shutdown(self) -> None:
        """Release the rank's weights, KV pool and graphs (GPU memory back to the device); the
        executor cannot run steps afterwards."""
        import gc

        import torch

        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self.worker = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _bind_device(device: "torch.device") -> None:
    """A step thread uses its rank's GPU as the current device (kernels launched without an explicit
    device, Triton's included)."""
    import torch

    if device.type == "cuda":
        torch.cuda.set_device(device)


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
