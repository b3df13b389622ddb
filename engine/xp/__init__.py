"""Conflux Parallelism (XP): co-batched prefill and decode with phase-specific parallelism.

``heads`` (who holds which heads), ``kv`` (one paged pool, two layouts), ``meta`` (per-step
metadata from the StepPlan), ``attention`` (the attention seam across ranks), ``comm`` and
``launch`` (process groups), ``tp`` (base-TP logical ranks), ``spec`` (what a worker is built from;
``engine/runtime`` builds it and runs the instance's executors).
"""

from .modes import XPMode

__all__ = ["XPMode"]
