"""One Ray actor per logical rank (one per GPU; CPU ranks on CPU), hosting the engine's rank worker.

The actor holds no model math: it builds the same worker class the in-process and multiprocess
executors use, joins the instance's process group first when N > 1 (gloo on CPU, NCCL on GPU; rank 0 hosts the
rendezvous store on a port the OS picks), and runs one ``StepInput`` per call.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import ray

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.contracts.step import RankMemory, RankReply, RankSetup, Rendezvous, StepInput

if TYPE_CHECKING:  # torch: imported in the actor's process only, when it builds its worker
    from torch.distributed import TCPStore

    from conflux_cluster.engine.runtime.worker import LaunchedStep, RankWorker


class RankActorImpl:
    """Body of the rank actor (kept a plain class so it can be tested and wrapped with options)."""

    def __init__(self, rank: int, num_ranks: int, torch_threads: int = 1) -> None:
        self.rank, self.num_ranks = rank, num_ranks
        self.torch_threads = torch_threads
        self.worker: RankWorker | None = None  # built by ``setup``
        # execute_ahead: the step launched last, when its launch began, and how long the launch took
        self._ahead: tuple[LaunchedStep, float, float] | None = None
        self._busy_until = 0.0  # perf_counter when the latest step's tokens were read
        self._store: TCPStore | None = None  # rank 0: the rendezvous TCPStore, alive as long as the actor

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        import os

        return os.getpid()

    def host_rendezvous(self, backend: str) -> Rendezvous:
        """Rank 0: host the group's TCPStore on a port the OS picks; return where to find it."""
        from conflux_cluster.engine.xp.launch import host_store

        # 127.0.0.1 is right: an instance's ranks share one node (STRICT_PACK placement group).
        self._store, rdv = host_store(self.num_ranks, backend)  # keep the store alive
        return rdv

    def setup(self, engine_config: EngineConfig, rendezvous: Rendezvous | None, blocks_per_rank: int | None = None) -> RankSetup:
        """Join the process group (N > 1) and build the rank worker. ``blocks_per_rank`` None: the rank
        sizes its KV pool (engine/kv/sizing.py; the ranks agree on the minimum)."""
        import torch

        torch.set_num_threads(self.torch_threads)
        from conflux_cluster.actors.worker_factory import build_rank_worker

        t0 = time.perf_counter()
        self.worker = build_rank_worker(engine_config, self.rank, rendezvous, blocks_per_rank)
        graphed = self.worker.graphed
        return RankSetup(self.node_id(), self.worker.kv.num_blocks, time.perf_counter() - t0,
                         graphed.capture_s if graphed is not None else 0.0)

    def execute(self, step_input: StepInput) -> RankReply:
        t0 = time.perf_counter()
        result = self.worker.execute(step_input)
        return RankReply(result, time.perf_counter() - t0)

    def execute_ahead(self, step_input: StepInput | None) -> RankReply | None:
        """The compiled graph's call: launch ``step_input`` (None: nothing), then return the reply of the
        step the previous call launched (None: it launched nothing). The rank prepares step k+1 on the
        host while its device still runs step k; ``RayExecutor`` reads each step's reply from the call
        after it. ``compute_s``: from the step's launch (or the previous step's end, if later) to its end;
        ``launch_s``: the host time of its ``launch`` (a launch as long as the step waited on the device)."""
        t0 = time.perf_counter()
        launched = self.worker.launch(step_input) if step_input is not None else None
        prev = self._ahead
        self._ahead = (launched, t0, time.perf_counter() - t0) if launched is not None else None
        if prev is None:
            return None
        result = self.worker.finish(prev[0])
        now = time.perf_counter()
        busy, self._busy_until = now - max(prev[1], self._busy_until), now
        return RankReply(result, busy, prev[2])

    def freeze_heap(self) -> int:
        """After the instance's warm-up: this rank process's start-up objects leave the collector's walk
        (engine/util/gc_heap.py); returns how many are frozen."""
        from conflux_cluster.engine.util.gc_heap import freeze_heap

        return freeze_heap()

    def memory(self) -> RankMemory:
        import psutil
        import torch

        rss = psutil.Process().memory_info().rss / 2**20
        if not torch.cuda.is_initialized():
            return RankMemory(round(rss, 1), None, None)
        return RankMemory(round(rss, 1), round(torch.cuda.memory_allocated() / 2**20, 1),
                          round(torch.cuda.memory_reserved() / 2**20, 1))

    def kv_blocks_held(self) -> int:
        """Physical KV blocks held on this rank (0 when every request's KV is freed)."""
        from conflux_cluster.actors.worker_factory import kv_blocks_held

        return kv_blocks_held(self.worker)


RankActor = ray.remote(RankActorImpl)
