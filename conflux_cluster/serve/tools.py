"""Tool calling and structured outputs at the HTTP layer: a chat request -> the conversation and tools the
chat template gets, the grammar its output must match, and the model's text -> OpenAI tool calls.

The tool-call format follows the model family, read off its chat template: a template that writes
``<tool_call>`` is Hermes / Qwen, one that writes ``<|python_tag|>`` or ``ipython`` is Llama 3.x JSON.
A template that does not render ``tools`` at all (SmolLM2's, the random-weight presets' plain prompt)
gets the Hermes convention written into the conversation (the tools in the system message, past calls as
``<tool_call>`` blocks, results as ``<tool_response>`` user turns, as Qwen2.5's template does), and is
parsed as Hermes.

``tool_choice: "required"`` and a named function constrain the output with the same grammar machinery as
``response_format``: a structural tag that admits only calls in the family's format, each call's
arguments following its tool's JSON Schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from conflux_cluster.engine.structured.spec import GuideKind, StructuredOutput

from .errors import bad_request
from .json_body import MAX_JSON_DEPTH, json_deeper_than
from .protocol import ChatCompletionRequest, ChatMessage, SamplingFields
from .tool_parsers import CallArguments, CallStart, Content, ToolCallParser, ToolFormat, parse
from .tool_protocol import DeltaFunction, DeltaToolCall, FunctionCall, ToolCall, new_call_id

_HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def tool_format(chat_template: str | None) -> ToolFormat:
    """The family's tool-call format (module docstring)."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return ToolFormat.HERMES
    if "<|python_tag|>" in t or "ipython" in t:
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.HERMES


def renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def uses_tools(req: SamplingFields) -> bool:
    """True when the output is parsed for tool calls."""
    return isinstance(req, ChatCompletionRequest) and bool(req.tools) and req.tool_choice != "none"


# ---- request -> template input ------------------------------------------------------------------


