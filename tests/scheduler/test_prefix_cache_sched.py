"""The scheduler's prefix cache with fake model outputs: LRU eviction order and refcounts of the
index; under random arrivals, aborts, preemptions and evictions (a small pool) every hit decodes
where its prefix lives, cached tokens are free prefill work, and every reference returns to zero."""

from __future__ import annotations

import random

import pytest

from conflux_cluster.engine.contracts.step import StepResult
from conflux_cluster.engine.kv.prefix_hash import block_hashes, chain_hashes, extend_hashes, shared_run
from conflux_cluster.engine.scheduler.prefix_index import PrefixIndex
from conflux_cluster.engine.scheduler.requests import SchedRequest
from conflux_cluster.engine.scheduler.scheduler import Scheduler

from .test_scheduler import drive, make


def test_chain_hash_depends_on_the_whole_prefix():
    a = block_hashes(list(range(40)), 16)
    b = block_hashes(list(range(16)) + [99] + list(range(17, 40)), 16)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]  # equal first block, different second
    assert chain_hashes([[1, 2]]) != chain_hashes([[2, 1]])


def test_index_refcounts_and_tail_first_lru():
    idx = PrefixIndex(num_ranks=2, block_size=16)
    assert idx.insert("a", 1, [10, 11, 12]) == 3
    assert idx.insert("b", 1, [10, 13]) == 0  # 10 is cached: the run stops there, b keeps its blocks
    idx.acquire("c", 1, [10, 11])
    assert idx.best([10, 11, 12, 14]) == (1, 3) and idx.match(0, [10]) == 0
    idx.release("a")
    assert idx.evictable(1) == 1  # 12 only: 10 and 11 are still referenced by c
    idx.release("c")
    idx.release("b")
    assert idx.evict(1, 2) == [12, 11]  # a's blocks entered tail first: its last ones go first
    assert idx.best([10, 11]) == (1, 1)
    idx.check_invariants()
    assert idx.evictions == 2 and idx.size(1) == 1


def test_memoized_match_equals_a_fresh_scan():
    """``match`` with a request's memo resumes where the last scan ended; inserts, releases, evictions
    and a hash list that grows at its end never make it differ from a scan from the first block."""
    rng = random.Random(3)
    idx = PrefixIndex(num_ranks=2, block_size=16)
    chains = [chain_hashes([[c, j] for j in range(30)]) for c in range(4)]
    memos: dict[int, dict] = {c: {} for c in range(4)}
    grown = {c: 10 for c in range(4)}
    for step in range(400):
        c, r = rng.randrange(4), rng.randrange(2)
        action = rng.random()
        if action < 0.3:
            start = idx.match(r, chains[c])
            idx.insert(f"q{step}", r, chains[c][start:start + rng.randrange(1, 6)])
            idx.release(f"q{step}")
        elif action < 0.45:
            idx.evict(r, rng.randrange(1, 4))
        elif action < 0.5:
            grown[c] = min(30, grown[c] + rng.randrange(0, 4))
        hashes = chains[c][:grown[c]]
        assert idx.match(r, hashes, memos[c]) == idx.match(r, hashes), (step, c, r)
    idx.check_invariants()


