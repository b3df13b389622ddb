"""Drive an XP executor through seeded random plans and collect every request's tokens."""

from __future__ import annotations

import random

from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.contracts.step import NewRequest, StepInput

from .random_plans import PlanReq, random_plans


def scenario(seed: int, vocab: int, num_reqs: int = 4, max_prompt: int = 40,
             max_new: int = 5) -> list[tuple[str, list[int], int, int]]:
    """(rid, prompt ids, new tokens, arrival step) - long prompts arrive while others decode."""
    rng = random.Random(seed)
    out = []
    for i in range(num_reqs):
        n = rng.randint(max_prompt // 3, max_prompt)
        out.append((f"q{i}", [rng.randrange(3, vocab) for _ in range(n)], rng.randint(2, max_new), 3 * i))
    return out


def run_scenario(executor, num_ranks: int, seed: int, reqs, max_chunk: int = 12) -> dict[str, list[int]]:
    plan_reqs = [PlanReq(rid, len(p), new - 1, arrive) for rid, p, new, arrive in reqs]
    plans = random_plans(seed, num_ranks, plan_reqs, max_chunk=max_chunk)
    prompts = {rid: p for rid, p, _, _ in reqs}
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    seen: set[str] = set()
    first: dict[str, int] = {}
    for plan in plans:
        new = []
        for s in plan.prefill:
            if s.request_id not in seen:
                seen.add(s.request_id)
                new.append(NewRequest(s.request_id, prompts[s.request_id],
                                     SamplingParams(temperature=0.0, max_tokens=64), seed=0))
        result = executor.execute(StepInput(plan, new, first))
        first = {t.request_id: result.sampled[t.request_id] for t in plan.transitions}
        for rid, tok in result.sampled.items():
            outputs[rid].append(tok)
    for rid, p, new, _ in reqs:
        assert len(outputs[rid]) == new, f"{rid}: {len(outputs[rid])} tokens, expected {new}"
    return outputs
