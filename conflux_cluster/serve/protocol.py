"""OpenAI-compatible request and response models (pydantic). Only what the server implements.

Unknown *top-level* request fields are ignored, as vLLM does (clients and SDKs send newer OpenAI
fields than a server knows); ``unknown_fields`` names them so the ingress can log a warning. Inside
nested objects (messages, content parts, ``stream_options``) unknown fields are still rejected (400
naming them). A parameter that would change the generated text and that we do not implement
(``presence_penalty: 0.5``, ``top_logprobs: 3``, ``echo: true``, ``logit_bias``, ``tools``, ... see
``UNIMPLEMENTED``) is a 400 too at anything but its neutral value, never a silently different answer.

Types are JSON's, as OpenAI checks them: a number field takes a JSON number (``"5"`` or ``true`` is a
400, where pydantic's lax mode would read 5 and 1), a boolean field takes ``true`` / ``false`` only.
An integral number is an integer (``2.0``), as JSON Schema counts it.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, model_serializer, model_validator


def _json_number(value: object) -> object:
    """A JSON number only: pydantic's lax mode would turn ``"5"`` and ``true`` into numbers."""
    if isinstance(value, (bool, str)):
        raise ValueError(f"expected a number, got {type(value).__name__}")
    return value


Int = Annotated[int, BeforeValidator(_json_number)]
Float = Annotated[float, BeforeValidator(_json_number)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    """A request's top level: unknown fields are dropped (``unknown_fields`` lists them)."""

    model_config = ConfigDict(extra="ignore")


# OpenAI / vLLM parameters that change what is generated and that this server does not implement, with
# their neutral values (what clients send when they do not use them): any other value is a 400.
UNIMPLEMENTED: dict[str, tuple] = {
    "logit_bias": (None, {}), "best_of": (None, 1), "suffix": (None, ""), "min_tokens": (None, 0),
    "repetition_penalty": (None, 1.0), "min_p": (None, 0.0), "use_beam_search": (None, False),
    "length_penalty": (None, 1.0), "response_format": (None, {"type": "text"}), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "bad_words": (None, []), "allowed_token_ids": (None,),
    "stop_token_ids": (None, []), "prompt_logprobs": (None,),
}


def unimplemented_fields(data: dict) -> list[str]:
    """Top-level parameters of ``data`` in ``UNIMPLEMENTED`` at a value other than their neutral one."""
    return sorted(k for k, v in data.items() if k in UNIMPLEMENTED and v not in UNIMPLEMENTED[k])


def unknown_fields(model_cls: type[BaseModel], data: dict) -> list[str]:
    """Top-level keys of ``data`` that ``model_cls`` does not know and that are not an unimplemented
    parameter at its neutral value (they are ignored), sorted."""
    known = set(model_cls.model_fields) | {f.alias for f in model_cls.model_fields.values() if f.alias}
    return sorted(str(k) for k in data if k not in known and k not in UNIMPLEMENTED)


class StreamOptions(_Strict):
    include_usage: StrictBool = False  # send a final chunk carrying ``usage`` (empty choices)


class SamplingFields(_Lenient):
    """Sampling parameters shared by both endpoints (OpenAI names, plus vLLM's ``top_k``)."""

    model: str
    temperature: Float = Field(1.0, ge=0.0, le=2.0)  # 0: greedy
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int = Field(-1, ge=-1)  # -1 or 0: off
    seed: Int | None = Field(None, ge=0)  # same seed + same request -> same text
    stop: str | list[str] | None = None  # up to 4 stop strings, excluded from the output
    n: Int = Field(1, ge=1, le=8)  # choices per request
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Float = Field(0.0, ge=0.0, le=0.0)  # accepted only at their neutral value
    frequency_penalty: Float = Field(0.0, ge=0.0, le=0.0)
    user: str | None = None  # accepted, ignored
    ignore_eos: StrictBool = False  # vLLM extension: generate exactly max_tokens (benchmarks)
    return_token_ids: StrictBool = False  # vLLM extension: each streamed choice carries its new `token_ids`
    # ConfluxServe extension (policy slo): 503 slo_unattainable at once rather than a first token after the TTFT SLO
    reject_unattainable: StrictBool = False

    @model_validator(mode="after")
    def _check(self) -> "SamplingFields":
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop: at most 4 stop sequences")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]  # an empty stop string matches nothing: ignored, as in a list


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart]
    name: str | None = None
    tool_call_id: str | None = None  # OpenAI requires it on a "tool" message (a tool result the client ran)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)  # legacy name
    max_completion_tokens: Int | None = Field(None, ge=1)  # wins over max_tokens
    logprobs: StrictBool = False  # return the sampled token's logprob per token
    top_logprobs: Int | None = Field(None, ge=0, le=0)  # alternatives not implemented: only 0

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


MAX_CHOICES = 256  # prompts x n of one completions request


class CompletionRequest(SamplingFields):
    # one prompt (text or token ids) or a batch of them (texts or token-id lists), as OpenAI and vLLM take:
    # choice j * n + i is the i-th completion of prompt j
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(16, ge=1)  # OpenAI's default for /v1/completions
    logprobs: Int | None = Field(None, ge=0, le=0)  # 0: the sampled token's logprob only
    echo: StrictBool = Field(False, description="only false is implemented")

    @model_validator(mode="after")
    def _prompts(self) -> "CompletionRequest":
        count = len(self.prompts())
        if count * self.n > MAX_CHOICES:
            raise ValueError(f"prompt: {count} prompts x n={self.n} is more than {MAX_CHOICES} "
                             "choices in one request; send several requests")
        if self.echo:
            raise ValueError("echo: only false is supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: texts or token-id lists (one prompt: a batch of one)."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)

    def max_new_tokens(self) -> int | None:
        return self.max_tokens


# ---- responses ----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (as OpenAI reports them)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class ChoiceLogprobs(BaseModel):
    """Chat form: ``content`` is one entry per token."""

    content: list[dict] | None = None


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class _TokenIdsIfAsked(BaseModel):
    """A choice whose ``token_ids`` key is present only when set (``return_token_ids``)."""

    token_ids: list[int] | None = None  # the choice's (streamed: the chunk's) new token ids

    @model_serializer(mode="wrap")
    def _drop_unset_token_ids(self, handler):  # noqa: ANN001, ANN202 - pydantic's serializer hook
        data = handler(self)
        ids = data.pop("token_ids", None)
        if self.token_ids is not None:
            data["token_ids"] = ids  # last, as vLLM writes it
        return data


class ChatChoice(_TokenIdsIfAsked):
    index: int
    message: ChatChoiceMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_TokenIdsIfAsked):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions form."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_TokenIdsIfAsked):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "conflux"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    # invalid_request_error | authentication_error | not_found_error | timeout_error | service_unavailable
    # | internal_error
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