def _requests(seed: int, n: int, bs: int = 16, prompts: dict | None = None) -> list[SchedRequest]:
    """Conversation-like requests: a few shared system prompts, then per-request text (``prompts``:
    filled with each request's tokens)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(rng.choice([16, 48, 200]))] for _ in range(3)]
    out = []
    for i in range(n):
        prompt = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 120))]
        if prompts is not None:
            prompts[f"r{i}"] = prompt
        out.append(SchedRequest(f"r{i}", len(prompt), rng.randrange(1, 40), arrival=0.02 * i,
                                ttft_deadline=0.02 * i + 1.0, block_hashes=block_hashes(prompt, bs)))
    return out


def _finish_with_outputs(sched: Scheduler, prompts: dict[str, list[int]]) -> None:
    """Have ``sched.finish`` get what the engine passes: the hashes of prompt + outputs whose KV exists
    (``drive`` samples token 7 every time; a preempted request's outputs are in its longer prompt)."""
    finish = sched.finish

    def with_outputs(rid):
        req = sched.decoding.get(rid)
        if req is None:
            return finish(rid)
        prompt = prompts[rid]
        outputs = req.prompt_len - len(prompt) + req.generated
        return finish(rid, extend_hashes(req.block_hashes, prompt + [7] * (outputs - 1), 16))

    sched.finish = with_outputs


@pytest.mark.parametrize("policy,ranks,blocks,abort_p", [("slo", 2, 64, 0.0), ("fcfs", 3, 40, 0.05),
                                                        ("srpt", 1, 48, 0.02), ("slo", 4, 400, 0.0)])
def test_hits_pin_decode_rank_and_refs_return_to_zero(policy, ranks, blocks, abort_p):
    sched = make(policy, ranks, blocks, enable_prefix_caching=True, max_num_batched_tokens=64)
    prompts: dict[str, list[int]] = {}
    reqs = _requests(ranks * 7 + blocks, 60, prompts=prompts)
    _finish_with_outputs(sched, prompts)  # finished requests' output blocks join the cache too
    retained = []
    hit_rank: dict[str, int] = {}
    schedule = sched.schedule

    def checked(now):  # every hit in a plan names the rank its request later decodes on
        plan = schedule(now)
        for h in plan.prefix_hits:
            hit_rank[h.request_id] = h.rank
            assert h.num_tokens < sched.waiting[h.request_id].prompt_len
            assert sched.waiting[h.request_id].computed == h.num_tokens  # cached = already computed
        for t in plan.transitions:
            if t.start:
                assert t.decode_rank == hit_rank[t.request_id] and t.start % 16 == 0
        assert set(i.request_id for i in plan.retained) <= set(plan.finished)  # cached before they are freed
        retained.extend(plan.retained)
        return plan

    sched.schedule = checked
    drive(sched, reqs, seed=ranks, abort_p=abort_p)
    idx = sched.prefix
    assert idx.hits > 0 and len(hit_rank) > 0
    assert not idx.held and all(c == 0 for refs in idx.refs for c in refs.values())
    assert sum(sched.kv.used) == sum(idx.size(r) for r in range(ranks))  # only unreferenced cache left
    assert retained  # some finished requests left output blocks in the cache
    if blocks < 100:
        assert idx.evictions > 0


def test_cached_tokens_are_free_prefill_work():
    sched = make("slo", 2, 400, enable_prefix_caching=True)
    prompt = list(range(300))
    first = SchedRequest("a", 300, 1, 0.0, 1.0, block_hashes=block_hashes(prompt, 16))
    drive(sched, [first], seed=0)
    again = SchedRequest("b", 300, 1, 0.0, 1.0, block_hashes=block_hashes(prompt, 16))
    sched.add(again)
    assert again.remaining_prefill == 300 - 18 * 16  # full blocks, the last token recomputed
    assert sched.load().queued_prefill_tokens == again.remaining_prefill
    plan = sched.schedule(0.0)
    assert sum(s.num_tokens for s in plan.prefill) == 300 - 18 * 16
    assert plan.prefix_hits[0].num_tokens == 18 * 16


def _transitions(sched, reqs) -> dict[str, int]:
    """Add ``reqs`` and step with fake outputs until they all decoded; decode rank per request."""
    ranks: dict[str, int] = {}
    schedule = sched.schedule

    def recording(now):
        plan = schedule(now)
        ranks.update({t.request_id: t.decode_rank for t in plan.transitions})
        return plan

    sched.schedule = recording
    drive(sched, reqs, seed=0)
    sched.schedule = schedule
    return ranks


def test_short_shared_prefix_does_not_pile_decodes_on_one_rank():
    sched = make("fcfs", 2, 2000, enable_prefix_caching=True, max_num_batched_tokens=4096)
    system = list(range(64))  # cached on one rank after the first request
    first = SchedRequest("first", 100, 50, 0.0, 1.0, block_hashes=block_hashes(system + [7] * 36, 16))
    holder = _transitions(sched, [first])["first"]
    later = [SchedRequest(f"r{i}", 100, 50, 0.0, 1.0, block_hashes=block_hashes(system + [i] * 36, 16))
             for i in range(8)]
    ranks = _transitions(sched, later)
    assert set(ranks.values()) == {0, 1}, f"all decodes pinned to rank {holder}: {ranks}"
    assert sched.prefix.hits > 0  # the short prefix still served where the decode went
    # a long cached prefix is worth pinning: the follow-up decodes where it lives
    long = list(range(5000, 8200))
    turn1 = SchedRequest("turn1", 3210, 5, 0.0, 1.0, block_hashes=block_hashes(long + [1] * 10, 16))
    at = _transitions(sched, [turn1])["turn1"]
    turn2 = SchedRequest("turn2", 3300, 5, 0.0, 1.0, block_hashes=block_hashes(long + [2] * 100, 16))
    assert _transitions(sched, [turn2])["turn2"] == at


def test_shared_run_is_the_common_prefix_of_chained_hashes():
    a = block_hashes(list(range(160)), 16)
    for k in (0, 1, 5, 10):
        b = block_hashes(list(range(16 * k)) + [999] * (160 - 16 * k), 16)
        assert shared_run(a, b) == k == shared_run(b, a)
    assert shared_run(a, a[:4]) == 4 and shared_run([], a) == 0


def _turns(wait: bool) -> tuple[Scheduler, dict[str, dict]]:
    """A long first turn prefilling over many steps, the next turn (same prefix) arriving meanwhile;
    per request: the step its prefill started, its prefix hit and the prompt tokens it computed."""
    sched = make("slo", 2, 2000, enable_prefix_caching=True, max_num_batched_tokens=256,
                 prefix_wait_inflight=wait)
    doc = list(range(3200))
    first = SchedRequest("t1", 3210, 4, 0.0, 100.0, block_hashes=block_hashes(doc + [1] * 10, 16))
    second = SchedRequest("t2", 3300, 4, 0.05, 100.0, block_hashes=block_hashes(doc + [2] * 100, 16))
    seen: dict[str, dict] = {"t1": {"computed": 0}, "t2": {"computed": 0}}
    schedule = sched.schedule

    def recording(now):
        if "t2" in sched.waiting and "start" not in seen["t2"]:  # the work admission sees before it starts
            seen["t2"]["owed"] = sched.waiting["t2"].remaining_prefill
        plan = schedule(now)
        for s in plan.prefill:
            seen[s.request_id].setdefault("start", plan.step)
            seen[s.request_id]["computed"] += s.num_tokens
        for h in plan.prefix_hits:
            seen[h.request_id]["hit"] = h.num_tokens
        return plan

    sched.schedule = recording
    drive(sched, [first, second], seed=0)
    return sched, seen


def test_next_turn_waits_for_the_prefix_being_prefilled():
    sched, seen = _turns(wait=True)
    assert seen["t2"]["hit"] == 200 * 16  # the whole shared document, from the cache
    assert seen["t2"]["computed"] == 3300 - 200 * 16
    assert seen["t2"]["start"] > seen["t1"]["start"]
    assert seen["t2"]["owed"] == 3300 - 200 * 16  # re-probed once t1's blocks were cached
    assert not sched.prefix.held
    _, eager = _turns(wait=False)  # without waiting both compute the document
    assert "hit" not in eager["t2"] and eager["t2"]["computed"] == 3300


def test_no_wait_when_the_earlier_prefill_has_more_left_than_it_shares():
    # a short shared system prompt ahead of a long private prompt: waiting would cost more than it saves
    sched = make("fcfs", 2, 4000, enable_prefix_caching=True, max_num_batched_tokens=4096)
    system = list(range(64))
    long = SchedRequest("long", 10000, 4, 0.0, 100.0, block_hashes=block_hashes(system + [5] * 9936, 16))
    short = SchedRequest("short", 200, 4, 0.0, 100.0, block_hashes=block_hashes(system + [6] * 136, 16))
    sched.add(long)
    first = sched.schedule(0.0)  # long's prefill has started (64 of its 10,000 tokens are shared)
    sched.update(first, StepResult(first.step, {}))
    sched.add(short)
    plan = sched.schedule(0.1)
    assert {s.request_id for s in plan.prefill} == {"long", "short"}


def test_extend_hashes_equals_hashing_the_whole_sequence():
    rng = random.Random(3)
    for plen, olen in [(0, 40), (15, 1), (16, 0), (37, 50), (64, 16)]:
        prompt = [rng.randrange(1000) for _ in range(plen)]
        seq = prompt + [rng.randrange(1000) for _ in range(olen)]
        assert extend_hashes(block_hashes(prompt, 16), seq, 16) == block_hashes(seq, 16)
