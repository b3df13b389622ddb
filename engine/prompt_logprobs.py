"""Prompt logprobs (vLLM's ``prompt_logprobs``): for each prompt position ``p >= 1``, the logprob of
``prompt[p]`` given ``prompt[:p]``, its rank, and the ``k`` most likely tokens there.

The rank that runs a prefill slice ``[start, end)`` computes them from its own rows: row ``p``'s
logits predict token ``p + 1``, so a slice yields positions ``start + 1 .. end`` (the last prompt
row predicts the first output token, which is sampled, not scored)::

    prompt:   t0   t1   t2   t3   t4          slice [1, 4) on this rank
    rows:          r1   r2   r3               r1 -> scores t2, r2 -> t3, r3 -> t4

A request asking for them takes no prefix-cache hit (cached positions have no logits; vLLM does the
same), and a preempted request that recomputes does not score its prompt again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the types travel in StepResult (engine/contracts/step.py), which stays torch-free
    import torch


@dataclass(frozen=True)
class PromptLogprob:
    """One scored prompt position (crosses the rank -> scheduler boundary inside ``StepResult``)."""

    logprob: float  # of the prompt's own token at this position
    rank: int  # 1 + how many tokens were more likely
    top: tuple[tuple[int, float], ...]  # the k most likely (token id, logprob), most likely first


@dataclass(frozen=True)
class PromptTarget:
    """A row whose logits score a prompt token."""

    request_id: str
    position: int  # the scored token's position (>= 1)
    token: int  # prompt[position]
    k: int  # alternatives asked for


class PendingPromptScores:
    """A step's prompt scores computed on the device (``score_prompt_async``), their copies to the host queued
    behind them: launching the step does not wait for the device (a request asking for prompt logprobs would
    otherwise hold every step carrying its prompt, and the requests beside it, to the host's pace)."""

    def __init__(self, targets: list[PromptTarget], own: "torch.Tensor", ranks: "torch.Tensor",
                 top_vals: "torch.Tensor", top_ids: "torch.Tensor") -> None:
        from .util.transfer import HostCopy

        self._targets = targets
        self._host = HostCopy((own, ranks, top_vals, top_ids))

    def result(self) -> dict[str, dict[int, PromptLogprob]]:
        """request id -> position -> its ``PromptLogprob`` (waits for the copies only)."""
        own, ranks, top_vals, top_ids = self._host.lists()
        out: dict[str, dict[int, PromptLogprob]] = {}
        for i, t in enumerate(self._targets):
            top = tuple(zip(top_ids[i][:t.k], top_vals[i][:t.k]))
            out.setdefault(t.request_id, {})[t.position] = PromptLogprob(own[i], ranks[i], top)
        return out


def score_prompt_async(logits: "torch.Tensor", targets: list[PromptTarget]) -> PendingPromptScores | None:
    """logits [P, V] float32, one row per target -> the pending scores (None: no target)."""
    if not targets:
        return None
    from .sampling import finite_logprobs
    from .util.transfer import to_device

    lp = finite_logprobs(logits.float().log_softmax(-1))  # [P, V]
    tokens = to_device([t.token for t in targets], lp.device)
    own = lp.gather(1, tokens[:, None])  # [P, 1]
    ranks = (lp > own).sum(-1) + 1
    k = max(t.k for t in targets)
    top_vals, top_ids = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    return PendingPromptScores(targets, own[:, 0], ranks, top_vals, top_ids)


def score_prompt(logits: "torch.Tensor", targets: list[PromptTarget]) -> dict[str, dict[int, PromptLogprob]]:
    """``score_prompt_async`` waited for: request id -> position -> its ``PromptLogprob``."""
    pending = score_prompt_async(logits, targets)
    return pending.result() if pending is not None else {}


def merge_prompt_logprobs(results: list[dict[str, dict[int, PromptLogprob]]]) -> dict[str, dict[int, PromptLogprob]]:
    """The ranks' answers of one step together (TP ranks of one logical rank report the same positions)."""
    merged: dict[str, dict[int, PromptLogprob]] = {}
    for res in results:
        for rid, positions in res.items():
            merged.setdefault(rid, {}).update(positions)
    return merged
