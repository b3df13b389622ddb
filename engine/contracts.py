"""Types that cross process boundaries and that the engine, the instance actors and the router
share. Torch-free and Ray-free (a test imports this module in a fresh interpreter and checks); the
engine imports nothing from ``router/``, ``actors/`` or ``serve/`` (a test walks its imports).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class InstanceLoad:
    """What one XP instance reports to the router (DESIGN §3: instance -> router)."""

    queued_prefill_tokens: int = 0  # prompt tokens not yet prefilled, over all admitted requests
    inflight_prefill_tokens: int = 0  # prompt tokens routed here but not yet seen in a report
    num_waiting: int = 0  # requests whose prefill is not finished
    num_decoding: int = 0  # requests resident in decode
    decode_context_tokens: int = 0  # Σ c_i over resident decodes (their KV in tokens)
    kv_utilization: float = 0.0  # used / total KV blocks over the instance's ranks, in [0, 1]
    prefill_capacity: float = 1.0  # prefill tokens per second the instance sustains (> 0)
    num_ranks: int = 1  # logical ranks N of the instance
    healthy: bool = True  # False: never route here
    inflight_requests: int = 0  # requests routed here but not yet seen in a report (router-side)

    def __post_init__(self) -> None:
        if self.prefill_capacity <= 0:
            raise ValueError(f"InstanceLoad.prefill_capacity must be > 0, got {self.prefill_capacity}")

    @property
    def queued_work(self) -> int:
        """Queued plus in-flight prefill tokens."""
        return self.queued_prefill_tokens + self.inflight_prefill_tokens

    @property
    def queued_requests(self) -> int:
        """Requests waiting for prefill: reported waiting plus routed-but-unreported (admission bound)."""
        return self.num_waiting + self.inflight_requests

    def with_inflight(self, tokens: int) -> "InstanceLoad":
        """A copy with ``tokens`` of router-side in-flight work added."""
        return replace(self, inflight_prefill_tokens=self.inflight_prefill_tokens + tokens)


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
