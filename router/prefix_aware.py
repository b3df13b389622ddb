"""Prefix-aware routing: send a request where its prompt prefix is likely cached, unless the
backlog there costs more than the prefill the cache would save.

The router remembers, per instance, the prefix blocks it routed there (an LRU of chained block
hashes of ``block_tokens`` tokens each, ``capacity_tokens`` per instance: an approximation of
what the instance's prefix cache holds, built from the router's own history; no instance report
needed). For a request with ``m_i`` prompt tokens likely cached on instance i::

    cost_i = load_weight * w_i  -  prefix_weight * m_i / prefill_capacity_i      (seconds)

``w_i`` is the normalized queued workload of ``lowest_load``; the second term is the prefill time
the cached prefix saves there. The lowest cost wins (ties as ``lowest_load``); with no prefix
anywhere this is ``lowest_load``. An instance whose backlog exceeds the saving loses the request.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from conflux_cluster.engine.contracts.cluster import InstanceLoad
from conflux_cluster.engine.kv.prefix_hash import leading_run

from .policies import LowestLoadPolicy, RouteRequest, normalized_queued_workload


@dataclass(frozen=True)
class PrefixRouting:
    """Weights and memory of the prefix-aware policy."""

    # weight of the prefill seconds a cached prefix saves; > 1 because keeping a conversation on one
    # instance also keeps its later turns' prefixes there (10: best of 1/3/10/30 in the simulated
    # 16-instance Mooncake-conversation run, docs/prefix-caching.md)
    prefix_weight: float = 10.0
    load_weight: float = 1.0  # weight of the normalized queued workload (seconds of backlog)
    block_tokens: int = 64  # tokens per hashed prefix block (requests carry hashes of this size)
    capacity_tokens: int = 1 << 21  # prefix tokens remembered per instance (≈ its KV cache)

    def __post_init__(self) -> None:
        if self.prefix_weight < 0 or self.load_weight < 0 or self.block_tokens < 1 or self.capacity_tokens < 0:
            raise ValueError(f"invalid PrefixRouting {self}")


class PrefixHistory:
    """Per instance: the prefix block hashes routed there, least recently used first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._lru: dict[int, OrderedDict[int, None]] = {}

    def match(self, instance: int, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` routed to ``instance`` and still remembered."""
        return leading_run(hashes, self._lru.get(instance, ()))

    def record(self, instance: int, hashes: Sequence[int]) -> None:
        lru = self._lru.setdefault(instance, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)


class PrefixAwarePolicy(LowestLoadPolicy):
    """``lowest_load`` over ``cost_i`` (module docstring), with its tie-breaks."""

    def __init__(self, config: PrefixRouting = PrefixRouting()) -> None:
        super().__init__()
        self.config = config
        self.history = PrefixHistory(config.capacity_tokens // config.block_tokens)

    def choose(self, loads: Sequence[InstanceLoad], request: RouteRequest | None = None) -> int:
        hashes = request.prefix_hashes if request is not None else ()
        c, bt = self.config, self.config.block_tokens

        def cost(i: int) -> float:
            load = loads[i]
            saved = self.history.match(i, hashes) * bt / load.prefill_capacity if hashes else 0.0
            return c.load_weight * normalized_queued_workload(load) - c.prefix_weight * saved

        best = self.lowest(loads, cost)
        if hashes:
            self.history.record(best, hashes)
        return best
