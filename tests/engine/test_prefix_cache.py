"""Prefix caching end to end: greedy tokens with the cache on equal the cache off, on one rank and
on XP instances of 2 and 3 ranks (real gloo worker processes; 9 q / 3 kv heads, so head shards
are uneven), for shared prefixes of 0, 1 and many blocks, chunked suffixes, concurrent sharers
and eviction under pool pressure; afterwards no request holds a block or a reference."""

from __future__ import annotations

import random

import pytest

from conflux_cluster.engine.config import EngineConfig, xp_topology
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.loader import ModelSource
from conflux_cluster.engine.models.config import ModelConfig
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.tokenizer import ByteTokenizer
from conflux_cluster.engine.runtime.multiproc import MultiprocExecutor
from conflux_cluster.engine.contracts.step import PrefixHit
from conflux_cluster.engine.xp.prefix_load import MOVE_BYTES_ENV, layer_groups
from conflux_cluster.engine.runtime.build import build_rank_worker
from conflux_cluster.engine.xp.spec import XPInstanceSpec

from .helpers import drain

TINY = ModelConfig(architecture="llama", vocab_size=300, hidden_size=72, intermediate_size=96,
                   num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=8,
                   rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)
SOURCE = ModelSource("tiny-9-3", "preset", None, TINY)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BS = 4  # tokens per block


def _waves() -> list[list[list[int]]]:
    """Three waves of prompts; later waves share prefixes of 0, 1 and many blocks with earlier ones."""
    rng = random.Random(5)
    tok = lambda n: [rng.randrange(1, 250) for _ in range(n)]  # noqa: E731
    long_prefix, one_block = tok(41), tok(BS)
    first = [long_prefix + tok(7), one_block + tok(9), tok(13)]
    second = [long_prefix + tok(3),  # many blocks cached, short suffix (single chunk)
              long_prefix[:24] + tok(30),  # part of the long prefix, long suffix (several chunks)
              one_block + tok(2),  # one block
              tok(11),  # nothing shared
              long_prefix + tok(3)]  # same prompt as another in this wave (concurrent sharers)
    third = [long_prefix[:BS * 10 + 1], one_block + [7], long_prefix + tok(20)]  # hit = prompt - 1 token
    return [first, second, third]


def _config(ranks: int, caching: bool, blocks: int, tp: int = 1, mode: str = "xp") -> EngineConfig:
    return EngineConfig(model="tiny-9-3", dtype="float32", block_size=BS, num_kv_blocks=blocks, seed=3,
                        num_threads=1, load_progress=False, num_ranks=ranks, tp_size=tp, xp_mode=mode,
                        scheduler=SchedulerConfig(max_num_batched_tokens=16, enable_prefix_caching=caching,
                                                  decode_reserve_tokens=0, prefix_pin_tokens=0))


def _run(ranks: int, caching: bool, blocks: int = 160, tp: int = 1, mode: str = "xp",
         xp_one_rank: bool = False) -> tuple[list[dict[str, list[int]]], EngineCore]:
    """``xp_one_rank``: one rank with the XP backend (what a one-GPU instance runs; its transitions
    hand the prefill blocks over) instead of the torch paged backend."""
    cfg = _config(ranks, caching, blocks, tp, mode)
    if ranks * tp == 1:
        worker = build_rank_worker(XPInstanceSpec(xp_topology(cfg), SOURCE), 0) if xp_one_rank else None
        executor = LocalExecutor(cfg, SOURCE, worker=worker)
    else:
        executor = MultiprocExecutor(cfg, SOURCE)
    core = EngineCore(cfg, executor, source=SOURCE, tokenizer=ByteTokenizer())
    outs = []
    try:
        for w, prompts in enumerate(_waves()):
            for i, p in enumerate(prompts):
                core.add_request(GenerateRequest(f"w{w}r{i}", p, GREEDY))
            outs.append(drain(core))
            core.scheduler.check_invariants()
        _check_released(core)
    finally:
        executor.shutdown()
    return outs, core


def _check_released(core: EngineCore) -> None:
    """Every request is gone: no references, no private blocks; cached blocks mirror the ranks."""
    sched = core.scheduler
    assert sched.kv.is_empty(), f"scheduler still accounts KV: used={sched.kv.used}"
    if sched.prefix is not None:
        assert not sched.prefix.held and all(c == 0 for refs in sched.prefix.refs for c in refs.values())
    ex = core.executor
    if isinstance(ex, LocalExecutor):
        w = ex.worker
        kv = w.attention.kv if w.attention.manages_kv else w.kv  # the XP backend's pool, or the worker's
        kv.check_invariants(live_requests=set())
        cached = set(kv.cache.block_of)
        assert cached == (set(sched.prefix.refs[0]) if sched.prefix else set())
        assert kv.num_free_blocks + len(cached) == kv.num_blocks
    else:
        assert all(ex.kv_free()), "a rank still holds request KV"


@pytest.fixture(scope="module")
def reference() -> list[dict[str, list[int]]]:
    return _run(1, caching=False)[0]


