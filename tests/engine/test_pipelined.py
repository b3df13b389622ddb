"""Pipelined steps (``async_scheduling``, engine/core.py): the engine plans and launches step k+1 before
it reads step k's tokens (``RankWorker.launch`` / ``finish``). Outputs must equal the one-step-at-a-time
engine token for token (greedy and seeded sampling, penalties, logprobs, EOS and stop strings,
max_tokens of 1, aborts, preemption, prefix caching), the rank really runs ahead with decode inputs
taken from the device, and every KV block comes back once the engine drains."""

from __future__ import annotations

import pytest

from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.sampling_params import SamplingParams

from .helpers import byte_engine, drain

PROMPTS = [list(range(1 + i, 30 + 7 * i)) for i in range(6)]  # 29..64 tokens
CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, max_tokens=40, ignore_eos=True, seed=7),
    # random weights, unseeded (each request draws its own seed from the engine): a stop token id or
    # string comes at a random step
    "stop_ids": SamplingParams(temperature=1.0, max_tokens=40, stop_token_ids=list(range(0, 512, 17))),
    "stop_strings": SamplingParams(temperature=1.0, max_tokens=40, stop=["A", "z", "~"]),
    "one_token": SamplingParams(temperature=0, max_tokens=1),
    # penalties read the history: the rank reads the earlier step's tokens before it launches the next
    "penalties": SamplingParams(temperature=0.8, seed=5, repetition_penalty=1.3, frequency_penalty=0.4,
                                presence_penalty=0.2, max_tokens=30, ignore_eos=True),
    "logprobs": SamplingParams(temperature=0.7, seed=9, logprobs=3, max_tokens=20, ignore_eos=True),
    "prompt_logprobs": SamplingParams(temperature=0, prompt_logprobs=2, max_tokens=8, ignore_eos=True),
    # min_tokens blocks the stop ids (some outside the 320-id vocabulary) for the first outputs
    "stop_ids_min_tokens_bias": SamplingParams(temperature=1.0, logit_bias={65: 2.0, 66: -100.0}, min_tokens=6,
                                               stop_token_ids=list(range(0, 512, 9)), max_tokens=40),
}


def _run(pipelined: bool, params: SamplingParams, num_kv_blocks: int = 4096, prefix: bool = False,
         prompts: list[list[int]] = PROMPTS) -> tuple[dict, dict, object]:
    core = byte_engine("tiny-llama", chunk=32, num_kv_blocks=num_kv_blocks, pipelined=pipelined,
                       enable_prefix_caching=prefix)
    assert core.pipelined == pipelined
    core.scheduler.config.decode_reserve_tokens = 0  # place decodes as soon as the prompt fits (preemption)
    for i, p in enumerate(prompts):
        core.add_request(GenerateRequest(f"r{i}", p, params))
    texts: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + (out.new_text or "")
    _assert_clean(core)
    return tokens, texts, core


def _assert_clean(core) -> None:
    worker = core.executor.worker
    worker.kv.check_invariants(live_requests=set())
    assert worker.kv.num_free_blocks + len(worker.kv.cache) == worker.kv.num_blocks
    assert not worker.requests and not core.requests and core.scheduler.kv.is_empty()


@pytest.mark.parametrize("case", sorted(CASES))
def test_pipelined_outputs_equal_one_step_at_a_time(case):
    params = CASES[case]
    ref_tokens, ref_texts, _ = _run(False, params)
    tokens, texts, core = _run(True, params)
    assert tokens == ref_tokens and texts == ref_texts
    lengths = [len(t) for t in tokens.values()]
    if case.startswith("stop"):  # some stop early, in different steps
        assert min(lengths) < params.max_tokens and len(set(lengths)) > 1
    else:
        assert set(lengths) == {params.max_tokens}


def test_pipelined_runs_the_next_step_before_the_last_one_is_processed():
    core = byte_engine("tiny-llama", chunk=32, pipelined=True)
    core.add_request(GenerateRequest("a", PROMPTS[0], CASES["greedy"]))
    assert core.step() == []  # step 0 went to the rank; nothing has come back yet
    assert core.has_unfinished()
    outs = core.step()  # step 1 submitted, then step 0's token (the first one) processed
    assert [o.request_id for o in outs] == ["a"] and core.last_plan.step == 0
    drain(core)
    _assert_clean(core)


def test_pipelined_decode_inputs_come_from_the_device():
    """The rank launches step k+1 while step k's tokens are unread: its decode rows take them from step
    k's sampled tensor; with a penalty (history on the host) it reads step k first."""
    for params, from_device in ((CASES["greedy"], True), (CASES["penalties"], False)):
        core = byte_engine("tiny-llama", chunk=32, pipelined=True)
        worker = core.executor.worker
        taken = []
        inner = worker._tokens_from_device

        def counting(ids, rows, inner=inner):
            taken.append(len(rows))
            return inner(ids, rows)

        worker._tokens_from_device = counting
        for i, p in enumerate(PROMPTS[:3]):
            core.add_request(GenerateRequest(f"r{i}", p, params))
        drain(core)
        assert (sum(taken) > 0) == from_device, (params, taken)
        _assert_clean(core)


