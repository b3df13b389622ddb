"""Sampling: seeded reproducibility regardless of batch composition, filters, logprobs."""

from __future__ import annotations

import torch

from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.sampling import SampleSpec, _filter, mix_seed, sample
from conflux_cluster.engine.sampling_params import SamplingParams

from .helpers import byte_engine, drain

SEEDED = SamplingParams(temperature=1.0, top_p=0.95, top_k=100, seed=1234, max_tokens=20, ignore_eos=True)


def _run(chunk: int, others: int, order_first: bool) -> list[int]:
    core = byte_engine("tiny-llama", chunk=chunk)
    prompt = list(range(30, 75))
    filler = [(f"o{i}", list(range(i, i + 10 + 7 * i)),
               SamplingParams(temperature=0.9, max_tokens=5 + i, ignore_eos=True)) for i in range(others)]
    reqs = [("x", prompt, SEEDED)] + filler if order_first else filler + [("x", prompt, SEEDED)]
    for rid, ids, p in reqs:
        core.add_request(GenerateRequest(rid, ids, p))
    return drain(core)["x"]


def test_seeded_sampling_reproducible_across_batch_mixes():
    alone = _run(chunk=64, others=0, order_first=True)
    assert len(set(alone)) > 3  # really sampled, not a constant
    assert _run(chunk=8, others=5, order_first=False) == alone
    assert _run(chunk=16, others=3, order_first=True) == alone


def test_different_seeds_differ_and_unseeded_requests_get_their_own_seed():
    core = byte_engine("tiny-llama", chunk=64)
    prompt = list(range(30, 60))
    for i, seed in enumerate([1, 2, None, None]):
        core.add_request(GenerateRequest(f"s{i}", prompt, SEEDED.model_copy(update={"seed": seed})))
    out = drain(core)
    assert len({tuple(v) for v in out.values()}) == 4


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    specs = [SampleSpec(SamplingParams(temperature=1.0, top_k=1), seed=i, output_index=0) for i in range(3)]
    assert sample(logits, specs).token_ids == logits.argmax(-1).tolist()
    specs = [SampleSpec(SamplingParams(temperature=2.0, top_p=1e-6), seed=i, output_index=0) for i in range(3)]
    assert sample(logits, specs).token_ids == logits.argmax(-1).tolist()


def test_tiny_temperature_is_greedy_and_a_huge_top_k_keeps_everything():
    """A temperature that underflows float32 samples greedily (not NaN rows); a top_k past int64,
    batched with a top_p row, means every token (it failed the whole step before)."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 3
    tiny = [SampleSpec(SamplingParams(temperature=t), seed=i, output_index=0) for i, t in enumerate((1e-40, 1e-6, 0.0))]
    assert sample(logits, tiny).token_ids == logits.argmax(-1).tolist()
    huge = SamplingParams(temperature=1.0, top_k=2**63, seed=5)
    mixed = [SampleSpec(huge, 5, 0), SampleSpec(SamplingParams(temperature=1.0, top_p=0.5, seed=6), 6, 0)]
    got = sample(logits[:2], mixed).token_ids
    plain = SamplingParams(temperature=1.0, seed=5)
    assert got[0] == sample(logits[:1], [SampleSpec(plain, 5, 0)]).token_ids[0]  # == no top-k at all


def test_filters_keep_the_right_sets():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    kept = lambda x: torch.isfinite(x).nonzero().flatten().tolist()  # noqa: E731
    assert kept(_filter(logits, top_k=2, top_p=1.0)) == [0, 1]
    assert kept(_filter(logits, top_k=-1, top_p=0.7)) == [0, 1]  # 0.5 + 0.2 reaches 0.7
    assert kept(_filter(logits, top_k=-1, top_p=0.71)) == [0, 1, 2]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(1, 1)
    counts = torch.zeros(3)
    for i in range(2000):
        counts[sample(logits, [SampleSpec(SamplingParams(temperature=1.0), 7, i)]).token_ids[0]] += 1
    assert torch.allclose(counts / 2000, probs, atol=0.04)
    assert len({mix_seed(7, i) for i in range(1000)}) == 1000


def test_logprobs_and_top_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    out = sample(logits, [SampleSpec(SamplingParams(temperature=0, logprobs=2), 0, 0)])
    lp = torch.log_softmax(logits[0], -1)
    assert out.token_ids == [0] and abs(out.logprobs[0] - lp[0].item()) < 1e-6
    assert [t for t, _ in out.top_logprobs[0]] == [0, 1]
    assert abs(out.top_logprobs[0][1][1] - lp[1].item()) < 1e-6


def test_llm_n_completions_are_distinct_and_reproducible():
    from conflux_cluster import LLM

    llm = LLM(model="tiny-llama", load_progress=False)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    first = llm.generate([[1, 2, 3, 4]], params)[0]
    again = llm.generate([[1, 2, 3, 4]], params)[0]
    ids = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2] and len({tuple(i) for i in ids}) == 3
    assert ids == [c.token_ids for c in again.outputs]


def test_batched_sampling_rows_are_independent_and_filters_are_per_row():
    from conflux_cluster.engine.sampling import uniform_noise

    seeds = torch.tensor([5, -3, 2**62], dtype=torch.int64)
    u = uniform_noise(seeds, 1000)
    assert torch.equal(u[1], uniform_noise(seeds[1:2], 1000)[0])  # a row's noise ignores the batch
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    specs = [SampleSpec(SamplingParams(temperature=1.0, top_k=k), seed=9, output_index=3) for k in (1, 2, 0, 1)]
    out = sample(logits, specs).token_ids
    assert out[0] == logits[0].argmax() and out[3] == logits[3].argmax()  # top_k=1 rows are greedy
    assert out[1] in logits[1].topk(2).indices.tolist()
    alone = sample(logits[2:3], specs[2:3]).token_ids[0]  # same row and seed alone: same token
    assert alone == out[2]


def test_logprobs_of_tokens_the_model_rules_out_are_finite():
    """A logit of -inf (a model that masks tokens) has logprob -inf, which JSON cannot carry: the response
    would fail to serialize. Sampled and top logprobs, and prompt scores, floor it at -9999 as vLLM does."""
    import json

    from conflux_cluster.engine.prompt_logprobs import PromptTarget, score_prompt
    from conflux_cluster.engine.sampling import LOGPROB_FLOOR

    logits = torch.tensor([[2.0, float("-inf"), float("-inf"), 0.0]])
    out = sample(logits, [SampleSpec(SamplingParams(temperature=1.0, seed=1, logprobs=4), 0, 0)])
    values = [lp for _, lp in out.top_logprobs[0]]
    assert values[2:] == [LOGPROB_FLOOR, LOGPROB_FLOOR] and out.token_ids[0] in (0, 3)
    json.dumps(values, allow_nan=False)
    scores = score_prompt(logits, [PromptTarget("r", 1, 2, 2)])["r"][1]
    assert scores.logprob == LOGPROB_FLOOR and scores.rank == 3
    json.dumps([scores.logprob, *(v for _, v in scores.top)], allow_nan=False)
