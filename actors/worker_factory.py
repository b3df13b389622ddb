"""Build the engine's per-rank worker inside a rank actor (no model math here: engine classes only).

    N = 1: ``engine.worker.RankWorker`` (the LocalExecutor's worker)
    N > 1: ``engine.xp.spec.build_runner`` (the MultiprocExecutor's worker: XP attention over a
           gloo/NCCL group the actor joined first through ``engine.xp.launch.join_group``)

Both take the engine core's ``StepInput`` and return a ``StepResult``.
"""

from __future__ import annotations

from typing import Any

from conflux_cluster.engine.config import EngineConfig


def xp_spec(config: EngineConfig, blocks_per_rank: int) -> Any:
    """The XP instance spec equivalent to an ``EngineConfig`` (same model, KV geometry, dtype)."""
    import torch

    from conflux_cluster.engine.xp.spec import XPInstanceSpec

    dtype = str(config.torch_dtype()).removeprefix("torch.")
    device = "cpu" if config.device == "cpu" else "cuda"
    del torch
    return XPInstanceSpec(model=config.model, num_ranks=config.num_ranks, dtype=dtype, device=device,
                          block_size=config.block_size, num_blocks=blocks_per_rank, seed=config.seed,
                          threads_per_worker=config.num_threads or 1)


def build_rank_worker(config: EngineConfig, rank: int, rendezvous: Any | None, blocks_per_rank: int) -> Any:
    """Join the group (N > 1) and build rank ``rank``'s worker."""
    if config.num_ranks == 1:
        from conflux_cluster.engine.worker import RankWorker

        return RankWorker(config, rank=0)
    from conflux_cluster.engine.xp.launch import join_group
    from conflux_cluster.engine.xp.spec import build_runner

    join_group(rendezvous, rank)
    return build_runner(xp_spec(config, blocks_per_rank), rank)


def kv_blocks_held(worker: Any) -> int:
    """Physical KV blocks the worker's pool has handed out (0 once every request is freed)."""
    kv = worker.kv if hasattr(worker, "kv") else worker.attn.kv  # RankWorker | XPRunner
    return int(kv.num_blocks - kv.num_free_blocks)
