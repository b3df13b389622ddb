"""Turning logits into tokens: greedy, temperature, top-k, top-p; seeded per (request, output index).

Reproducibility: the i-th output token of a request with seed ``s`` is drawn with a generator
seeded by ``mix(s, i)`` from that request's own logits row, so neither the other rows of the
batch nor the rank that samples can change it. Greedy rows are taken with one vectorised argmax.

Logprobs are of the model's distribution (raw logits, before temperature/top-k/top-p), like vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """SplitMix64 of (seed, index): well-spread 63-bit generator seeds for consecutive indices."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class SampleSpec:
    """One row to sample: the request's params, its effective seed and which output token this is."""

    params: SamplingParams
    seed: int  # params.seed, or one the engine drew at admission
    output_index: int  # 0 for the token after the prompt


@dataclass
class SampleOutput:
    token_ids: list[int]  # per row
    logprobs: list[float]  # per row: logprob of the chosen token
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per row, [] unless asked


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    # logits: [V] float32 (already divided by temperature) -> same, with excluded tokens at -inf
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        drop = cum - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def _sample_row(row: torch.Tensor, spec: SampleSpec) -> int:
    p = spec.params
    logits = _filter(row.float() / p.temperature, p.top_k, p.top_p)
    probs = logits.softmax(-1).cpu()
    gen = torch.Generator(device="cpu").manual_seed(mix_seed(spec.seed, spec.output_index))
    return int(torch.multinomial(probs, 1, generator=gen).item())


def sample(logits: torch.Tensor, specs: list[SampleSpec]) -> SampleOutput:
    """logits: [S, V] float32, one row per spec -> chosen token, its logprob, optional top-k logprobs."""
    assert logits.shape[0] == len(specs), (logits.shape, len(specs))
    tokens = logits.argmax(-1).tolist()  # greedy for every row; overwritten below for sampled rows
    for i, spec in enumerate(specs):
        if not spec.params.greedy:
            tokens[i] = _sample_row(logits[i], spec)
    logprobs_all = logits.log_softmax(-1)  # [S, V]
    idx = torch.tensor(tokens, device=logits.device)
    chosen = logprobs_all.gather(1, idx[:, None])[:, 0].tolist()
    top: list[list[tuple[int, float]]] = []
    if any(s.params.logprobs for s in specs):
        for i, spec in enumerate(specs):
            k = spec.params.logprobs or 0
            if k == 0:
                top.append([])
                continue
            vals, ids = logprobs_all[i].topk(k)
            top.append(list(zip(ids.tolist(), vals.tolist())))
    return SampleOutput(tokens, chosen, top)
