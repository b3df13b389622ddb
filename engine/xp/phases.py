"""``no-cobatch`` (the paper's "without co-batching" ablation, LoongServe-style): a step that has
both prefill chunks and decodes runs as two iterations, the prefill one first.

    plan:    prefill [p0 | p1]  decode [d0 | d1]  transitions, finished
    first:   prefill [p0 | p1]  decode [ -  |  - ]  everything else: transitions, finished, prefix-cache
             hits/inserts/evictions, new requests, first tokens
    second:  prefill []         decode [d0 | d1]

Every executor (the process executor of the ``LLM`` API, the Ray rank actors of ``conflux serve``)
runs the same split, so the mode means the same thing offline and served.
"""

from __future__ import annotations

from dataclasses import replace

from ..contracts.step import StepInput, StepPlan
from .modes import XPMode


def iterations(step_input: StepInput, mode: XPMode | str) -> list[StepInput]:
    """The iterations the ranks run for one scheduler step under ``mode`` (one, except no-cobatch
    with both phases present: two)."""
    plan = step_input.plan
    if XPMode(mode).cobatches or not plan.prefill or not any(plan.decode):
        return [step_input]
    n = plan.num_ranks()
    first = StepInput(replace(plan, decode=[[] for _ in range(n)]), step_input.new_requests,
                      step_input.first_tokens)
    second = StepInput(StepPlan(plan.step, [], plan.decode, [], []))
    return [first, second]
