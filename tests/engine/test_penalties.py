"""Logits processors (engine/penalties.py) against vLLM's formulas, on every rank layout; logprobs against
a log-softmax of the engine's own logits."""

from __future__ import annotations

import pytest
import torch

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.loader import ModelSource
from conflux_cluster.engine.models.config import ModelConfig
from conflux_cluster.engine.penalties import RowProcessing, TokenHistory, process_logits
from conflux_cluster.engine.sampling import SampleSpec, sample
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.tokenizer import ByteTokenizer
from conflux_cluster.engine.runtime.multiproc import MultiprocExecutor

from .helpers import byte_engine

TINY = ModelConfig(architecture="llama", vocab_size=300, hidden_size=72, intermediate_size=96,
                   num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=8,
                   rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)
SOURCE = ModelSource("tiny-9-3", "preset", None, TINY)


def _reference(logits: torch.Tensor, prompt: list[int], outputs: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's penalties, one token at a time."""
    x = logits.clone()
    for v in set(prompt) | set(outputs):
        x[v] = x[v] / p.repetition_penalty if x[v] > 0 else x[v] * p.repetition_penalty
    for v in set(outputs):
        x[v] -= p.frequency_penalty * outputs.count(v) + p.presence_penalty
    for v, b in p.logit_bias.items():
        x[v] += b
    return x


def test_penalties_and_bias_match_vllm_and_plain_rows_are_untouched():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    hist = TokenHistory(prompt=[1, 2, 3, 7, 7], base=2, outputs=[9, 9, 4])  # outputs: 7, 7 (folded), 9, 9, 4
    params = [SamplingParams(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3,
                             logit_bias={5: 2.5, 9: -1.0}),
              SamplingParams(),
              SamplingParams(frequency_penalty=-0.5),
              SamplingParams(min_tokens=2, logit_bias={11: 100.0})]
    rows = [RowProcessing(params[0], 5, hist), RowProcessing(params[1], 5, None),
            RowProcessing(params[2], 5, hist), RowProcessing(params[3], 1, None, blocked=(11, 12))]
    out = process_logits(logits, rows)
    assert torch.allclose(out[0], _reference(logits[0], [1, 2, 3], [7, 7, 9, 9, 4], params[0]))
    assert torch.equal(out[1], logits[1])
    assert torch.allclose(out[2], _reference(logits[2], [1, 2, 3], [7, 7, 9, 9, 4], params[2]))
    assert out[3, 11] == float("-inf") and out[3, 12] == float("-inf")  # min_tokens wins over the bias
    assert process_logits(logits, [RowProcessing(SamplingParams(), 0, None)] * 4) is logits  # nothing asked
    after = process_logits(logits[3:], [RowProcessing(params[3], 2, None, blocked=(11, 12))])
    assert after[0].argmax() == 11  # min_tokens reached: the bias forces it


def test_min_p_one_is_greedy_and_logprobs_are_of_the_raw_logits():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)) * 2
    specs = [SampleSpec(SamplingParams(temperature=1.5, min_p=1.0, logprobs=4), seed=i, output_index=0)
             for i in range(3)]
    out = sample(logits, specs)
    assert out.token_ids == logits.argmax(-1).tolist()
    ref = logits.log_softmax(-1)
    for i in range(3):
        ids, vals = zip(*out.top_logprobs[i])
        assert list(ids) == ref[i].topk(4).indices.tolist()
        assert torch.allclose(torch.tensor(vals), ref[i].topk(4).values)


def test_streamed_logprobs_equal_a_log_softmax_of_the_engine_logits():
    core = byte_engine("tiny-llama", chunk=64)
    worker = core.executor.worker
    worker.keep_logits = True
    core.add_request(GenerateRequest("a", list(range(40, 70)),
                                     SamplingParams(temperature=0.8, seed=3, max_tokens=5, logprobs=5,
                                                              ignore_eos=True)))
    core.add_request(GenerateRequest("b", list(range(90, 100)), SamplingParams(temperature=0, max_tokens=4, logprobs=2,
                                                               repetition_penalty=2.0, ignore_eos=True)))
    seen = 0
    while core.has_unfinished():
        for out in core.step():
            ref = worker.last_logits[out.request_id].log_softmax(-1)  # [V] of this step
            k = len(out.new_top_logprobs[0])
            assert [t for t, _ in out.new_top_logprobs[0]] == ref.topk(k).indices.tolist()
            assert torch.allclose(torch.tensor([v for _, v in out.new_top_logprobs[0]]), ref.topk(k).values, atol=1e-6)
            assert out.new_logprobs[0] == pytest.approx(ref[out.new_token_ids[0]].item(), abs=1e-6)
            seen += 1
    assert seen == 9


