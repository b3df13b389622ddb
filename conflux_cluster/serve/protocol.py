"""OpenAI-compatible request and response models (pydantic). Only what the server implements.

No request field is silently ignored (docs/serving.md has the table). A parameter of OpenAI or vLLM
that this server does not implement (``best_of: 3``, ``prompt_logprobs``, ``reasoning_effort``, ... see
``UNIMPLEMENTED``) is a 400 naming it at anything but its neutral value; a field that neither API has
is a 400 naming it too (``unknown_fields``); OpenAI fields that change nothing in the output (``store``,
``metadata``, ... ``NO_EFFECT``) are accepted. An explicit ``null`` is the field's default, for every
optional field (clients send nulls when a wrapper passes None).

Types are JSON's, as OpenAI checks them: a number field takes a JSON number (``"5"`` or ``true`` is a
400, where pydantic's lax mode would read 5 and 1), a boolean field takes ``true`` / ``false`` only.
An integral number is an integer (``2.0``), as JSON Schema counts it.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, model_serializer, model_validator

from .tool_protocol import DeltaToolCall, ResponseFormat, StructuredOutputsParams, ToolCall, ToolChoice, ToolDefinition


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
    """A request's top level: unknown fields are dropped here (``validate_request`` refuses them first);
    an explicit ``null`` is the field's default."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and fields[k].default is not None)}


# OpenAI / vLLM parameters that change what is generated and that this server does not implement, with
# their neutral values (what clients send when they do not use them): any other value is a 400. A name
# the request model has (``echo`` on completions) is that model's field, not this table's.
UNIMPLEMENTED: dict[str, tuple] = {
    "best_of": (None, 1), "suffix": (None, ""), "use_beam_search": (None, False), "length_penalty": (None, 1.0),
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False),  # completions
    "functions": (None, []), "function_call": (None, "none"),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,),
    "bad_words": (None, []), "allowed_token_ids": (None,),
    "reasoning_effort": (None,), "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": (None,),
    "echo": (None, False), "chat_template": (None,), "add_special_tokens": (None,), "documents": (None,),
    "mm_processor_kwargs": (None,), "return_tokens_as_token_ids": (None, False), "prediction": (None,),
    "audio": (None,), "modalities": (None, ["text"]), "web_search_options": (None,), "prompt_embeds": (None,),
    "verbosity": (None,), "logits_processors": (None,), "thinking_token_budget": (None,),
    "kv_transfer_params": (None,), "vllm_xargs": (None,), "cache_salt": (None,),
}


