"""What flows between the ingress and an XP instance: typed requests in, token deltas out.

Stop strings are matched once, by the engine's incremental detokenizer
(``conflux_cluster.engine.detokenizer``): it holds back text that could still begin a stop string,
cuts the text before a match and finishes the request; the instance forwards that text as is.
"""

from __future__ import annotations

from dataclasses import dataclass

from conflux_cluster.engine.prompt_logprobs import PromptLogprob
from conflux_cluster.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    """Ingress -> instance -> engine: one request (a choice of an OpenAI request when n > 1), the one type
    from the HTTP handler to the rank (the engine's ``NewRequest`` carries the same ``SamplingParams``)."""

    request_id: str  # unique over the cluster
    prompt_token_ids: list[int]  # already templated and tokenized by the ingress
    params: SamplingParams  # validated by the ingress (n = 1: a choice); the engine takes it as it is
    arrival: float | None = None  # time.time() when the HTTP request arrived
    client: str = ""  # who sent it, for the per-client rate limit: an id of its API key ("" without keys)
    priority: int = 0  # lower is scheduled first (vLLM's rule); the engine's every policy honours it


PRIORITY_BOUND = 10  # priorities in -10..10 keep their own label; the others share "<-10" or ">10"
PRIORITY_BUCKETS: tuple[str, ...] = (f"<-{PRIORITY_BOUND}", *map(str, range(-PRIORITY_BOUND, PRIORITY_BOUND + 1)),
                                     f">{PRIORITY_BOUND}")  # every label, lowest priority value first


def priority_bucket(priority: int) -> str:
    """The label a request's ``priority`` is counted under (the ``priority`` metric label and
    ``requests_by_priority`` in the stats): the client picks the number, so the labels are bounded,
    23 whatever it sends."""
    if priority < -PRIORITY_BOUND:
        return PRIORITY_BUCKETS[0]
    if priority > PRIORITY_BOUND:
        return PRIORITY_BUCKETS[-1]
    return str(int(priority))


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
