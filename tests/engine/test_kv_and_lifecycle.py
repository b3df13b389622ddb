"""Paged KV invariants (after finish, after abort, under a tiny pool), stop ids / EOS / max_tokens,
and request validation, on a random-weight tiny preset (fast, real model code)."""

from __future__ import annotations

import numpy as np
import pytest

from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.kv.cache import KVCache, KVCacheFull
from conflux_cluster.engine.kv.layout import KVLayout
from conflux_cluster.engine.models.config import PRESETS
from conflux_cluster.engine.sampling_params import SamplingParams

from .helpers import byte_engine, drain

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _assert_clean(core) -> None:
    worker = core.executor.worker
    worker.kv.check_invariants(live_requests=set())
    assert worker.kv.num_free_blocks == worker.kv.num_blocks
    assert not worker.requests and not core.requests
    assert core.scheduler.kv.is_empty()


def test_kv_freed_after_all_finish():
    core = byte_engine("tiny-llama", chunk=16)
    for i, n in enumerate([3, 40, 17, 64]):
        core.add_request(GenerateRequest(f"r{i}", list(range(1, n + 1)), GREEDY))
    out = drain(core)
    assert {r: len(t) for r, t in out.items()} == {f"r{i}": 12 for i in range(4)}
    _assert_clean(core)


def test_kv_freed_after_abort_in_every_phase():
    core = byte_engine("tiny-qwen3", chunk=8)
    core.add_request(GenerateRequest("decoding", list(range(5)),
                                     SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)))
    core.add_request(GenerateRequest("prefilling", list(range(100)), GREEDY))
    for _ in range(3):
        core.step()
    core.add_request(GenerateRequest("queued", list(range(30)), GREEDY))
    worker = core.executor.worker
    assert worker.kv.tables["decoding"] and worker.kv.tables["prefilling"]
    assert core.scheduler.decoding and "prefilling" in core.scheduler.waiting
    for rid in ("decoding", "prefilling", "queued"):
        core.abort(rid)
    worker.kv.check_invariants()
    assert not core.step()  # the freeing step produces no output
    _assert_clean(core)
    assert not core.has_unfinished()


def test_small_pool_waits_instead_of_crashing():
    # 24 blocks of 4 tokens = 96 tokens; 6 requests need 6 * (20 + 12) = 192 tokens in total.
    core = byte_engine("tiny-llama", chunk=16, num_kv_blocks=24)
    for i in range(6):
        core.add_request(GenerateRequest(f"r{i}", list(range(i, i + 20)), GREEDY))
    out = drain(core)
    assert all(len(out[f"r{i}"]) == 12 for i in range(6))
    _assert_clean(core)


