"""The offline ``LLM`` API with its ranks as Ray actors (instead of in-process / local processes).

    import ray
    from conflux_cluster.actors.ray_llm import RayLLM
    ray.init()
    llm = RayLLM(ranks=2)                       # 2 rank actors in one STRICT_PACK placement group
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0))
    llm.shutdown()

Same engine core and scheduler as ``LLM``; only the executor differs (``RayExecutor``).
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from conflux_cluster.engine.config import EngineConfig, xp_topology
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.llm import LLM

from .ray_executor import RayExecutor


class RayLLM(LLM):
    """``LLM`` whose N ranks run as Ray actors on one node (needs a connected Ray)."""

    def __init__(self, model: str = "smollm2-135m-instruct", ranks: int = 2, device: str = "cpu",
                 cpus_per_rank: float = 1.0, control_plane: str = "auto", launch_ahead: bool | None = None,
                 **engine_kwargs: Any) -> None:
        if not ray.is_initialized():
            raise RuntimeError("RayLLM needs Ray: call ray.init() (or ray.init(address='auto')) first")
        self.config = xp_topology(EngineConfig(model=model, device=device, num_ranks=ranks, **engine_kwargs))
        source = resolve_model(self.config.model)
        bundle = self.config.device.rank_bundle(cpus_per_rank)
        self._pg = placement_group([dict(bundle) for _ in range(ranks)], strategy="STRICT_PACK")
        ray.get(self._pg.ready())
        executor = RayExecutor(self.config, self.config.blocks_per_rank(source.config), placement_group=self._pg,
                               bundle_offset=0, cpus_per_rank=cpus_per_rank, control_plane=control_plane,
                               launch_ahead=launch_ahead)
        self.engine = EngineCore(self.config, executor, source=source)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def shutdown(self) -> None:
        self.engine.executor.shutdown()
        remove_placement_group(self._pg)
