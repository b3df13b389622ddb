"""What comes back: the engine's per-step deltas (``StepOutput``) and finished results (``RequestOutput``),
and what an instance streams to the ingress (``TokenDelta``; ``InstanceUnavailable`` when it cannot serve).

Stop strings are matched once, by the engine's incremental detokenizer (``engine/detokenizer.py``): it
holds back text that could still begin a stop string, cuts the text before a match and finishes the
request; the instance forwards that text as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..prompt_logprobs import PromptLogprob

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


@dataclass(frozen=True)
class TokenDelta:
    """Instance -> ingress: new output of one request since the previous delta."""

    request_id: str
    text: str  # new text (stop-string safe)
    token_ids: tuple[int, ...]  # new token ids
    logprobs: tuple[float, ...] = ()  # logprob of each new token (when asked for)
    # per new token, its (token id, logprob) alternatives, most likely first (when top logprobs are asked for)
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" when finished
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # output tokens so far
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    # finish_reason "error" (the instance lost a rank): whole seconds until it expects to serve again
    retry_after_s: int = 0
    # with the first token, when asked (prompt_logprobs): per prompt position (None for the first)
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None


def merge_deltas(a: TokenDelta, b: TokenDelta) -> TokenDelta:
    """One delta carrying ``a`` then ``b`` (same request, in order): what a consumer that fell behind
    gets at once instead of one message per token."""
    return TokenDelta(a.request_id, a.text + b.text, a.token_ids + b.token_ids, a.logprobs + b.logprobs,
                      a.top_logprobs + b.top_logprobs, b.finished, b.finish_reason,
                      b.num_prompt_tokens or a.num_prompt_tokens, b.num_output_tokens,
                      b.num_cached_tokens or a.num_cached_tokens, b.retry_after_s,
                      a.prompt_logprobs or b.prompt_logprobs)


class InstanceUnavailable(RuntimeError):
    """The instance cannot serve this request: a rank died and the instance is being rebuilt (or could
    not be). Raised by the instance to the ingress (through Ray, picklable); the client gets a 503 with
    ``Retry-After`` and no internals (``conflux_cluster.serve.errors.client_error``)."""

    def __init__(self, retry_after_s: int, in_flight: bool) -> None:
        super().__init__(f"XP instance unavailable (in flight: {in_flight}); retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s  # whole seconds until the instance expects to serve again (>= 1)
        self.in_flight = in_flight  # True: the request was running when the rank died (its output is lost)

    def __reduce__(self):
        return (InstanceUnavailable, (self.retry_after_s, self.in_flight))