def _engine(ranks: int) -> EngineCore:
    cfg = EngineConfig(model="tiny-9-3", dtype="float32", block_size=4, num_kv_blocks=96, seed=3, num_threads=1,
                       load_progress=False, num_ranks=ranks,
                       scheduler=SchedulerConfig(max_num_batched_tokens=16, decode_reserve_tokens=0))
    executor = LocalExecutor(cfg, SOURCE) if ranks == 1 else MultiprocExecutor(cfg, SOURCE)
    return EngineCore(cfg, executor, source=SOURCE, tokenizer=ByteTokenizer())


def _run_outputs(core: EngineCore) -> dict[str, list]:
    outs: dict[str, list] = {}
    while core.has_unfinished():
        for out in core.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def test_processors_and_prompt_logprobs_on_every_rank_layout():
    """Prompts of several chunks spread over 2 ranks (the first token sampled on one rank, the rest on the
    decode rank) give what one rank gives: each rank's history is the request's. Prompt scores: position p's
    is what a request with prompt[:p] gives its first token (the full distribution: logprobs = vocabulary)."""
    prompt = [(i * 37) % 250 + 1 for i in range(45)]
    requests = {
        "rep": SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.8, ignore_eos=True),
        "freq": SamplingParams(temperature=0.9, seed=4, max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5,
                               min_p=0.05, ignore_eos=True),
        "bias": SamplingParams(temperature=0, max_tokens=6, logit_bias={17: 100.0}, ignore_eos=True),
        "min": SamplingParams(temperature=0, max_tokens=8, min_tokens=4, logit_bias={17: 100.0},
                              stop_token_ids=[17]),
        "scored": SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True),
    }
    refs = {f"ref{p}": (prompt[:p], SamplingParams(temperature=0, max_tokens=1, logprobs=300)) for p in (1, 9, 44)}
    runs = []
    for ranks in (1, 2):
        core = _engine(ranks)
        try:
            for rid, p in requests.items():
                core.add_request(GenerateRequest(rid, prompt, p))
            for rid, (ids, p) in refs.items():
                core.add_request(GenerateRequest(rid, ids, p))
            runs.append(_run_outputs(core))
        finally:
            core.executor.shutdown()
    tokens = [{rid: [t for o in outs for t in o.new_token_ids] for rid, outs in run.items()} for run in runs]
    one = tokens[0]
    assert tokens[0] == tokens[1]
    assert len(set(one["rep"])) > 6  # the penalty keeps it from looping
    assert one["bias"] == [17] * 6
    assert one["min"] == [*one["min"][:4], 17] and 17 not in one["min"][:4]  # stop id held off for 4 tokens
    for outs in runs:
        scores = outs["scored"][0].prompt_logprobs
        assert len(scores) == 45 and scores[0] is None and all(s is not None for s in scores[1:])
        assert all(o.prompt_logprobs is None for o in outs["scored"][1:])  # only with the first token
        for p in (1, 9, 44):
            full = dict(outs[f"ref{p}"][0].new_top_logprobs[0])
            assert scores[p].logprob == pytest.approx(full[prompt[p]], abs=1e-4)
            assert scores[p].rank == 1 + sum(v > full[prompt[p]] + 1e-6 for v in full.values())
            assert [t for t, _ in scores[p].top] == [t for t, _ in sorted(full.items(), key=lambda x: -x[1])[:3]]
    one, two = (run["scored"][0].prompt_logprobs for run in runs)
    assert [s.logprob for s in one[1:]] == pytest.approx([s.logprob for s in two[1:]], abs=1e-4)
