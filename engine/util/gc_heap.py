"""Keeping Python's full garbage collections off the serving path.

A serving process holds hundreds of thousands of long-lived objects after start-up (torch, Ray,
the model's modules, the tokenizer, KV block tables). A collection of the oldest generation walks
all of them while holding the GIL: 189 ms for the 354K objects of an offline SmolLM2 engine on the
2-core CPU machine (docs/results/LOG.md), a stall of every thread of that process. CPython starts one once enough objects
survived younger collections, so under load it lands in the middle of a step now and then (vLLM
measured its P99 inter-token latency fall from 204 ms when it froze its heaps, vllm PR 14902).

``freeze_heap`` collects once and moves every object alive now to the permanent generation, which
later collections skip (``gc.freeze``): what serving allocates afterwards is still collected. Called
after warm-up in each rank actor and XP instance replica, and in the ingress and router replicas at
start (``ServeConfig.freeze_gc``). The cost: a reference cycle among start-up objects that becomes
garbage later is never reclaimed (reference counting still frees everything else).
"""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect, then freeze what is alive; returns how many objects are frozen in this process."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
