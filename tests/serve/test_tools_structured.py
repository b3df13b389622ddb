"""Tool calling and structured outputs end to end on CPU: the official ``openai`` client, over real HTTP
(uvicorn), to the real ingress app, over a real engine (SmolLM2, one in-process rank; no Ray: the Ray
path adds nothing here and costs minutes). Every forced / required tool call's arguments and every
``json_schema`` response validate against their schemas; bad constraints are 400s naming their field.

The same checks on a GPU (issue 38's second target): ``CONFLUX_TOOLS_DEVICE=cuda
CONFLUX_TOOLS_MODEL=llama-3.1-8b python3 -m pytest tests/serve/test_tools_structured.py``."""

from __future__ import annotations

import json
import os
import threading
import time

import jsonschema
import openai
import pytest
import uvicorn

from conflux_cluster.actors.instance import XPInstanceServer
from conflux_cluster.config import ServeConfig
from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.serve.ingress import OpenAIIngress, build_api

from .direct_backend import DirectBackend

MODEL = os.environ.get("CONFLUX_TOOLS_MODEL", "smollm2-135m-instruct")
DEVICE = os.environ.get("CONFLUX_TOOLS_DEVICE", "cpu")
ASK = [{"role": "user", "content": "Give me the details of a person called Ada, as JSON."}]

SCHEMAS = [  # nested objects, enums, arrays, integers, required fields (bounded so outputs stay short)
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["color", "count"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"owner": {"type": "object", "properties": {
        "id": {"type": "integer"}, "admin": {"type": "boolean"}}, "required": ["id", "admin"]}},
     "required": ["owner"]},
    {"type": "object", "properties": {"points": {"type": "array", "items": {
        "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
        "required": ["x", "y"]}, "maxItems": 2}, "unit": {"enum": ["cm", "m"]}}, "required": ["points", "unit"]},
]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a timezone",
        "parameters": {"type": "object", "properties": {"offset": {"type": "integer", "minimum": -12,
                                                                    "maximum": 14}}, "required": ["offset"]}}}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}



@pytest.fixture(scope="module")
def client():
    cfg = EngineConfig(model=MODEL, device=DEVICE, num_threads=2, load_progress=False, num_kv_blocks=128)
    src = resolve_model(MODEL)
    instance = XPInstanceServer(0, EngineCore(cfg, LocalExecutor(cfg, src), source=src))
    ingress = OpenAIIngress(ServeConfig(model=MODEL, max_model_len=2048), router=None, instances=[],
                            backend=DirectBackend(instance))
    server = uvicorn.Server(uvicorn.Config(build_api(ingress), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
    server.should_exit = True
    thread.join(30)


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK),
                                          temperature=kw.pop("temperature", 0), max_tokens=kw.pop("max_tokens", 80),
                                          **kw)


