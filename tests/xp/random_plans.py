"""Seeded random step plans: long prompts chunked over several steps, slices poured unevenly and
at random onto ranks (some ranks get nothing), transitions to random decode ranks, decodes that
keep running while new prompts arrive, and finished requests."""

from __future__ import annotations

import random
from dataclasses import dataclass

from conflux_cluster.engine.contracts.step import DecodeTransition, PrefillSlice, StepPlan


@dataclass
class PlanReq:
    rid: str
    prompt_len: int
    decode_steps: int  # tokens decoded after the first sampled one
    arrive_step: int
    computed: int = 0
    decoded: int = 0
    decode_rank: int | None = None


def random_split(rng: random.Random, total: int, n: int) -> list[int]:
    """Uneven random split of ``total`` into ``n`` non-negative parts."""
    cuts = sorted(rng.randint(0, total) for _ in range(n - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def random_plans(seed: int, num_ranks: int, reqs: list[PlanReq], max_chunk: int = 24) -> list[StepPlan]:
    """All steps until every request finished; the last plan only frees the remaining ones."""
    rng = random.Random(seed)
    plans, step, done = [], 0, set()
    to_free: list[str] = []
    while len(done) < len(reqs) or to_free:
        plan = StepPlan(step=step, decode=[[] for _ in range(num_ranks)], finished=to_free)
        to_free = []
        for r in reqs:
            if r.decode_rank is not None and r.rid not in done:
                plan.decode[r.decode_rank].append(r.rid)
        waiting = [r for r in reqs if r.arrive_step <= step and r.computed < r.prompt_len]
        for r in waiting[:2]:  # at most two prompts per step
            chunk = min(r.prompt_len - r.computed, rng.randint(1, max_chunk))
            pos = r.computed
            for rank, cnt in enumerate(random_split(rng, chunk, num_ranks)):
                if cnt:
                    plan.prefill.append(PrefillSlice(r.rid, rank, pos, pos + cnt))
                    pos += cnt
            if pos == r.prompt_len:
                plan.transitions.append(DecodeTransition(r.rid, rng.randrange(num_ranks)))
        rng.shuffle(plan.prefill)  # slices of different requests interleave in any order
        plans.append(plan)
        # advance the simulated state
        for s in plan.prefill:
            req = next(r for r in reqs if r.rid == s.request_id)
            req.computed = max(req.computed, s.end)
        for rids in plan.decode:
            for rid in rids:
                req = next(r for r in reqs if r.rid == rid)
                req.decoded += 1
                if req.decoded >= req.decode_steps:
                    done.add(rid)
                    to_free.append(rid)
        for t in plan.transitions:
            req = next(r for r in reqs if r.rid == t.request_id)
            req.decode_rank = t.decode_rank
        step += 1
        if step > 500:
            raise RuntimeError("plan generator did not terminate")
    return plans
