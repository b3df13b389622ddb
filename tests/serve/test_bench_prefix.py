"""Trace replay with real prefixes: the same hash id gives the same block of prompt tokens."""

from __future__ import annotations

import random
import re

import pytest

from conflux_cluster.bench.workload import BenchRequest, LengthPolicy, load_trace, request_prompts, trace_prompt_ids
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
    # another salt (another rate point on the same server): the same sharing, no block in common
    salted = [trace_prompt_ids(r, 30000, random.Random(0), salt=1) for r in reqs]
    assert salted[0][:26] == salted[1][:26] and salted[0][:26] != prompts[0][:26]
    assert [len(p) for p in salted] == [r.input_len for r in reqs]


def test_a_salt_gives_synthetic_prompts_no_shared_prefix():
    """Repeats of the same synthetic arrivals and lengths (no ``hash_ids``) on one server: each salt sends
    other prompts, or the prefix cache serves every repeat after the first and the repeats measure it."""
    reqs = [BenchRequest(0.1 * i, 64 + i, 8) for i in range(6)]
    base = request_prompts(reqs, 30000, random.Random(7))
    assert base == request_prompts(reqs, 30000, random.Random(7))  # salt 0: as before, seed-determined
    runs = [request_prompts(reqs, 30000, random.Random(7), salt=k) for k in (1, 2)]
    assert runs[0] == request_prompts(reqs, 30000, random.Random(7), salt=1)  # reproducible
    for a, b in ((base, runs[0]), (base, runs[1]), (runs[0], runs[1])):
        assert [len(p) for p in a] == [len(p) for p in b] == [r.input_len for r in reqs]
        assert all(x[:16] != y[:16] for x, y in zip(a, b))


def test_bench_samples_whole_sessions_and_keeps_the_reuse():
    from conflux_cluster.bench.workload import BenchRequest
    from conflux_cluster.cli import build_parser
    from conflux_cluster.commands.bench import build_workload

    def repeated(reqs: list[BenchRequest]) -> float:  # share of prompt blocks seen before
        seen: set[int] = set()
        rep = tot = 0
        for r in reqs:
            for h in r.hash_ids:
                rep, tot = rep + (h in seen), tot + 1
                seen.add(h)
        return rep / tot

    common = ["bench", "--trace", "mooncake-conversation", "--num-prompts", "60", "--request-rate", "2"]
    sliced, _ = build_workload(build_parser().parse_args(common), None)
    sampled, _ = build_workload(build_parser().parse_args(common + ["--trace-sample", "sessions", "--seed", "1"]), None)
    assert len(sliced) == len(sampled) == 60 and sampled[0].arrival_s == 0.0
    assert repeated(sampled) > 4 * repeated(sliced) and repeated(sampled) > 0.25
    assert abs(len(sampled) / sampled[-1].arrival_s - 2) < 0.1  # rescaled to the asked mean rate
    again, _ = build_workload(build_parser().parse_args(common + ["--trace-sample", "sessions", "--seed", "1"]), None)
    assert [r.hash_ids for r in again] == [r.hash_ids for r in sampled]
    from conflux_cluster.commands.bench import check_args
    with pytest.raises(ValueError, match="--trace-sample sessions samples a trace: pass --trace"):
        check_args(build_parser().parse_args(["bench", "--trace-sample", "sessions"]))


def test_report_counts_cached_prompt_tokens_from_usage():
    from conflux_cluster.bench.client import RequestResult
    from conflux_cluster.bench.report import summarize

    r = RequestResult(input_len=100, output_len=1)
    r.absorb({"choices": [{"index": 0, "text": "a", "token_ids": [5], "finish_reason": "length"}]}, 0.1)
    r.absorb({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101,
                                       "prompt_tokens_details": {"cached_tokens": 96}}}, 0.11)
    r.close(0.12)
    rep = summarize([r], 1.0, 1.0, 0.1)
    assert rep.total_cached_tokens == 96
    assert re.search(r"Prefix cache hit rate, prompt tokens \(%\): +96\.0", rep.format())