def test_request_too_long_for_pool_is_a_clear_error():
    core = byte_engine("tiny-llama", num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV"):
        core.add_request(GenerateRequest("big", list(range(30)), GREEDY))


def test_stop_token_ids_eos_and_max_tokens():
    core = byte_engine("tiny-llama", chunk=64)
    prompt = list(range(10, 30))
    core.add_request(GenerateRequest("free", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    first = drain(core)["free"]
    core.add_request(GenerateRequest("stopid", prompt,
                                     SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first[2]])))
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert [t for o in outs for t in o.new_token_ids] == first[:first.index(first[2]) + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == first[2]
    core.eos_token_ids = {first[1]}  # make the model's own choice an EOS
    core.add_request(GenerateRequest("eos", prompt, SamplingParams(temperature=0, max_tokens=8)))
    assert drain(core)["eos"] == first[:2]
    core.add_request(GenerateRequest("len", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 3
    _assert_clean(core)


def test_bad_requests_are_rejected_with_clear_messages():
    core = byte_engine("tiny-llama")
    with pytest.raises(ValueError, match="empty"):
        core.add_request(GenerateRequest("a", [], GREEDY))
    with pytest.raises(ValueError, match="vocabulary"):
        core.add_request(GenerateRequest("b", [1, 999], GREEDY))
    with pytest.raises(ValueError, match="context"):
        core.add_request(GenerateRequest("c", [1] * 10, SamplingParams(max_tokens=5000)))
    for ids in ([1.0, 2], [True, 2], ["1", 2]):
        with pytest.raises(TypeError, match="token ids must be integers"):
            core.add_request(GenerateRequest("f", ids, GREEDY))
    for name in ("logprobs", "prompt_logprobs"):  # more alternatives than the vocabulary has
        with pytest.raises(ValueError, match=f"{name} 100000 is more than the vocabulary"):
            core.add_request(GenerateRequest("g", [1, 2], SamplingParams(max_tokens=2, **{name: 100_000})))
    core.add_request(GenerateRequest("d", [1, 2], GREEDY))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(GenerateRequest("d", [1, 2], GREEDY))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="bogus"):
        SamplingParams(bogus=1)


def _cache(num_blocks: int = 8) -> KVCache:
    cfg = PRESETS["tiny-qwen3"]
    return KVCache(cfg, KVLayout.build(4, cfg.num_attention_heads, cfg.num_key_value_heads, 1), 0, num_blocks,
                   dtype=__import__("torch").float32, device="cpu")


def test_kv_cache_allocation_and_invariant_checker():
    kv = _cache()
    assert kv.ensure("a", 9) == [0, 1, 2]  # 9 tokens / 4 per block
    assert kv.ensure("a", 12) == [0, 1, 2]
    kv.ensure("b", 4)
    assert kv.slots("a", 3, 6).tolist() == [3, 4, 5]
    kv.check_invariants({"a", "b"})
    with pytest.raises(AssertionError, match="still own"):
        kv.check_invariants({"a"})
    with pytest.raises(KVCacheFull):
        kv.ensure("c", 100)
    kv.tables["b"].append(1)  # corrupt: block 1 owned twice
    with pytest.raises(AssertionError, match="owned by both"):
        kv.check_invariants()
    kv.tables["b"].pop()
    kv._free.pop()  # corrupt: a block vanishes
    with pytest.raises(AssertionError, match="leaked"):
        kv.check_invariants()


def test_prefill_view_aliases_decode_view():
    kv = _cache()
    k_dec, _ = kv.decode_view(1)
    k_pre, _ = kv.prefill_view(1)
    k_pre[2, 1, 0, 5] = 7.0  # N=1: the head-sharded view is the same memory, same layout
    assert k_dec[2 * kv.block_size + 1, 0, 5] == 7.0


def test_load_report_tracks_queue_and_kv():
    core = byte_engine("tiny-llama", chunk=8)
    assert core.load().queued_prefill_tokens == 0
    core.add_request(GenerateRequest("a", list(range(40)), GREEDY))
    assert core.load().queued_prefill_tokens == 40 and core.load().num_waiting == 1
    core.step()
    mid = core.load()
    assert mid.queued_prefill_tokens == 32 and mid.kv_utilization > 0
    drain(core)
    assert core.load().kv_utilization == 0 and core.load().num_decoding == 0


def test_llm_bad_batch_adds_nothing_and_later_calls_work(monkeypatch):
    """A batch with one bad prompt is refused whole (nothing added, no KV held); if adding still fails
    midway (e.g. the scheduler refuses one at arrival), the requests already added are aborted."""
    from conflux_cluster import LLM

    llm = LLM(model="tiny-llama", load_progress=False, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
    bad_batches = [([[1, 2], []], ValueError, r"prompts\[1\].*empty"),
                   ([[1, 2], [1.5, 2]], TypeError, r"prompts\[1\].*integers.*float"),
                   ([[1, 2], [True, 2]], TypeError, r"prompts\[1\].*integers.*bool"),
                   ([[1, 2], 7], TypeError, r"prompts\[1\].*token ids.*int"),
                   ([1.0, 2.0], TypeError, r"prompts\[0\].*integers.*float"),
                   ([[1, 2], [1, 10**6]], ValueError, r"prompts\[1\].*vocabulary"),
                   (None, TypeError, r"prompts: expected")]
    for prompts, error, match in bad_batches:
        with pytest.raises(error, match=match):
            llm.generate(prompts, params)
        _assert_clean(llm.engine)
    with pytest.raises(TypeError, match=r"sampling_params\[1\]"):
        llm.generate([[1, 2], [3, 4]], [params, {"max_tokens": 4}])

    add = llm.engine.add_request
    calls = []

    def refuse_third(request):
        calls.append(request.request_id)
        if len(calls) == 3:
            raise ValueError("refused at arrival")
        add(request)

    monkeypatch.setattr(llm.engine, "add_request", refuse_third)
    with pytest.raises(ValueError, match="refused"):
        llm.generate([[1, 2], [3, 4], [5, 6]], params)
    monkeypatch.undo()
    _assert_clean(llm.engine)
    assert not llm.engine.has_unfinished()
    assert llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids == expected
    assert llm.generate(np.array([1, 2, 3]), params)[0].outputs[0].token_ids == expected  # numpy ids still fine
    _assert_clean(llm.engine)