def test_json_schema_responses_validate(client):
    for schema in SCHEMAS:
        r = _chat(client, response_format={"type": "json_schema",
                                           "json_schema": {"name": "out", "schema": schema, "strict": True}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
    r = _chat(client, response_format={"type": "json_object"}, temperature=0.9, seed=5, max_tokens=120)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still an object's beginning
        assert r.choices[0].message.content.startswith("{")


def test_vllm_structured_outputs_and_sampled_json(client):
    body = lambda so: {"structured_outputs": so}  # noqa: E731
    r = _chat(client, extra_body=body({"choice": ["yes", "no", "maybe"]}))
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    r = _chat(client, extra_body=body({"regex": r"[A-Z][a-z]{2,6} \d{2}"}))
    assert __import__("re").fullmatch(r"[A-Z][a-z]{2,6} \d{2}", r.choices[0].message.content)
    r = _chat(client, extra_body=body({"grammar": 'root ::= "A" ("b" | "c")+ "."'}), max_tokens=12)
    assert __import__("re").fullmatch(r"A[bc]+\.?", r.choices[0].message.content)
    schema = SCHEMAS[1]
    r = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=60, temperature=1.0, seed=11,
                                  n=3, extra_body=body({"json": schema}))
    for c in r.choices:  # sampled, several choices: every one follows the schema
        jsonschema.validate(json.loads(c.text), schema)


def test_forced_and_required_tool_calls_validate(client):
    asks = ["What is the weather in Paris?", "What time is it in Tokyo?", "Weather in Oslo, in fahrenheit."]
    for ask in asks:
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            r = _chat(client, messages=[{"role": "user", "content": ask}], tools=[WEATHER, TIME],
                      tool_choice=choice, parallel_tool_calls=False)  # (a 135M model repeats calls otherwise)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
            for call in c.message.tool_calls:
                assert call.id.startswith("call_") and call.type == "function"
                jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
            assert len(c.message.tool_calls) == 1
            if isinstance(choice, dict):
                assert c.message.tool_calls[0].function.name == "get_time"


def test_streamed_tool_calls_reassemble_to_the_whole(client):
    kw = dict(messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER, TIME],
              tool_choice="required", parallel_tool_calls=False)
    whole = _chat(client, **kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in _chat(client, stream=True, **kw):
        for ch in chunk.choices:
            reasons.append(ch.finish_reason)
            for d in ch.delta.tool_calls or ():
                if d.id is not None:  # the first delta of a call: id, type, name
                    assert d.type == "function" and d.function.name and d.index not in calls
                    calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    assert d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments
    assert reasons[-1] == "tool_calls" and len(calls) == 1 == len(whole)
    assert calls[0] == {"name": whole[0].function.name, "arguments": whole[0].function.arguments}


def test_streamed_parallel_calls_send_no_whitespace_content(client):
    """Several forced calls are separated by newlines in the output: none reaches the client as content."""
    kw = dict(messages=[{"role": "user", "content": "Weather in Rome and in Oslo?"}], tools=[WEATHER, TIME],
              tool_choice="required", max_tokens=120)
    whole = _chat(client, **kw).choices[0]
    assert whole.message.tool_calls and whole.message.content is None
    if len(whole.message.tool_calls) < 2 and MODEL != "smollm2-135m-instruct":  # SmolLM2's greedy output: 2
        pytest.skip(f"{MODEL}'s greedy answer is one call: no separator to check")
    assert len(whole.message.tool_calls) >= 2  # separators in the output
    contents, starts = [], 0
    for chunk in _chat(client, stream=True, **kw):
        for ch in chunk.choices:
            if ch.delta.content:
                contents.append(ch.delta.content)
            starts += sum(d.id is not None for d in ch.delta.tool_calls or ())
    assert contents == [] and starts == len(whole.message.tool_calls)


def test_a_tool_conversation_goes_through_the_template(client):
    """Assistant tool_calls (content null) and a tool result with tool_call_id, then a plain answer."""
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 degrees, sunny"}]
    r = _chat(client, messages=msgs, tools=[WEATHER], tool_choice="none", max_tokens=8)
    msg = r.choices[0].message
    assert msg.tool_calls is None and isinstance(msg.content, str)
    if MODEL == "smollm2-135m-instruct":  # real weights answer in words (random weights may emit only specials)
        assert msg.content
    r = _chat(client, messages=msgs, tools=[WEATHER], max_tokens=8)  # auto: parsed, whatever it says
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("kw, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
     "response_format"),
    (dict(extra_body={"structured_outputs": {"regex": "a("}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"grammar": "root ::= undefined_rule"}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}), "structured_outputs"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          tool_choice="required"), "tools"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": []}}}),
     "response_format"),  # meta-schema rule xgrammar does not check (its grammar would admit nothing)
    (dict(response_format={"type": "json_object"}, extra_body={"ignore_eos": True}), None),
    # keywords the grammar engine does not enforce (it admitted any JSON for them, unseen)
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}}}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "not": {"const": 0}}}}}}], tool_choice="required"),
     "tools"),
    (dict(extra_body={"structured_outputs": {"json": {"if": {"type": "integer"}, "then": {"minimum": 5}}}}),
     "structured_outputs"),
])
def test_bad_constraints_are_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, max_tokens=4, **kw)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