def _string_map(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


# OpenAI fields that change nothing in what is generated: accepted (bookkeeping on OpenAI's side), each
# at its JSON type (OpenAI's): a wrong type is a 400, as OpenAI answers (null: not sent)
NO_EFFECT_TYPES: dict[str, tuple[str, Any]] = {
    "store": ("a boolean", lambda v: isinstance(v, bool)),
    "metadata": ("an object of string values", _string_map),
    **{k: ("a string", lambda v: isinstance(v, str))
       for k in ("service_tier", "user", "prompt_cache_key", "safety_identifier", "request_id")},
}
NO_EFFECT = frozenset(NO_EFFECT_TYPES)


def unimplemented_fields(data: dict, model_cls: type[BaseModel] | None = None) -> list[str]:
    """Top-level parameters of ``data`` in ``UNIMPLEMENTED`` (and not a field of ``model_cls``) at a value
    other than their neutral one."""
    own = set(model_cls.model_fields) if model_cls is not None else set()
    return sorted(k for k, v in data.items()
                  if k in UNIMPLEMENTED and k not in own and not any(_same_json(v, n) for n in UNIMPLEMENTED[k]))


def _same_json(value: object, neutral: object) -> bool:
    """``value`` is ``neutral`` as JSON reads: equal and of its JSON type (``true`` is not ``1``, ``0`` is not
    ``false``; ``1`` and ``1.0`` are one number)."""
    def kind(v: object) -> type:
        return float if type(v) is int else type(v)

    return kind(value) is kind(neutral) and value == neutral


def unknown_fields(model_cls: type[BaseModel], data: dict) -> list[str]:
    """Top-level keys of ``data`` that neither ``model_cls`` nor OpenAI / vLLM know (``UNIMPLEMENTED``,
    ``NO_EFFECT``), sorted: the ingress refuses them (a typo, or a newer field, would change nothing)."""
    known = set(model_cls.model_fields) | {f.alias for f in model_cls.model_fields.values() if f.alias}
    return sorted(str(k) for k in data if k not in known and k not in UNIMPLEMENTED and k not in NO_EFFECT)


class StreamOptions(_Strict):
    include_usage: StrictBool | None = False  # send a final chunk carrying ``usage`` (empty choices)
    continuous_usage_stats: StrictBool | None = False  # every chunk carries the usage so far (needs include_usage)
    # OpenAI's random padding of stream events (on by default there): this server sends none, so only false
    include_obfuscation: StrictBool | None = None

    @model_validator(mode="after")
    def _no_obfuscation(self) -> "StreamOptions":
        if self.include_obfuscation:
            raise ValueError("include_obfuscation: true is not supported by this server (its stream events carry no "
                             "obfuscation padding); send false or leave it out")
        return self


class SamplingFields(_Lenient):
    """Sampling parameters shared by both endpoints (OpenAI names, plus vLLM's extensions)."""

    @model_validator(mode="before")
    @classmethod
    def _no_effect_types(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for k, (kind, ok) in NO_EFFECT_TYPES.items():
                if data.get(k) is not None and not ok(data[k]):
                    raise ValueError(f"{k}: expected {kind}, got {type(data[k]).__name__}")
        return data

    model: str
    temperature: Float = Field(1.0, ge=0.0, le=2.0)  # 0: greedy
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int = Field(-1, ge=-1)  # -1 or 0: off
    seed: Int | None = Field(None, ge=0, le=2**63 - 1)  # same seed + same request -> same text; int64, as OpenAI
    stop: str | list[str] | None = None  # up to 4 stop strings, excluded from the output
    n: Int = Field(1, ge=1, le=8)  # choices per request
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Float = Field(0.0, ge=-2.0, le=2.0)  # minus this for each token in the output
    frequency_penalty: Float = Field(0.0, ge=-2.0, le=2.0)  # minus this x the token's count in the output
    ignore_eos: StrictBool = False  # vLLM extension: generate exactly max_tokens (benchmarks)
    return_token_ids: StrictBool = False  # vLLM extension: each streamed choice carries its new `token_ids`
    response_format: ResponseFormat | None = None  # text, json_object or json_schema (serve/tools.py)
    structured_outputs: StructuredOutputsParams | None = None  # vLLM: json, regex, choice or grammar
    # vLLM extensions (engine/penalties.py has the semantics)
    repetition_penalty: Float = Field(1.0, gt=0.0, le=100.0)  # tokens of prompt + output: logit / r (> 0) or x r
    min_p: Float = Field(0.0, ge=0.0, le=1.0)  # drop tokens below min_p x the most likely one's probability
    min_tokens: Int = Field(0, ge=0)  # EOS and stop_token_ids cannot end the output before this many tokens
    logit_bias: dict[str, Float] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    stop_token_ids: list[Int] | None = None  # token ids that end the output (the id's text is not in it)
    include_stop_str_in_output: StrictBool = False  # keep the stop string that ended the output
    skip_special_tokens: StrictBool = True  # leave special tokens' text out of the output
    priority: Int = 0  # lower is scheduled first (vLLM's rule), in every scheduling policy
    prompt_logprobs: Int | None = Field(None, ge=0)  # vLLM: score every prompt token, with this many alternatives
    # ConfluxServe extension (policy slo): 503 slo_unattainable at once rather than a first token after the TTFT SLO
    reject_unattainable: StrictBool = False

    @model_validator(mode="after")
    def _check(self) -> "SamplingFields":
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop: at most 4 stop sequences")
        if self.stop == "" or (isinstance(self.stop, list) and "" in self.stop):  # vLLM's 400: it would match nothing
            raise ValueError("stop: stop strings must not be empty")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        o = self.stream_options
        if o is not None and o.continuous_usage_stats and not o.include_usage:  # it would change nothing
            raise ValueError("stream_options: continuous_usage_stats needs include_usage to be true (only a stream "
                             "that carries usage can carry it in every chunk)")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available when stream is true (as in vLLM)")
        bad = [k for k in self.logit_bias or () if _token_id(k) is None]
        if bad:
            raise ValueError(f"logit_bias: keys must be token ids written in ASCII digits, as OpenAI writes them "
                             f"(\"50256\"), not {bad[0][:32]!r}")
        return self

    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` with integer keys."""
        return {_token_id(k): float(v) for k, v in (self.logit_bias or {}).items()}

    def max_tokens_field(self) -> str:
        """The field the output budget was sent in (errors about the budget name it)."""
        return "max_tokens"

    def usage_every_chunk(self) -> bool:
        """``stream_options.continuous_usage_stats`` with ``include_usage``: every chunk carries the usage so far."""
        o = self.stream_options
        return bool(o and o.include_usage and o.continuous_usage_stats)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


_DECIMAL = re.compile(r"0|-?[1-9][0-9]*")  # one spelling per id: no space, sign, leading zero, "_" or non-ASCII digit


def _token_id(key: str) -> int | None:
    """``key`` as a token id; None unless it is written in decimal digits (``int`` alone read " 5", "05" and "5_0",
    so two keys could name one token)."""
    if not _DECIMAL.fullmatch(key):
        return None
    try:
        return int(key)
    except ValueError:  # more digits than Python reads
        return None


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


def _text_parts(value: object) -> object:
    """A content part list whose parts are all ``text`` parts as it is; a part of another type (``image_url``,
    ``input_audio``, ``file``) is one message saying so, not pydantic's error for each form of the union."""
    if isinstance(value, list):
        for i, part in enumerate(value):
            if isinstance(part, dict) and part.get("type") != "text":
                raise ValueError(f"content[{i}]: content parts of type {json.dumps(part.get('type'))[:60]} are not "
                                 "supported (this server reads text: send a string or parts of type \"text\")")
    return value


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    # None only on an assistant message with tool_calls
    content: Annotated[str | list[ContentPart] | None, BeforeValidator(_text_parts)] = None
    # OpenAI's pattern: no whitespace, "<", "|", "\\", "/" or ">", so no special-token text reaches a template
    name: str | None = Field(None, pattern=r"^[^\s<|\\/>]+$")
    tool_call_id: str | None = None  # OpenAI requires it on a "tool" message (a tool result the client ran)
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls (the client ran them)
    # an assistant message's thinking (a reasoning parser's output sent back): passed to the template,
    # which keeps or drops it as the model's own chat format does
    reasoning_content: str | None = None
    # what an OpenAI response's assistant message also carries (``message.model_dump()`` sends them back):
    # accepted empty, the only form this server answers with; a value would be history the prompt drops
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None

    @model_validator(mode="after")
    def _check(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message has tool calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("reasoning_content: only an assistant message has reasoning_content")
        if self.refusal is not None:
            raise ValueError("refusal: an assistant message's refusal text is not supported here; send it as "
                             "content (null is accepted)")
        if self.annotations:
            raise ValueError("annotations: not supported in messages (null or [] is accepted)")
        if self.audio is not None:
            raise ValueError("audio: audio replies are not supported by this server (null is accepted)")
        if self.function_call is not None:
            raise ValueError("function_call: the legacy function call form is not supported; send tool_calls "
                             "(null is accepted)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: required on a tool message (the id of the call it answers)")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only a tool message has a tool_call_id")
        if isinstance(self.content, list) and not self.content:  # OpenAI: an array of at least one part
            raise ValueError("content: an empty array of content parts (send at least one part, or a string)")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (only an assistant message with tool_calls may omit it)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


# ``apply_chat_template``'s own arguments and what the server passes it (the request's fields, --chat-template):
# not template variables, so not ``chat_template_kwargs`` keys (the tokenizer dropped or ignored them unseen)
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)  # legacy name
    max_completion_tokens: Int | None = Field(None, ge=1)  # wins over max_tokens
    logprobs: StrictBool = False  # return the sampled token's logprob per token
    top_logprobs: Int | None = Field(None, ge=0)  # alternatives per token (needs logprobs; server cap max_logprobs)
    # chat-template controls (vLLM's): passed to the model's template
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. {"enable_thinking": false}
    add_generation_prompt: StrictBool = True  # end the prompt with the assistant turn's opening
    continue_final_message: StrictBool = False  # the last (assistant) message is left open: the model continues it

    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without (OpenAI's defaults)
    parallel_tool_calls: StrictBool | None = None  # false: at most one call

    @model_validator(mode="after")
    def _tools(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            raise ValueError("tool_choice: only allowed when tools are given")
        if self.parallel_tool_calls is not None and not names:  # OpenAI's 400; it would change nothing
            raise ValueError("parallel_tool_calls: only allowed when tools are given")
        if choice is not None and not isinstance(choice, str) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool named {choice.function.name!r} in tools")
        return self

    @model_validator(mode="after")
    def _chat_checks(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: set add_generation_prompt to false with it")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be an assistant message")
        taken = sorted(TEMPLATE_ARGUMENTS.intersection(self.chat_template_kwargs or ()))
        if taken:
            raise ValueError(f"chat_template_kwargs: {', '.join(taken)}: not a template variable (the request's "
                             "add_generation_prompt, continue_final_message and tools are its own fields; the "
                             "others are the server's)")
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def logprobs_count(self) -> int | None:
        """Top alternatives per token the engine computes (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_logprobs_count(self) -> int | None:
        return self.prompt_logprobs


MAX_CHOICES = 256  # prompts x n of one completions request


def _token_id_like(value: object) -> bool:
    """An integer, or an integral JSON number (``2.0``) that ``Int`` can read as one (not ``1e300``); not a boolean."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer() and abs(value) < 2.0**63)


def _prompt_form(value: object) -> object:
    """``value`` if it is one of a prompt's forms; else one message naming them (pydantic's own error lists every
    form of the union with its validator's internal name)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and (all(isinstance(p, str) for p in value) or all(map(_token_id_like, value))
                                    or all(isinstance(p, list) and all(map(_token_id_like, p)) for p in value)):
        return value
    got = (f"a list of {', '.join(sorted({type(p).__name__ for p in value}))}" if isinstance(value, list)
           else type(value).__name__)
    raise ValueError("prompt: expected text, a list of texts, a list of token ids (integers) or a list of lists of "
                     f"token ids, got {got}")


class CompletionRequest(SamplingFields):
    # one prompt (text or token ids) or a batch of them (texts or token-id lists), as OpenAI and vLLM take:
    # choice j * n + i is the i-th completion of prompt j
    prompt: Annotated[str | list[str] | list[Int] | list[list[Int]], BeforeValidator(_prompt_form)]
    # OpenAI's default for /v1/completions; 0 only with echo: the prompt (and its logprobs) alone, as vLLM
    max_tokens: Int | None = Field(16, ge=0)
    logprobs: Int | None = Field(None, ge=0)  # N: the sampled token's logprob and the N most likely (cap max_logprobs)
    echo: StrictBool = False  # the prompt's text before the completion (with logprobs: the prompt's logprobs too)
    best_of: Int | None = Field(None, ge=1)  # candidates per prompt, the n best returned: only n is served here

    @model_validator(mode="after")
    def _prompts(self) -> "CompletionRequest":
        count = len(self.prompts())
        if count * self.n > MAX_CHOICES:
            raise ValueError(f"prompt: {count} prompts x n={self.n} is more than {MAX_CHOICES} "
                             "choices in one request; send several requests")
        if self.best_of is not None and self.best_of < self.n:  # OpenAI's and vLLM's 400
            raise ValueError(f"best_of: {self.best_of} is less than n ({self.n}); it must be at least n")
        if self.best_of is not None and self.best_of > self.n:
            raise ValueError(f"best_of: {self.best_of} candidates for n={self.n} choices is not supported by this "
                             "server (it generates n); leave best_of out or set it to n")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo (the prompt alone, e.g. to score it with "
                             "logprobs); otherwise it must be at least 1")
        return self

    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: each choice is its prompt (and the prompt's logprobs), no output. The
        engine samples one token, which the response leaves out (vLLM's way)."""
        return self.echo and self.max_tokens == 0

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        """Alternatives per prompt position the engine computes: ``prompt_logprobs``, or echo with logprobs."""
        if self.echo and self.logprobs is not None:
            return max(self.prompt_logprobs or 0, self.logprobs)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The batch: texts or token-id lists (one prompt: a batch of one)."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)

    def max_new_tokens(self) -> int | None:
        return 1 if self.echo_only() else self.max_tokens


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
    content: str | None
    tool_calls: list[ToolCall] | None = None  # present only when the model called tools
    reasoning_content: str | None = None  # with a reasoning parser: the model's thinking (absent otherwise)

    @model_serializer(mode="wrap")
    def _drop_unset_optional(self, handler):  # noqa: ANN001, ANN202 - pydantic's serializer hook
        data = handler(self)
        if self.tool_calls is None:
            data.pop("tool_calls", None)
        if self.reasoning_content is None:
            data.pop("reasoning_content", None)
        return data


class _TokenIdsIfAsked(BaseModel):
    """A choice whose ``token_ids`` key is present only when set (``return_token_ids``); so is a
    ``prompt_logprobs`` key (completions)."""

    token_ids: list[int] | None = None  # the choice's (streamed: the chunk's) new token ids

    @model_serializer(mode="wrap")
    def _drop_unset_token_ids(self, handler):  # noqa: ANN001, ANN202 - pydantic's serializer hook
        data = handler(self)
        ids = data.pop("token_ids", None)
        if "prompt_logprobs" in data and data["prompt_logprobs"] is None:
            del data["prompt_logprobs"]
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
    prompt_logprobs: list[dict[str, dict] | None] | None = None  # vLLM's (asked with prompt_logprobs)

    @model_serializer(mode="wrap")
    def _drop_unasked_prompt_logprobs(self, handler):  # noqa: ANN001, ANN202 - pydantic's serializer hook
        data = handler(self)
        if self.prompt_logprobs is None:
            data.pop("prompt_logprobs", None)
        return data


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


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
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_TokenIdsIfAsked):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM: per prompt position None or {token id: {"logprob", "rank", "decoded_token"}} (asked with prompt_logprobs;
    # the key is absent otherwise)
    prompt_logprobs: list[dict[str, dict] | None] | None = None


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
