"""Trace replay with real prefixes: the same hash id gives the same block of prompt tokens."""

from __future__ import annotations

import random

from conflux_cluster.bench.workload import LengthPolicy, load_trace, trace_prompt_ids
from conflux_cluster.data import TRACES_DIR


def test_same_hash_id_same_tokens_and_lengths_kept():
    reqs = load_trace(TRACES_DIR / "mooncake_conversation_trace.jsonl", 40, lengths=LengthPolicy(length_scale=0.05))
    assert all(r.hash_ids and r.block_tokens == 26 for r in reqs)
    rng = random.Random(0)
    prompts = [trace_prompt_ids(r, 30000, rng) for r in reqs]
    assert [len(p) for p in prompts] == [r.input_len for r in reqs]
    a, b = reqs[0], reqs[1]  # both start with hash id 0, then differ
    assert a.hash_ids[0] == b.hash_ids[0] and a.hash_ids[1] != b.hash_ids[1]
    assert prompts[0][:26] == prompts[1][:26] and prompts[0][26:52] != prompts[1][26:52]
    # requests sharing k leading ids share exactly k blocks of tokens
    for x, px in zip(reqs, prompts):
        for y, py in zip(reqs, prompts):
            k = 0
            while k < min(len(x.hash_ids), len(y.hash_ids)) and x.hash_ids[k] == y.hash_ids[k]:
                k += 1
            n = min(k * 26, len(px), len(py))
            assert px[:n] == py[:n]
