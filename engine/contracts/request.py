"""One request, from the HTTP handler to the engine (``GenerateRequest``), and the context rule that
both the ingress and the engine apply to it (``resolve_max_tokens``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..sampling_params import SamplingParams


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

    def monotonic_arrival(self) -> float | None:
        """``arrival`` on this process's monotonic clock (the engine's), or None without a stamp."""
        return None if self.arrival is None else time.monotonic() - max(0.0, time.time() - self.arrival)


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


class ContextLengthExceeded(ValueError):
    """A prompt plus its output budget does not fit the context (the ingress answers 400
    ``context_length_exceeded``; so does an instance whose context is smaller than the ingress knew)."""

    def __init__(self, prompt_tokens: int, max_tokens: int | None, max_model_len: int, why: str = "",
                 at_least: bool = False) -> None:
        """``at_least``: ``prompt_tokens`` is a lower bound (text judged by its size before tokenizing)."""
        self.prompt_tokens, self.max_tokens, self.max_model_len = prompt_tokens, max_tokens, max_model_len
        asked = f" + {max_tokens} output tokens" if max_tokens is not None else ""
        limit = f"{max_model_len} tokens" + (f" ({why})" if why else "")
        super().__init__(f"This model's maximum context length is {limit}; the request has "
                         f"{'at least ' if at_least else ''}{prompt_tokens} prompt tokens{asked}. Shorten the "
                         "prompt or lower max_tokens.")

    @property
    def param(self) -> str:
        """The request field to change: the output budget, or the prompt when it alone fills the context
        (the ingress names the endpoint's field for it: ``prompt`` or ``messages``)."""
        return "max_tokens" if self.prompt_tokens < self.max_model_len else "prompt"


def resolve_max_tokens(prompt_tokens: int, max_tokens: int | None, max_model_len: int, why: str = "") -> int:
    """The context rule, the one place it is written (the ingress and the engine both apply it): a
    request's output budget is ``max_tokens``, or the rest of the context when None; the prompt must
    leave room for at least one output token and the budget must fit. Raises ``ContextLengthExceeded``
    (``why``: where the limit comes from, when that helps, e.g. a KV pool that caps the model's context)."""
    room = max_model_len - prompt_tokens
    if room <= 0 or (max_tokens is not None and max_tokens > room):
        raise ContextLengthExceeded(prompt_tokens, max_tokens, max_model_len, why)
    return room if max_tokens is None else max_tokens
