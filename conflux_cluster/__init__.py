"""ConfluxServe: SLO-aware LLM serving with Conflux Parallelism on Ray.

Public surface (re-exported here): ``LLM`` and ``SamplingParams`` for offline use. They are
imported lazily so that ``import conflux_cluster`` stays cheap (no torch) for tools that only
need the config or the router.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from conflux_cluster.engine.sampling_params import SamplingParams
    from conflux_cluster.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from conflux_cluster.llm import LLM

        return LLM
    if name == "SamplingParams":
        from conflux_cluster.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'conflux_cluster' has no attribute {name!r}")