def conversation(req: ChatCompletionRequest, chat_template: str | None
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template, as transformers' ``apply_chat_template`` takes them."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    if renders_tools(chat_template):
        return [_template_message(m) for m in req.messages], tools
    msgs = [_hermes_message(m) for m in req.messages]
    if tools:
        text = _HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if msgs and msgs[0]["role"] in ("system", "developer"):
            msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{text}"}
        else:
            msgs.insert(0, {"role": "system", "content": text})
    return msgs, None


def _arguments(text: str) -> Any:
    """A past call's arguments as an object (templates write them with ``tojson``); text if not JSON, or JSON that
    Python will not read (an integer of more than 4,300 digits, arrays nested past the recursion limit)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return text


def _template_message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.text() if m.content is not None else None}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
    return out


def _hermes_message(m: ChatMessage) -> dict[str, str]:
    """A message for a template that knows only role and content (Hermes convention written in)."""
    text = m.text() if m.content is not None else ""
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    for c in m.tool_calls or ():
        call = {"name": c.function.name, "arguments": _arguments(c.function.arguments)}
        text += f"\n<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"
    return {"role": m.role, "content": text.lstrip("\n")}


# ---- request -> grammar -------------------------------------------------------------------------

_CALL_TAGS = {  # the family's call framing: (text before the arguments, text after), separator
    ToolFormat.HERMES: ('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>", "\n"),
    ToolFormat.LLAMA3_JSON: ('{{"name": "{name}", "parameters": ', "}", "; "),
}


def forced_calls(req: ChatCompletionRequest, fmt: ToolFormat) -> StructuredOutput | None:
    """The grammar of ``tool_choice`` "required" (one call or more of any tool; one with
    ``parallel_tool_calls: false``) or a named function (exactly one call of it); None otherwise."""
    names = _constrained_tools(req)
    if not names:
        return None
    choice = req.tool_choice
    tools = [t for t in req.tools if t.function.name in names]
    begin, end, separator = _CALL_TAGS[fmt]
    tags = [{"type": "tag", "begin": begin.format(name=t.function.name), "end": end,
             "content": {"type": "json_schema", "json_schema": t.function.arguments_schema(),
                         "max_whitespace_cnt": 1}} for t in tools]  # no runs of whitespace to loop on
    one = not isinstance(choice, str) or req.parallel_tool_calls is False
    tag = {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags,
                                                "separator": separator, "at_least_one": True,
                                                "stop_after_first": one}}
    return StructuredOutput(kind=GuideKind.STRUCTURAL_TAG, spec=json.dumps(tag, ensure_ascii=False))


def output_guide(req: SamplingFields, fmt: ToolFormat) -> StructuredOutput | None:
    """The constraint on ``req``'s output from ``response_format``, ``structured_outputs`` or a forced
    ``tool_choice`` (at most one of them), validated: a bad schema / regex / grammar is a 400 naming its
    field. Needs xgrammar (imported here, on first use)."""
    guides: list[tuple[str, StructuredOutput]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        guides.append(("response_format", StructuredOutput(kind=GuideKind.JSON_OBJECT)))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_
        guides.append(("response_format", StructuredOutput.json_schema(_checked_schema(schema, "response_format"))
                       if schema is not None else StructuredOutput(kind=GuideKind.JSON_OBJECT)))
    so = req.structured_outputs
    if so is not None:
        guides.append(("structured_outputs", _structured_outputs(so)))
    if isinstance(req, ChatCompletionRequest):
        constrained = _constrained_tools(req)
        for t in req.tools or ():
            params = t.function.parameters
            if isinstance(params, dict) and params.get("type", "object") != "object":  # arguments are an object
                raise bad_request(f"tools: invalid schema for function {t.function.name!r}: the parameters must be a "
                                  f"JSON Schema of type 'object', got type {json.dumps(params['type'])[:80]}",
                                  param="tools")
            if params is not None:
                _checked_schema(params, "tools", enforced=t.function.name in constrained)
        forced = forced_calls(req, fmt)
        if forced is not None:
            guides.append(("tool_choice", forced))
        elif uses_tools(req) and guides:
            guides.append(("tools", guides[-1][1]))  # tool calls would have to match the other grammar
    if len(guides) > 1:
        names = ", ".join(g for g, _ in guides)
        raise bad_request(f"{names}: only one output constraint per request is supported", param=guides[-1][0])
    if not guides:
        return None
    param, guide = guides[0]
    from conflux_cluster.engine.structured.grammar import to_grammar  # xgrammar (and torch): lazily

    try:
        to_grammar(guide)
    except ValueError as e:
        if param == "tool_choice":  # the forced calls' grammar is made of the tools' schemas
            raise bad_request(f"tools: the tools' parameters cannot be compiled into a grammar: {e}"[:500],
                              param="tools") from None
        raise bad_request(f"{param}: {e}", param=param) from None
    return guide


def _constrained_tools(req: ChatCompletionRequest) -> frozenset[str]:
    """Names of the tools whose calls the grammar constrains: every tool under ``tool_choice: "required"``, the
    named one under a named choice; none under ``auto`` / ``none`` (their schemas only reach the prompt)."""
    choice = req.tool_choice
    if not req.tools or choice in (None, "auto", "none"):
        return frozenset()
    if isinstance(choice, str):
        return frozenset(t.function.name for t in req.tools)
    return frozenset({choice.function.name})


def _checked_schema(schema: Any, param: str, enforced: bool = True) -> Any:
    """``schema`` if it is a valid JSON Schema (its meta-schema's rules: xgrammar reads some invalid ones
    as grammars that admit nothing) and, where the grammar will ``enforce`` it, every keyword of it is one
    the grammar enforces (``_unenforced``), else a 400 naming ``param``. A tool's schema under ``tool_choice:
    "auto"`` is not enforced (only shown to the model), so agent tool schemas with such keywords
    (``uniqueItems``, ``format`` beside ``maxLength``, ...) are served there."""
    import jsonschema

    draft = jsonschema.Draft202012Validator
    declared = schema.get("$schema") if isinstance(schema, dict) else None
    # a $schema that is not a string is not looked up (jsonschema's lookup raises on it): 2020-12's
    # meta-schema refuses it below
    validator = jsonschema.validators.validator_for(schema, default=draft) if isinstance(declared, str) else draft
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise bad_request(f"{param}: invalid JSON Schema{f' at {where}' if where else ''}: {e.message}"[:500],
                          param=param) from None
    except RecursionError:  # a ``pattern`` of hundreds of nested groups: Python's regex parser recurses per group
        raise bad_request(f"{param}: invalid JSON Schema: a pattern nests its groups too deeply to check",
                          param=param) from None
    found = _unenforced(schema, ()) if enforced else None
    if found is not None:
        path, keyword = found
        where = f" at {'/'.join(path)}" if path else ""
        raise bad_request(f"{param}: the JSON Schema keyword {keyword}{where} is not enforced by this server's "
                          "grammar engine (only local $ref: '#' or '#/...'); remove it"[:500], param=param)
    return schema


# keywords xgrammar reads as "any JSON" (an output breaking them would pass as constrained)
_UNENFORCED = frozenset({"not", "if", "then", "else", "contains", "minContains", "maxContains", "$dynamicRef",
                         "$recursiveRef", "dependentRequired", "dependentSchemas", "dependencies"})
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
# a lookahead or lookbehind group (not an escaped parenthesis): xgrammar drops it from a ``pattern``
_LOOKAROUND = re.compile(r"(?<!\\)(?:\\\\)*\(\?<?[=!]")
_VALUES = frozenset({"const", "enum", "default", "examples"})  # JSON values, not schemas


def _unenforced(schema: Any, path: tuple[str, ...]) -> tuple[tuple[str, ...], str] | None:
    """(path, keyword) of the first keyword in ``schema`` the grammar does not enforce: ``_UNENFORCED``, or a
    ``$ref`` other than a local JSON pointer (a URL, another file, an anchor); None when there is none."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found = _unenforced(item, (*path, str(i)))
            if found is not None:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    keyword = _unenforced_beside(schema)
    if keyword is not None:
        return path, keyword
    for key, value in schema.items():
        if key in _UNENFORCED:
            return path, key
        if key == "$ref" and isinstance(value, str) and not (value == "#" or value.startswith("#/")):
            return path, f"$ref ({value[:100]!r})"
        if key in _VALUES:
            continue
        if key in _NAMED_SCHEMAS and isinstance(value, dict):  # names there are not keywords
            for name, sub in value.items():
                found = _unenforced(sub, (*path, key, str(name)))
                if found is not None:
                    return found
        else:
            found = _unenforced(value, (*path, key))
            if found is not None:
                return found
    return None


def _unenforced_beside(schema: dict[str, Any]) -> str | None:
    """A keyword xgrammar ignores in ``schema`` given the keywords beside it (it warns in its log only), or None:
    ``uniqueItems: true``; ``multipleOf`` but on integers; ``allOf`` of more than one schema; ``minLength`` /
    ``maxLength`` beside ``pattern`` or ``format``, ``pattern`` beside ``format``; a ``pattern`` with a lookaround."""
    if schema.get("uniqueItems") is True:
        return "uniqueItems"
    types = [schema["type"]] if isinstance(schema.get("type"), str) else schema.get("type")
    if "multipleOf" in schema and (not isinstance(types, list) or "number" in types):  # xgrammar: integers only
        return "multipleOf (on a number that may be fractional: give type integer)"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf (of more than one schema)"
    for bound in ("minLength", "maxLength", "pattern"):
        for other in ("pattern", "format"):
            if bound != other and bound in schema and other in schema:
                return f"{bound} (beside {other})"
    if isinstance(schema.get("pattern"), str) and _LOOKAROUND.search(schema["pattern"]):
        return "pattern (a lookahead or lookbehind group)"
    return None


def _structured_outputs(so) -> StructuredOutput:  # noqa: ANN001 - StructuredOutputsParams
    if so.json_ is not None:
        schema = so.json_
        if isinstance(schema, str):  # JSON text: read with the request body's rules
            if json_deeper_than(schema.encode(), MAX_JSON_DEPTH):
                raise bad_request(f"structured_outputs.json: nests arrays/objects deeper than {MAX_JSON_DEPTH} "
                                  "levels", param="structured_outputs")
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise bad_request(f"structured_outputs.json: not JSON ({e})", param="structured_outputs") from None
            except ValueError:  # valid JSON Python will not read: an integer of more than 4,300 digits
                raise bad_request("structured_outputs.json: holds a number too long to read",
                                  param="structured_outputs") from None
        if not isinstance(schema, (dict, bool)):
            raise bad_request("structured_outputs.json: a JSON Schema is an object", param="structured_outputs")
        return StructuredOutput.json_schema(_checked_schema(schema, "structured_outputs"))
    if so.regex is not None:
        return StructuredOutput(kind=GuideKind.REGEX, spec=so.regex)
    if so.choice is not None:
        return StructuredOutput.choice(so.choice)
    if so.grammar is not None:
        return StructuredOutput(kind=GuideKind.GRAMMAR, spec=so.grammar)
    return StructuredOutput(kind=GuideKind.JSON_OBJECT)


# ---- output -> OpenAI tool calls ----------------------------------------------------------------


def parse_message(req: ChatCompletionRequest, fmt: ToolFormat, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole choice's text -> (content, tool calls)."""
    content, calls = parse(fmt, _names(req), text, _max_calls(req))
    tool_calls = [ToolCall(function=FunctionCall(name=n, arguments=a)) for n, a in calls]
    return (content if content.strip() or not tool_calls else None), tool_calls


@dataclass
class ToolCallStream:
    """One streamed choice: text deltas -> (content, tool-call deltas) as OpenAI streams them.

    Whitespace-only content (the newlines a model writes before, between and after its calls) is held
    back: it goes out in front of the next content that is not whitespace, or at the end of a response
    without calls, and is dropped when the response ends as tool calls (OpenAI never streams content
    beside tool calls)::

        "\n" | <call 0> | "\n" | <call 1> | "\n" [end]   ->  tool_calls only
        "Sure." | "\n" | <call 0> | "\n" | "Done." [end]  ->  "Sure.", call 0, "\n\nDone."
    """

    parser: ToolCallParser
    ids: list[str] = field(default_factory=list)  # call id per call index
    held: str = ""  # whitespace-only content not sent yet

    @classmethod
    def of(cls, req: ChatCompletionRequest, fmt: ToolFormat) -> "ToolCallStream":
        return cls(ToolCallParser(fmt, _names(req), _max_calls(req)))

    @property
    def called(self) -> bool:
        return self.parser.calls > 0

    def feed(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        events = self.parser.feed(text) + (self.parser.finish() if finished else [])
        content, deltas = "", []
        for e in events:
            if isinstance(e, Content) and not e.text.strip():
                self.held += e.text
            elif isinstance(e, Content):
                content, self.held = content + self.held + e.text, ""
            elif isinstance(e, CallStart):
                self.ids.append(new_call_id())
                deltas.append(DeltaToolCall(index=e.index, id=self.ids[e.index], type="function",
                                            function=DeltaFunction(name=e.name, arguments="")))
            elif isinstance(e, CallArguments):
                deltas.append(DeltaToolCall(index=e.index, function=DeltaFunction(arguments=e.fragment)))
        if finished and not self.called:  # a response of text: its whitespace is content
            content, self.held = content + self.held, ""
        return content or None, deltas


def _names(req: ChatCompletionRequest) -> frozenset[str]:
    return frozenset(t.function.name for t in req.tools or ())


def _max_calls(req: ChatCompletionRequest) -> int | None:
    one = req.parallel_tool_calls is False or not isinstance(req.tool_choice, (str, type(None)))
    return 1 if one else None
