"""What the engine returns: per-step deltas (``StepOutput``) and finished results (``RequestOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .prompt_logprobs import PromptLogprob

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class StepOutput:
    """One request's progress in one ``EngineCore.step()`` (a streaming delta)."""

    request_id: str
    new_token_ids: list[int]  # tokens sampled this step (0 or 1 today)
    new_text: str  # text that became final this step (held back while it may start a stop string)
    new_logprobs: list[float]  # logprob of each new token
    finished: bool
    finish_reason: FinishReason | None  # stop: EOS / stop token / stop string; length: max_tokens
    num_prompt_tokens: int
    num_output_tokens: int  # output tokens so far, including the new ones
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # if logprobs=k
    stop_reason: str | int | None = None  # the stop string or token id that ended it, if any
    scheduled_at: float | None = None  # monotonic time the request was first scheduled (queue time ends)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (OpenAI usage.cached_tokens)
    # with the first token of a request that asked (prompt_logprobs): per prompt position, None for the first
    prompt_logprobs: list[PromptLogprob | None] | None = None


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM-shaped)."""

    index: int
    text: str
    token_ids: list[int]  # includes the EOS / stop token when one ended the request
    cumulative_logprob: float
    logprobs: list[float] | None  # per token, when SamplingParams.logprobs is set
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """All completions of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