def test_schema_keywords_the_grammar_cannot_enforce_are_named():
    """xgrammar reads a ``$ref`` that is not a local pointer (``https://...``, ``other.json#/x``, an anchor), and
    ``not``, ``if``/``then``/``else``, ``contains``, ``$dynamicRef``, as "any JSON": an output breaking the schema
    came back as if constrained. A 400 naming the keyword and where it is; a property merely named ``not`` or
    ``if``, and local refs, are fine. (No model: ``output_guide`` is the request's check.)"""
    from conflux_cluster.serve.errors import APIError
    from conflux_cluster.serve.protocol import CompletionRequest
    from conflux_cluster.serve.tool_parsers import ToolFormat
    from conflux_cluster.serve.tools import output_guide

    def guide(schema):
        return output_guide(CompletionRequest(model="m", prompt="x", structured_outputs={"json": schema}),
                            ToolFormat.HERMES)

    for schema, keyword, where in (
            ({"$ref": "other.json#/x"}, "$ref", ""), ({"$defs": {"a": {"$anchor": "a"}}, "$ref": "#a"}, "$ref", ""),
            ({"type": "array", "items": {"contains": {"const": 1}}}, "contains", "items"),
            ({"anyOf": [{"type": "integer"}, {"not": {"type": "string"}}]}, "not", "anyOf/1"),
            ({"properties": {"a": {"$dynamicRef": "#m"}}}, "$dynamicRef", "properties/a"),
            ({"type": "integer", "else": {"minimum": 1}}, "else", ""),
            # ignored by xgrammar given what is beside them (a warning in its log, the output unchecked)
            ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", ""),
            ({"properties": {"x": {"type": "number", "multipleOf": 0.5}}}, "multipleOf", "properties/x"),
            ({"multipleOf": 2}, "multipleOf", ""),
            ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "allOf", ""),
            ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength", ""),
            ({"type": "string", "format": "email", "minLength": 3}, "minLength", ""),
            ({"type": "string", "format": "email", "pattern": "^a"}, "pattern (beside format)", ""),
            ({"items": {"type": "string", "pattern": "^(?!x)"}}, "lookahead", "items"),
            ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", ""),
            ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas", "")):
        with pytest.raises(APIError) as e:
            guide(schema)
        assert e.value.status == 400 and e.value.info.param == "structured_outputs", schema
        assert keyword in e.value.info.message and where in e.value.info.message, e.value.info.message
    ok = {"type": "object", "$defs": {"n": {"type": "integer"}}, "required": ["not", "if"],
          "properties": {"not": {"$ref": "#/$defs/n"}, "if": {"const": {"not": 1}}}}
    assert guide(ok) is not None
    for ok in ({"type": "integer", "multipleOf": 3}, {"type": ["integer", "null"], "multipleOf": 3},
               {"allOf": [{"type": "integer"}]}, {"type": "array", "uniqueItems": False},
               {"type": "string", "pattern": r"^\(?=$"},  # an escaped parenthesis: no lookahead
               {"type": "string", "minLength": 1, "maxLength": 3}):
        assert guide(ok) is not None, ok


def test_tool_schemas_are_held_to_the_grammar_only_where_calls_are_forced():
    """Under ``tool_choice: "auto"`` a tool's schema only reaches the prompt, so keywords the grammar engine cannot
    enforce (common in agent and MCP tool schemas) are served; forced (``required`` or named) they are a 400
    naming the keyword. An invalid schema is a 400 either way."""
    from conflux_cluster.serve.errors import APIError
    from conflux_cluster.serve.protocol import ChatCompletionRequest
    from conflux_cluster.serve.tool_parsers import ToolFormat
    from conflux_cluster.serve.tools import output_guide

    tagged = {"type": "function", "function": {"name": "tag", "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "url": {"type": "string", "format": "uri", "maxLength": 2048}}}}}
    plain = {"type": "function", "function": {"name": "plain", "parameters": {"type": "object"}}}
    for choice in (None, "auto", "none", {"type": "function", "function": {"name": "plain"}}):
        req = ChatCompletionRequest(model="m", messages=ASK, tools=[tagged, plain], tool_choice=choice)
        output_guide(req, ToolFormat.HERMES)  # served
    for choice in ("required", {"type": "function", "function": {"name": "tag"}}):
        req = ChatCompletionRequest(model="m", messages=ASK, tools=[tagged, plain], tool_choice=choice)
        with pytest.raises(APIError) as e:
            output_guide(req, ToolFormat.HERMES)
        assert e.value.status == 400 and e.value.info.param == "tools" and "uniqueItems" in e.value.info.message
    for schema in ({"type": "string"}, {"type": ["object", "null"]}):  # a call's arguments are a JSON object
        other = {"type": "function", "function": {"name": "s", "parameters": schema}}
        with pytest.raises(APIError) as e:
            output_guide(ChatCompletionRequest(model="m", messages=ASK, tools=[other]), ToolFormat.HERMES)
        assert e.value.status == 400 and e.value.info.param == "tools" and "type 'object'" in e.value.info.message
    invalid = {"type": "function", "function": {"name": "bad", "parameters": {"type": "objectx"}}}
    with pytest.raises(APIError) as e:
        output_guide(ChatCompletionRequest(model="m", messages=ASK, tools=[invalid], tool_choice="auto"),
                     ToolFormat.HERMES)
    assert e.value.status == 400 and e.value.info.param == "tools"
    # a schema the grammar engine cannot compile (a $ref to itself) is the tools' fault, not tool_choice's
    looped = {"type": "function", "function": {"name": "loop", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"$ref": "#/$defs/x"}}}}}
    with pytest.raises(APIError) as e:
        output_guide(ChatCompletionRequest(model="m", messages=ASK, tools=[looped], tool_choice="required"),
                     ToolFormat.HERMES)
    assert e.value.status == 400 and e.value.info.param == "tools", e.value.info.message


