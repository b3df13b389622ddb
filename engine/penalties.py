"""Logits processors with vLLM's semantics, applied to every row of a step at once:

    logits [S, V] ─▶ repetition (prompt + output) ─▶ frequency / presence (output) ─▶ logit_bias
                  ─▶ min_tokens (EOS and stop ids at -inf while outputs < min_tokens)

    repetition:  l[v] / r  if l[v] > 0 else l[v] * r     for every v in the prompt or the output
    frequency:   l[v] - f * count_out[v]
    presence:    l[v] - p * (count_out[v] > 0)

Inputs reach the device through pinned memory (``util/transfer.py``), never a blocking copy: a launch
that synchronized the stream would wait for the step before it. Only the rows that ask are touched (a step whose rows use none of these returns its logits as they
are, so plain requests sample exactly as before). ``min_p`` is a filter after temperature and lives
in ``sampling._sample_rows``. Each row's history comes from the rank that samples it: the prompt it
was sent (a preempted request's prompt holds its outputs so far, ``TokenHistory.base`` of them) and
the tokens that rank sampled or received since (``engine/runtime/worker.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .sampling_params import SamplingParams
from .util.transfer import tensor_to_device, to_device


@dataclass(frozen=True)
class TokenHistory:
    """A request's tokens so far on its sampling rank (shared lists: no copy per step)."""

    prompt: Sequence[int]  # what the rank was sent: the prompt, then ``base`` outputs folded in
    base: int  # outputs folded into ``prompt`` (a preempted request that recomputes)
    outputs: Sequence[int]  # outputs since

    def split(self) -> tuple[Sequence[int], list[int]]:
        """(prompt tokens, output tokens)."""
        cut = len(self.prompt) - self.base
        return self.prompt[:cut], list(self.prompt[cut:]) + list(self.outputs)


@dataclass(frozen=True)
class RowProcessing:
    """What one row of the step needs besides its logits."""

    params: SamplingParams
    output_index: int  # outputs that exist before this token
    history: TokenHistory | None  # None: the params use no penalty
    blocked: tuple[int, ...] = ()  # min_tokens: ids that cannot be sampled while output_index < min_tokens


def _id_matrix(rows: list[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [R, L] (padding 0) and a mask [R, L] of the real entries."""
    width = max((len(r) for r in rows), default=0) or 1
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, :len(r)] = torch.as_tensor(list(r), dtype=torch.int64)
            mask[i, :len(r)] = True
    return tensor_to_device(ids, device), tensor_to_device(mask, device)


def _counts(rows: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each row: [R, V] float32."""
    ids, mask = _id_matrix(rows, device)
    out = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)
    return out.scatter_add_(1, ids, mask.float())


def _apply_penalties(x: torch.Tensor, rows: list[RowProcessing]) -> torch.Tensor:
    """x [R, V] float32 of the rows that use a penalty -> penalized."""
    vocab, dev = x.shape[-1], x.device
    prompts, outputs = zip(*(r.history.split() for r in rows))
    out_counts = _counts(list(outputs), vocab, dev)  # [R, V]
    if any(r.params.repetition_penalty != 1.0 for r in rows):  # on the host: a device read would sync the stream
        rep = to_device([r.params.repetition_penalty for r in rows], dev, torch.float32)[:, None]
        seen = (_counts(list(prompts), vocab, dev) + out_counts) > 0  # [R, V]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = to_device([r.params.frequency_penalty for r in rows], dev, torch.float32)[:, None]
    pres = to_device([r.params.presence_penalty for r in rows], dev, torch.float32)[:, None]
    return x - freq * out_counts - pres * (out_counts > 0).float()


def process_logits(logits: torch.Tensor, rows: list[RowProcessing]) -> torch.Tensor:
    """logits [S, V] float32, one ``RowProcessing`` per row -> the processed logits (the same tensor when
    no row asks for anything)."""
    asking = [i for i, r in enumerate(rows) if r.params.processes_logits]
    if not asking:
        return logits
    x = logits.clone()
    dev = x.device
    penalized = [i for i in asking if rows[i].history is not None and rows[i].params.uses_history]
    if penalized:
        idx = to_device(penalized, dev)
        x.index_copy_(0, idx, _apply_penalties(x.index_select(0, idx), [rows[i] for i in penalized]))
    biased = [i for i in asking if rows[i].params.logit_bias]
    block_rows, block_cols = [], []
    for i in asking:
        if rows[i].output_index < rows[i].params.min_tokens:
            block_rows += [i] * len(rows[i].blocked)
            block_cols += rows[i].blocked
    if biased:
        x.index_put_(*_bias_entries([(i, rows[i].params.logit_bias) for i in biased], dev), accumulate=True)
    if block_rows:
        # a device-side value: a Python float here is a pageable host scalar whose copy synchronizes
        x.index_put_((to_device(block_rows, dev), to_device(block_cols, dev)),
                     x.new_full((len(block_rows),), float("-inf")))
    return x


def _bias_entries(biases: list[tuple[int, dict[int, float]]], device: torch.device
                  ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((rows, token ids), values) of every (row, logit_bias) for one ``index_put_``, read through numpy: a bias
    may cover a whole vocabulary (~128K entries), which a Python loop per entry makes a step's longest part."""
    rows = np.concatenate([np.full(len(b), i, dtype=np.int64) for i, b in biases])
    cols = np.concatenate([np.fromiter(b.keys(), dtype=np.int64, count=len(b)) for _, b in biases])
    vals = np.concatenate([np.fromiter(b.values(), dtype=np.float32, count=len(b)) for _, b in biases])
    return ((tensor_to_device(torch.from_numpy(rows), device), tensor_to_device(torch.from_numpy(cols), device)),
            tensor_to_device(torch.from_numpy(vals), device))


def min_p_filter(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """x [R, V] logits after temperature, min_p [R] -> tokens with p < min_p · max p at -inf."""
    probs = x.softmax(-1)
    keep = probs >= min_p[:, None] * probs.amax(-1, keepdim=True)
    return x.masked_fill(~keep, float("-inf"))
