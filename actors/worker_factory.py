"""Build the engine's per-rank worker inside a rank actor (no model math here: engine classes only).

    N = 1: ``engine.runtime.build.local_worker`` (the LocalExecutor's worker: XP backend of one rank on
           CUDA, the torch paged backend elsewhere)
    N > 1: ``engine.runtime.build.build_rank_worker`` (the MultiprocExecutor's worker: a RankWorker with
           XP attention over a gloo/NCCL group the actor joined first via ``engine.xp.launch.join_group``)

Both take the engine core's ``StepInput`` and return a ``StepResult``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.contracts.step import Rendezvous

if TYPE_CHECKING:  # torch
    from conflux_cluster.engine.runtime.worker import RankWorker


def build_rank_worker(config: EngineConfig, rank: int, rendezvous: Rendezvous | None,
                      blocks_per_rank: int | None = None) -> RankWorker:
    """Join the group (N > 1) and build rank ``rank``'s worker (the MultiprocExecutor's recipe).
    ``blocks_per_rank`` None: the worker sizes its KV pool itself (``EngineConfig.blocks_per_rank``)."""
    if blocks_per_rank is not None:
        config = config.model_copy(update={"num_kv_blocks": blocks_per_rank})
    from conflux_cluster.engine.loader import resolve_model
    from conflux_cluster.engine.runtime.build import build_rank_worker as build, local_worker
    from conflux_cluster.engine.config import xp_topology
    from conflux_cluster.engine.xp.spec import XPInstanceSpec

    if config.num_ranks == 1 and config.tp_size == 1:
        return local_worker(config, resolve_model(config.model))
    from conflux_cluster.engine.xp.launch import join_group

    assert rendezvous is not None, "N > 1 ranks join a process group: rank 0's rendezvous is needed"
    join_group(rendezvous, rank)
    cfg = xp_topology(config)
    return build(XPInstanceSpec(cfg, resolve_model(cfg.model)), rank)


def kv_blocks_held(worker: RankWorker) -> int:
    """Physical KV blocks the worker's pool has handed out to requests (0 once every request is
    freed; blocks the prefix cache keeps are not counted)."""
    xp = worker.attention.manages_kv  # XP: the pool behind the attention backend (head-sharded prefill)
    kv = worker.attention.kv if xp else worker.kv
    held = int(kv.num_blocks - kv.num_free_blocks - len(kv.cache))
    if xp:  # a table without blocks still counts as not freed
        held = max(held, int(bool(kv.prefill or kv.decode)))
    return held
