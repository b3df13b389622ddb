"""OpenAI / vLLM request and response models for tool calling and structured outputs (pydantic).

Request side: ``tools``, ``tool_choice``, assistant ``tool_calls``, ``response_format`` and vLLM's
``structured_outputs``. Response side: a message's ``tool_calls`` and the streamed ``DeltaToolCall``
(first delta of a call: ``index``, ``id``, ``type``, ``function.name``; then ``function.arguments``
fragments), each written without the keys it does not carry, as OpenAI sends them.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_serializer, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    """A function tool's definition: an unknown key is a 400 (OpenAI refuses additional properties here too; a
    typo such as ``parmeters`` would leave the tool without arguments, unseen)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object (None: no arguments)
    strict: StrictBool | None = None  # accepted; forced calls always follow the schema

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters else {"type": "object", "properties": {}}


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A call in an assistant message (request) or in a response's message."""

    id: str = Field(default_factory=lambda: new_call_id())
    type: Literal["function"] = "function"
    function: FunctionCall


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class JsonSchemaFormat(_Strict):
    name: str = Field("response", pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's pattern
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: StrictBool | None = None  # the output always follows the schema (strict or not)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format: type json_schema needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:  # it would constrain nothing
            raise ValueError(f"a json_schema is only read with type json_schema, not {self.type}")
        return self


class StructuredOutputsParams(_Strict):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # a JSON Schema (object or JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar / GBNF dialect), with a ``root`` rule
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool | None = None  # accepted: whitespace is never free here
    disable_fallback: StrictBool | None = None  # accepted: there is one backend

    @model_validator(mode="after")
    def _one(self) -> "StructuredOutputsParams":
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar, json_object")
        return self


# ---- responses ------------------------------------------------------------------------------


def _without_none(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _without_none(v) for k, v in data.items() if v is not None}
    return data


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """One streamed piece of a tool call; keys it does not carry are left out."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # noqa: ANN001, ANN202 - pydantic's serializer hook
        return _without_none(handler(self))
