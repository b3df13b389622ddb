"""Logits of random-init tiny Qwen3 (q/k norm, tied) and Llama (llama3 rope scaling, untied) models,
saved in HF format by the test, against transformers' own forward pass.

Tolerance policy (float32 on CPU): |ours - HF| <= 1e-4 + 1e-4 * |HF| elementwise, on logits of O(1)
magnitude; our engine runs the prompts in chunks over a paged cache with other requests in the
same batch, HF runs each full sequence in one pass, so the only differences are float rounding.
"""

from __future__ import annotations

import pytest
import torch

from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.sampling_params import SamplingParams

from .helpers import byte_engine, hf_tiny_model, save_hf

ATOL = RTOL = 1e-4


def _collect_logits(core, prompts: dict[str, list[int]], max_tokens: int) -> tuple[dict, dict]:
    """Run all prompts together; returns per request the output tokens and the logits of each."""
    worker = core.executor.worker
    worker.keep_logits = True
    for rid, ids in prompts.items():
        core.add_request(GenerateRequest(rid, ids,
                                         SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    tokens: dict[str, list[int]] = {r: [] for r in prompts}
    logits: dict[str, list[torch.Tensor]] = {r: [] for r in prompts}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            logits[out.request_id].append(worker.last_logits[out.request_id])
    return tokens, logits


@pytest.mark.parametrize("kind,shards", [("qwen3", None), ("llama-rope-scaling", "40KB")])
def test_logits_match_transformers(tmp_path, kind, shards):
    torch.manual_seed(0)
    hf = hf_tiny_model(kind)
    path = save_hf(hf, tmp_path / kind, max_shard_size=shards)
    if shards:
        assert (path / "model.safetensors.index.json").exists()  # the sharded-index path is exercised
    core = byte_engine(str(path), chunk=16)
    gen = torch.Generator().manual_seed(1)
    prompts = {f"r{i}": torch.randint(0, 320, (n,), generator=gen).tolist() for i, n in enumerate([45, 7, 23, 1])}
    tokens, logits = _collect_logits(core, prompts, max_tokens=5)
    for rid, prompt in prompts.items():
        seq = torch.tensor([prompt + tokens[rid][:-1]])
        with torch.no_grad():
            ref = hf(seq).logits[0, len(prompt) - 1:].float()  # [outputs, V]
        ours = torch.stack(logits[rid])
        assert ref.abs().max() > 1.0, "logits too small for the tolerance to mean anything"
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
        assert tokens[rid] == ref.argmax(-1).tolist()
    core.executor.check_invariants()
    assert core.executor.worker.kv.num_free_blocks == core.executor.worker.kv.num_blocks


def test_bf16_close_to_fp32_reference(tmp_path):
    """bf16 weights/activations: logits within 5% of the logit range of the fp32 reference."""
    hf = hf_tiny_model("llama-rope-scaling")
    path = save_hf(hf, tmp_path / "m")
    core = byte_engine(str(path), chunk=8, dtype="bfloat16")
    prompt = list(range(40, 70))
    _, logits = _collect_logits(core, {"a": prompt}, max_tokens=1)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
    err = (logits["a"][0] - ref).abs().max().item()
    assert err <= 0.05 * (ref.max() - ref.min()).item(), err