@pytest.mark.parametrize("ranks,tp,xp_one_rank", [(1, 1, False), (1, 1, True), (2, 1, False), (3, 1, False),
                                                  (2, 2, False)], ids=["N1", "N1-xp", "N2", "N3", "N2xTP2"])
def test_cache_on_equals_cache_off(ranks, tp, xp_one_rank, reference):
    got, core = _run(ranks, caching=True, tp=tp, xp_one_rank=xp_one_rank)
    assert got == reference
    prefix = core.scheduler.prefix
    # wave 2: 40 + 20 + 4 + 0 + 40 cached tokens at least; wave 3: 40 + 4 + 40
    assert prefix.hits >= 2 * 40 + 20 + 4 + 40 + 4 + 40, f"hits {prefix.hits} of {prefix.queries} queried"
    assert prefix.queries == sum(len(p) for wave in _waves() for p in wave)


def test_prefix_moves_in_layer_groups_keep_tokens(monkeypatch, reference):
    """N = 2 with the prefix scatter split into one all-to-all per layer (a tiny byte cap, seen by
    the worker processes through the environment): the same tokens."""
    monkeypatch.setenv(MOVE_BYTES_ENV, "1")
    got, core = _run(2, caching=True)
    assert got == reference and core.scheduler.prefix.hits > 0


def test_layer_groups_cover_every_layer_once_under_the_cap():
    hits = [PrefixHit("a", 0, (1, 2), 4), PrefixHit("b", 1, (3,), 4)]  # 12 tokens
    assert layer_groups(hits, 32, 10, cap=2 * 12 * 10 * 5) == [(i, min(32, i + 5)) for i in range(0, 32, 5)]
    assert layer_groups(hits, 32, 10, cap=1) == [(i, i + 1) for i in range(32)]  # at least one layer
    assert layer_groups(hits, 32, 10, cap=1 << 30) == [(0, 32)]


@pytest.mark.parametrize("xp_one_rank", [False, True], ids=["torch", "xp"])
def test_eviction_under_pressure_keeps_tokens(xp_one_rank, reference):
    got, core = _run(1, caching=True, blocks=40, xp_one_rank=xp_one_rank)  # 160 tokens: the cache must give blocks back
    assert got == reference
    assert core.scheduler.prefix.evictions > 0 and core.scheduler.prefix.hits > 0


@pytest.mark.parametrize("mode", ["xp", "no-cobatch"])
def test_eviction_under_pressure_xp(mode, reference):
    got, core = _run(2, caching=True, blocks=44, mode=mode)
    assert got == reference
    assert core.scheduler.prefix.evictions > 0 and core.scheduler.prefix.hits > 0


def test_uniform_sp_rejects_prefix_caching():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(model="tiny-llama", num_ranks=2, xp_mode="uniform-sp",
                     scheduler=SchedulerConfig(enable_prefix_caching=True))


def _chat(ranks: int, caching: bool, xp_one_rank: bool = False) -> tuple[list[list[int]], list[int]]:
    """Three turns of one conversation, each prompt the previous prompt + its answer + a new message
    (what a chat client sends): each turn's output tokens and the prompt tokens served from the cache."""
    cfg = _config(ranks, caching, 160)
    worker = build_rank_worker(XPInstanceSpec(xp_topology(cfg), SOURCE), 0) if xp_one_rank else None
    executor = LocalExecutor(cfg, SOURCE, worker=worker) if ranks == 1 else MultiprocExecutor(cfg, SOURCE)
    core = EngineCore(cfg, executor, source=SOURCE, tokenizer=ByteTokenizer())
    rng = random.Random(11)
    prompt, outs, cached = [rng.randrange(1, 250) for _ in range(30)], [], []
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    try:
        for turn in range(3):
            core.add_request(GenerateRequest(f"t{turn}", prompt, params))
            tokens, hit = [], 0
            while core.has_unfinished():
                for o in core.step():
                    tokens += o.new_token_ids
                    hit = max(hit, o.num_cached_tokens)
            core.scheduler.check_invariants()
            outs.append(tokens)
            cached.append(hit)
            prompt = prompt + tokens + [rng.randrange(1, 250) for _ in range(5)]
        _check_released(core)
    finally:
        executor.shutdown()
    return outs, cached


@pytest.mark.parametrize("ranks,xp_one_rank", [(1, False), (1, True), (2, False)], ids=["N1", "N1-xp", "N2"])
def test_next_turn_reuses_the_previous_answer(ranks, xp_one_rank):
    """A finished request's output blocks stay cached (as vLLM's do): the next turn's hit covers the
    previous prompt AND its answer (all but the last output token, whose KV was never written)."""
    reference, _ = _chat(1, caching=False)
    got, cached = _chat(ranks, caching=True, xp_one_rank=xp_one_rank)
    assert got == reference
    lengths = [30, 30 + 9 + 5, 30 + 2 * (9 + 5)]
    # turn t's hit: the full blocks of turn t-1's prompt + its first 8 outputs
    assert cached == [0] + [(n + 8) // BS * BS for n in lengths[:2]], cached