def test_a_schema_whose_dollar_schema_is_not_a_string_is_a_400():
    """jsonschema looks ``$schema`` up to pick the draft: a number raised AttributeError, a list or an object
    TypeError, a 500 for a schema in response_format, structured_outputs or a tool's parameters."""
    from conflux_cluster.serve.errors import APIError
    from conflux_cluster.serve.protocol import ChatCompletionRequest
    from conflux_cluster.serve.tool_parsers import ToolFormat
    from conflux_cluster.serve.tools import output_guide

    for value in (5, [], {"a": 1}):
        for fields, param in (
                (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "$schema": value}}}), "response_format"),
                (dict(structured_outputs={"json": {"$schema": value}}), "structured_outputs"),
                (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
                    "$schema": value, "type": "object"}}}]), "tools")):
            req = ChatCompletionRequest(model="m", messages=ASK, **fields)
            with pytest.raises(APIError) as e:
                output_guide(req, ToolFormat.HERMES)
            assert e.value.status == 400 and e.value.info.param == param, (value, param)
            assert "$schema" in e.value.info.message, e.value.info.message
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object"}
    assert output_guide(ChatCompletionRequest(model="m", messages=ASK, structured_outputs={"json": draft7}),
                        ToolFormat.HERMES) is not None


def test_past_call_arguments_python_will_not_read_go_to_the_template_as_text():
    """An assistant message's ``arguments`` are JSON text the client wrote: read as an object for the template,
    else kept as text. An integer of 5,000 digits (ValueError) or arrays nested 5,000 deep (RecursionError)
    escaped that fallback and answered a 500."""
    from conflux_cluster.serve.protocol import ChatCompletionRequest
    from conflux_cluster.serve.tools import conversation

    for args in ('{"n": ' + "9" * 5000 + "}", "[" * 5000 + "]" * 5000, "{not json"):
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
        req = ChatCompletionRequest(model="m", tools=[WEATHER], messages=[
            *ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
        msgs, _ = conversation(req, None)  # a template without tools: the Hermes convention written in
        assert json.dumps(args) in msgs[2]["content"]  # as a JSON string
        msgs, tools = conversation(req, "{% for t in tools %}{{ t }}{% endfor %}")  # the template renders them
        assert msgs[1]["tool_calls"][0]["function"]["arguments"] == args and tools
    req = ChatCompletionRequest(model="m", messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}}]}])
    assert conversation(req, "{{ tools }}")[0][1]["tool_calls"][0]["function"]["arguments"] == {"a": [1]}


def test_schemas_python_cannot_read_or_check_are_a_400():
    """``structured_outputs.json`` as JSON text is not seen by the body's depth check: arrays nested 3,000 deep
    raised RecursionError, an integer of 5,000 digits ValueError; a ``pattern`` of 5,000 nested groups made
    jsonschema's regex check (Python's ``re``) raise RecursionError. Each was a 500."""
    from conflux_cluster.serve.errors import APIError
    from conflux_cluster.serve.protocol import ChatCompletionRequest
    from conflux_cluster.serve.tool_parsers import ToolFormat
    from conflux_cluster.serve.tools import output_guide

    deep_pattern = {"type": "string", "pattern": "(" * 5000 + "a" + ")" * 5000}
    for fields, param, words in (
            (dict(structured_outputs={"json": "[" * 3000 + "]" * 3000}), "structured_outputs", "deeper than"),
            (dict(structured_outputs={"json": '{"maximum": ' + "9" * 5000 + "}"}), "structured_outputs", "too long"),
            (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": deep_pattern}}),
             "response_format", "too deeply"),
            (dict(structured_outputs={"json": deep_pattern}), "structured_outputs", "too deeply")):
        with pytest.raises(APIError) as e:
            output_guide(ChatCompletionRequest(model="m", messages=ASK, **fields), ToolFormat.HERMES)
        assert e.value.status == 400 and e.value.info.param == param and words in e.value.info.message, \
            e.value.info.message
    text = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert output_guide(ChatCompletionRequest(model="m", messages=ASK, structured_outputs={"json": text}),
                        ToolFormat.HERMES) is not None


def test_the_chat_template_override_decides_the_tool_format():
    """``--chat-template`` replaces the model's template for rendering, so the tool-call format and whether the
    template renders tools itself follow the override, not the tokenizer's own template (they read the latter)."""
    from conflux_cluster.engine.tokenizer import ByteTokenizer
    from conflux_cluster.serve.handlers import OpenAIServing
    from conflux_cluster.serve.request_params import ServingOptions
    from conflux_cluster.serve.tool_parsers import ToolFormat

    llama = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
             "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}<|python_tag|>{% endif %}")
    plain = OpenAIServing("m", ByteTokenizer(), 1000, backend=None, vocab_size=320)
    assert plain.tool_format == ToolFormat.HERMES and plain.chat_template == ByteTokenizer().chat_template
    served = OpenAIServing("m", ByteTokenizer(), 1000, backend=None, vocab_size=320,
                           options=ServingOptions(chat_template=llama))
    assert served.tool_format == ToolFormat.LLAMA3_JSON and served.chat_template == llama