def test_pipelined_preemption_equals_ample_pool():
    params = CASES["seeded"]
    ample, _, core_ample = _run(True, params)
    tight, _, core_tight = _run(True, params, num_kv_blocks=64)  # 256 tokens of KV; the requests reach ~500
    assert core_ample.scheduler.num_preemptions == 0 and core_tight.scheduler.num_preemptions > 0
    assert tight == ample


def test_pipelined_prefix_cache_equals_no_cache():
    shared = list(range(40, 104))  # 64 shared tokens = 16 blocks of 4
    prompts = [shared + [i + 1] * (3 + i) for i in range(4)] + [shared]
    ref, _, _ = _run(False, CASES["greedy"], prompts=prompts)
    got, _, core = _run(True, CASES["greedy"], prefix=True, prompts=prompts)
    assert got == ref
    assert core.scheduler.prefix is not None


def test_pipelined_abort_while_in_flight_frees_everything():
    core = byte_engine("tiny-llama", chunk=16, pipelined=True)
    for i, p in enumerate(PROMPTS):
        core.add_request(GenerateRequest(f"r{i}", p, CASES["greedy"]))
    seen: dict[str, int] = {}
    for n in range(12):
        for out in core.step():
            seen[out.request_id] = seen.get(out.request_id, 0) + len(out.new_token_ids)
        if n in (3, 7):  # some are prefilling, some decoding, one step is in flight
            for rid in sorted(core.requests)[:2]:
                core.abort(rid)
    survivors = set(core.requests)
    out = drain(core)
    assert set(out) <= survivors
    assert all(seen.get(r, 0) + len(out[r]) == CASES["greedy"].max_tokens for r in survivors)
    _assert_clean(core)


def test_pipelined_first_decode_runs_in_the_step_after_the_prompt():
    """One rank samples a request's first token and decodes it: the rank keeps its own sample, so the
    scheduler need not wait for that token to come back through the host before planning the decode."""
    core = byte_engine("tiny-llama", chunk=32, pipelined=True)
    plans = []
    submit = core.executor.submit

    def recording(step_input):
        plans.append(step_input.plan)
        return submit(step_input)

    core.executor.submit = recording
    for i, p in enumerate(PROMPTS[:3]):
        core.add_request(GenerateRequest(f"r{i}", p, CASES["greedy"]))
    got = drain(core)
    ref, _, _ = _run(False, CASES["greedy"], prompts=PROMPTS[:3])
    assert got == ref
    for k, plan in enumerate(plans[:-1]):
        for t in plan.transitions:
            assert t.request_id in plans[k + 1].decode[0], f"step {plan.step}: {t.request_id} sat out"
    assert sum(len(p.transitions) for p in plans) == 3
    _assert_clean(core)


def _arrivals_during_decodes(pipelined: bool, events: list | None = None) -> dict[str, list[int]]:
    """Two requests decode; a third arrives while they do (its prefill follows decode-only steps)."""
    core = byte_engine("tiny-llama", chunk=32, pipelined=pipelined)
    if events is not None:
        worker = core.executor.worker
        launch, finish = worker.launch, worker.finish

        def launching(step_input, launch=launch):
            events.append(("launch", step_input.plan.step, bool(step_input.plan.prefill)))
            return launch(step_input)

        def finishing(launched, finish=finish):
            if launched.result is None:
                events.append(("finish", launched.step))
            return finish(launched)

        worker.launch, worker.finish = launching, finishing
    for i, p in enumerate(PROMPTS[:2]):
        core.add_request(GenerateRequest(f"r{i}", p, CASES["greedy"]))
    tokens: dict[str, list[int]] = {}
    steps = 0
    while core.has_unfinished():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        if steps == 12:  # both prompts are done by now: the arrival's prefill comes after decode-only steps
            core.add_request(GenerateRequest("late", PROMPTS[3], CASES["greedy"]))
    _assert_clean(core)
    return tokens


def test_prefill_after_a_decode_step_is_launched_once_that_step_is_read():
    """Ranks that launch ahead read a decode-only step's tokens before they launch a step carrying prefill
    (its launch would hold those tokens back); decode-only steps, and steps after prefill, launch ahead."""
    events: list = []
    tokens = _arrivals_during_decodes(True, events)
    assert tokens == _arrivals_during_decodes(False)
    launches = [(step, pre) for kind, step, *rest in events if kind == "launch" for pre in rest]
    read: set[int] = set()
    read_before: dict[int, set[int]] = {}  # step -> the steps read before it was launched
    for e in events:
        if e[0] == "finish":
            read.add(e[1])
        else:
            read_before[e[1]] = set(read)
    after_decode = ahead_decodes = 0
    for (before, before_pre), (k, pre) in zip(launches, launches[1:]):
        if pre and not before_pre:
            after_decode += 1
            assert before in read_before[k], f"step {k} (prefill) launched over unread decode step {before}"
        elif not pre and not before_pre:
            ahead_decodes += before not in read_before[k]
    assert after_decode >= 1 and ahead_decodes > 10, (after_decode, ahead_decodes)
