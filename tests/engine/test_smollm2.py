"""SmolLM2-135M-Instruct (the embedded GGUF) against transformers loading the same file.

Greedy tokens must be identical. The 8 prompts are submitted together with a chunk budget
smaller than the longest prompt, so prefill spans several iterations while others decode
(checked on the recorded step plans). Logprobs of the chosen tokens: |ours - HF| <= 2e-3.
"""

from __future__ import annotations

import pytest
import torch

from conflux_cluster import LLM, SamplingParams
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.detokenizer import IncrementalDetokenizer
from conflux_cluster.engine.loader import SMOLLM2_FILE, smollm2_path


CHUNK = 16
NEW_TOKENS = 6
PROMPTS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The mitochondria is the powerhouse of the cell. It produces energy in the form of ATP through a "
    "process called cellular respiration, which",
    "Once upon a time, in a small village at the edge of a vast forest, there lived an old clockmaker who "
    "had spent his whole life building clocks that never told the right time. One winter morning a "
    "stranger knocked at his door and asked",
    "Translate to French: I would like a cup of coffee, please.",
]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="smollm2-135m-instruct", device="cpu", dtype="float32", max_num_batched_tokens=CHUNK,
               load_progress=False)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=SMOLLM2_FILE,
                                                dtype=torch.float32).eval()


def test_greedy_tokens_identical_to_hf_with_chunked_cobatching(llm, hf):
    core = llm.engine
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert max(map(len, ids)) > 2 * CHUNK and min(map(len, ids)) < 4
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0)  # both stop at EOS
    core.executor.worker.keep_logits = False
    logprobs: dict[str, list[float]] = {}
    for i, p in enumerate(ids):
        core.add_request(GenerateRequest(f"p{i}", p, params))
    plans: list = []
    tokens = drain_with_logprobs(core, plans, logprobs)
    # Prefill of the longest prompt ran over >= 3 steps, some of them together with decodes.
    long_id = f"p{max(range(len(ids)), key=lambda i: len(ids[i]))}"
    long_steps = [pl for pl in plans if any(s.request_id == long_id for s in pl.prefill)]
    assert len(long_steps) >= 3
    assert any(pl.prefill and pl.decode[0] for pl in plans), "no step co-batched prefill and decode"
    for i, p in enumerate(ids):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        ref_tokens = ref.sequences[0, len(p):].tolist()
        assert tokens[f"p{i}"] == ref_tokens, f"prompt {i} diverged from HF"
        ref_lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(ref.scores, ref_tokens)]
        assert logprobs[f"p{i}"] == pytest.approx(ref_lp, abs=2e-3)
    core.executor.check_invariants()
    kv = core.executor.worker.kv  # the prefix cache is on by default: blocks end free or cached, none held
    kv.check_invariants(live_requests=set())
    assert kv.num_free_blocks + len(kv.cache) == core.blocks_per_rank and core.scheduler.kv.is_empty()


def drain_with_logprobs(core, plans, logprobs):
    execute = core.executor.execute

    def recording(step_input):
        plans.append(step_input.plan)
        return execute(step_input)

    core.executor.execute = recording
    tokens: dict[str, list[int]] = {}
    try:
        while core.has_unfinished():
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
    finally:
        core.executor.execute = execute
    return tokens


def test_chat_capital_of_france(llm):
    out = llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=20))
    c = out[0].outputs[0]
    assert c.text == "The capital of France is Paris."
    assert c.finish_reason == "stop" and c.token_ids[-1] in llm.tokenizer.eos_token_ids


def test_stop_string_cuts_text_and_finishes(llm):
    out = llm.chat([FRANCE, FRANCE], [SamplingParams(temperature=0, max_tokens=20, stop=["Paris"]),
                                      SamplingParams(temperature=0, max_tokens=20, stop=["France is P"])])
    a, b = out[0].outputs[0], out[1].outputs[0]
    assert (a.text, a.finish_reason, a.stop_reason) == ("The capital of France is ", "stop", "Paris")
    assert (b.text, b.stop_reason) == ("The capital of ", "France is P")


def test_generate_accepts_text_and_token_ids(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    text_out = llm.generate("The sky is", params)
    ids_out = llm.generate([llm.tokenizer.encode("The sky is")], params)
    assert text_out[0].outputs[0].token_ids == ids_out[0].outputs[0].token_ids
    assert len(text_out[0].outputs[0].token_ids) == 4 and text_out[0].prompt == "The sky is"
    assert text_out[0].outputs[0].text == llm.tokenizer.decode(text_out[0].outputs[0].token_ids)


def test_incremental_detokenizer_multibyte_utf8(llm):
    tok = llm.tokenizer
    text = " naïve café — 東京タワー 🎉🇫🇷 ok"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
    pieces = []
    for t in ids:
        detok.add(t)
        pieces.append(detok.take(finished=False))
    pieces.append(detok.take(finished=True))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
