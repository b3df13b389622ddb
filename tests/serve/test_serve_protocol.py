"""Request validation and config parsing: pure Python, no Ray (stop strings: tests/engine/test_text.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from conflux_cluster.config import ServeConfig, format_validation_error
from conflux_cluster.serve.errors import APIError
from conflux_cluster.serve.handlers import choice_seed, parse_body, validate_request
from conflux_cluster.serve.protocol import ChatCompletionRequest, CompletionRequest

MSG = [{"role": "user", "content": "hi"}]


def _err(raw: bytes, cls=ChatCompletionRequest) -> APIError:
    with pytest.raises(APIError) as e:
        parse_body(raw, cls)
    return e.value


def test_bad_requests_name_the_parameter():
    e = _err(json.dumps({"model": "m", "messages": MSG, "temperature": 3}).encode())
    assert e.status == 400 and e.info.param == "temperature" and e.info.type == "invalid_request_error"
    e = _err(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi", "colour": 1}]}).encode())
    assert e.status == 400 and e.info.param == "messages" and "colour" in str(e)  # nested objects stay strict
    e = _err(json.dumps({"model": "m", "messages": MSG, "presence_penalty": 2.5}).encode())
    assert e.info.param == "presence_penalty"  # outside OpenAI's [-2, 2]
    e = _err(b"{not json")
    assert e.status == 400 and e.info.code == "invalid_json"
    e = _err(json.dumps({"model": "m", "prompt": "x", "prompt_logprobs": 1, "stream": True}).encode(), CompletionRequest)
    assert e.info.param == "prompt_logprobs" and e.info.message.startswith("prompt_logprobs: ")  # not "Value error, "
    e = _err(json.dumps({"model": "m", "messages": MSG, "stream_options": {"include_usage": True}}).encode())
    assert e.info.param == "stream_options" and e.info.message.startswith("stream_options: ")
    e = _err(json.dumps({"model": "m", "messages": MSG, "stop": list("abcde")}).encode())
    assert e.info.param == "stop"
    e = _err(b'{"model": "m", "messages": [], "max_tokens": 1' + b"0" * 5000 + b"}")
    assert e.status == 400 and e.info.code == "invalid_json"  # past Python's int digit limit
    body = e.body()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("field, value, cls", [
    ("max_tokens", "5", ChatCompletionRequest), ("max_tokens", True, CompletionRequest),
    ("temperature", "1", ChatCompletionRequest), ("n", "2", ChatCompletionRequest), ("seed", "7", CompletionRequest),
    ("stream", "yes", ChatCompletionRequest), ("stream", 1, CompletionRequest), ("logprobs", 1, ChatCompletionRequest),
    ("logprobs", False, CompletionRequest), ("prompt", [True, False], CompletionRequest),
    ("stream_options", {"include_usage": 1}, ChatCompletionRequest)])
def test_json_types_as_openai_checks_them(field, value, cls):
    """A string or a boolean is not a number, a number is not a boolean (found by a hostile-input audit: pydantic's
    lax mode read "5" as 5, true as 1, and `logprobs: false` on completions as 0, returning logprobs)."""
    base = {"model": "m", "prompt": "hi"} if cls is CompletionRequest else {"model": "m", "messages": MSG}
    extra = {"stream": True} if field == "stream_options" else {}
    e = _err(json.dumps({**base, **extra, field: value}).encode(), cls)
    assert e.status == 400 and e.info.param == field and e.info.message.startswith(f"{field}")


def test_json_numbers_of_either_kind_are_accepted_where_they_fit():
    ok = parse_body(json.dumps({"model": "m", "messages": MSG, "max_tokens": 2.0, "temperature": 1, "n": 2}).encode(),
                    ChatCompletionRequest)
    assert (ok.max_tokens, ok.temperature, ok.n) == (2, 1.0, 2)
    assert parse_body(b'{"model": "m", "prompt": [1, 2], "logprobs": 0}', CompletionRequest).logprobs == 0


def test_a_lone_surrogate_escape_is_400_and_a_pair_is_text():
    """JSON may escape half of a UTF-16 pair on its own; no tokenizer can encode that (it was a 500)."""
    for body in ({"model": "m", "prompt": "\ud800x"}, {"model": "m", "prompt": ["ok", "\udfff"]}):
        e = _err(json.dumps(body).encode(), CompletionRequest)  # json.dumps writes the lone escape as is
        assert e.status == 400 and "surrogate" in e.info.message and e.info.code == "invalid_json"
    e = _err(json.dumps({"model": "m", "messages": [{"role": "user", "content": "\ud83d"}]}).encode())
    assert e.status == 400
    with pytest.raises(APIError, match="surrogate"):  # a Serve handle's dict (no JSON text to look at)
        validate_request(CompletionRequest, {"model": "m", "prompt": "a\udc80"})
    ok = parse_body(json.dumps({"model": "m", "prompt": "\ud83d\ude00 and \\ud800"}).encode(), CompletionRequest)
    assert ok.prompt == "\U0001F600 and \\ud800"  # a pair is one character; an escaped backslash is text


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_literals_are_invalid_json(literal: bytes):
    """Python's json reads NaN and Infinity; JSON has neither (OpenAI: 400, the body could not be parsed). A typed
    field answered a range error naming it, a schema xgrammar's "Failed to parse JSON", and a template variable
    or tool parameter went into the prompt as "NaN". Now the body is refused as not JSON, wherever it is."""
    for body in (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": %s}' % literal,
                 b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": %s}}'
                 % literal,
                 b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
                 b'"json_schema", "json_schema": {"name": "n", "schema": {"type": "number", "maximum": %s}}}}' % literal):
        e = _err(body)
        assert (e.status, e.info.code, e.info.param) == (400, "invalid_json", None), e
        assert literal.decode().lstrip("-") in e.info.message and "not a JSON value" in e.info.message
    assert parse_body(b'{"model": "m", "prompt": "NaN Infinity", "temperature": 1e-300}', CompletionRequest)


def test_a_number_past_a_double_is_invalid_json():
    """``1e400`` read as infinity: a range error naming the field, or infinity in a schema or a template
    variable. It is refused as out of range; tiny numbers (``1e-400`` reads as 0.0) and large integers stay."""
    for number in (b"1e400", b"-1.5E+999"):
        e = _err(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": '
                 b'{"x": %s}}' % number)
        assert (e.status, e.info.code) == (400, "invalid_json") and "out of range" in e.info.message, e
    assert parse_body(b'{"model": "m", "prompt": "a", "temperature": 1e-400, "max_tokens": 100000000000000000000}',
                      CompletionRequest)


def test_an_empty_content_part_array_is_400():
    """``"content": []`` was read as empty text (an empty turn sent to the model); OpenAI refuses an empty array of
    content parts (400, param messages). So does this server, for every role; ``""`` stays empty text."""
    for msg in ({"role": "user", "content": []}, {"role": "system", "content": []},
                {"role": "assistant", "content": [], "tool_calls": [{"id": "c", "type": "function",
                                                                      "function": {"name": "f", "arguments": "{}"}}]}):
        e = _err(json.dumps({"model": "m", "messages": [*MSG, msg]}).encode())
        assert e.status == 400 and e.info.param == "messages" and "empty" in e.info.message, e
    ok = parse_body(json.dumps({"model": "m", "messages": [{"role": "user", "content": ""}]}).encode(),
                    ChatCompletionRequest)
    assert ok.messages[0].text() == ""


@pytest.mark.parametrize("value", [True, False])
def test_parallel_tool_calls_without_tools_is_400(value):
    """``parallel_tool_calls`` without ``tools`` was accepted and changed nothing; OpenAI answers 400 (param
    parallel_tool_calls: "only allowed when 'tools' are specified"), as this server does for ``tool_choice``.
    vLLM accepts it, but OpenAI's clients already leave it out without tools, so OpenAI's rule is followed; null
    is its default."""
    for tools in ({}, {"tools": []}):
        e = _err(json.dumps({"model": "m", "messages": MSG, "parallel_tool_calls": value, **tools}).encode())
        assert e.status == 400 and e.info.param == "parallel_tool_calls", e
        assert e.info.message.startswith("parallel_tool_calls: "), e
    assert parse_body(json.dumps({"model": "m", "messages": MSG, "parallel_tool_calls": None}).encode(),
                      ChatCompletionRequest).parallel_tool_calls is None
    tool = {"type": "function", "function": {"name": "f"}}
    ok = parse_body(json.dumps({"model": "m", "messages": MSG, "tools": [tool], "parallel_tool_calls": value}).encode(),
                    ChatCompletionRequest)
    assert ok.parallel_tool_calls is value


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "text", "json_schema": {"schema": {}}}}, "response_format"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
])
def test_an_error_message_names_its_field_once(body, param):
    """A field's own check names the field first, and the error added the field's location before it:
    ``structured_outputs: structured_outputs: give exactly one of ...``. The field is named once."""
    import re

    e = _err(json.dumps({"model": "m", "messages": MSG, **body}).encode())
    assert e.status == 400 and e.info.param == param, e
    assert e.info.message.startswith(param) and not re.search(r"([\w.]+): \1:", e.info.message), e.info.message


@pytest.mark.parametrize("name", ["", "my schema", "a.b", "é", "x" * 65, "<|im_end|>"])
def test_a_json_schema_name_follows_openais_pattern(name):
    """``response_format.json_schema.name`` took any string up to 64 characters (empty, spaces, dots); OpenAI
    takes ``^[a-zA-Z0-9_-]{1,64}$`` only and answers 400: so does this server, naming response_format."""
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": {"type": "object"}}}
    for cls, base in ((ChatCompletionRequest, {"messages": MSG}), (CompletionRequest, {"prompt": "hi"})):
        e = _err(json.dumps({"model": "m", **base, "response_format": fmt}).encode(), cls)
        assert e.status == 400 and e.info.param == "response_format" and "name" in e.info.message, e
    ok = {**fmt, "json_schema": {**fmt["json_schema"], "name": "Person_v2-" + "x" * 54}}
    assert parse_body(json.dumps({"model": "m", "messages": MSG, "response_format": ok}).encode(),
                      ChatCompletionRequest).response_format.json_schema.name.startswith("Person_v2-")


@pytest.mark.parametrize("field, value", [("user", 5), ("user", ["a"]), ("metadata", "x"), ("metadata", {"k": 1}),
                                          ("store", "yes"), ("store", 1), ("service_tier", 3), ("prompt_cache_key", {}),
                                          ("safety_identifier", 7), ("request_id", 12)])
def test_fields_without_effect_still_have_openais_types(field, value):
    """``user``, ``metadata``, ``store``, ... change nothing in the output and were accepted at any value
    (``"user": 5``); OpenAI answers 400 for a wrong type. So does this server, naming the field."""
    for cls, base in ((ChatCompletionRequest, {"messages": MSG}), (CompletionRequest, {"prompt": "hi"})):
        e = _err(json.dumps({"model": "m", **base, field: value}).encode(), cls)
        assert e.status == 400 and e.info.param == field and e.info.message.startswith(f"{field}: "), e
    ok = {"user": "u-1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto", "prompt_cache_key": "k",
          "safety_identifier": "s", "request_id": "r-1"}
    parse_body(json.dumps({"model": "m", "messages": MSG, **ok}).encode(), ChatCompletionRequest)
    parse_body(json.dumps({"model": "m", "messages": MSG, **{k: None for k in ok}}).encode(), ChatCompletionRequest)


def test_a_tool_result_message_takes_its_tool_call_id():
    msgs = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    req = parse_body(json.dumps({"model": "m", "messages": msgs}).encode(), ChatCompletionRequest)
    assert req.messages[1].text() == "42" and req.messages[1].tool_call_id == "call_1"
    # OpenAI's rule: a tool result names the call it answers, and only a tool result has a tool_call_id (on
    # another message it was dropped unseen)
    for bad in ({"role": "tool", "content": "42"}, {"role": "user", "content": "hi", "tool_call_id": "call_1"}):
        e = _err(json.dumps({"model": "m", "messages": [MSG[0], bad]}).encode())
        assert e.status == 400 and e.info.param == "messages" and "tool_call_id" in e.info.message, e


def test_a_completions_prompt_may_be_a_batch():
    """One text, one token list, or a batch of either (OpenAI's and vLLM's forms); the batch times n is capped."""
    forms = {"hi": ["hi"], ("a", "b"): ["a", "b"], (1, 2): [[1, 2]], ((1, 2), (3,)): [[1, 2], [3]]}
    for prompt, batch in forms.items():
        body = {"model": "m", "prompt": prompt if isinstance(prompt, str) else [list(p) if isinstance(p, tuple)
                                                                                 else p for p in prompt]}
        assert parse_body(json.dumps(body).encode(), CompletionRequest).prompts() == batch
    e = _err(json.dumps({"model": "m", "prompt": ["x"] * 100, "n": 3}).encode(), CompletionRequest)
    assert e.status == 400 and "300" not in e.info.message and "100 prompts x n=3" in e.info.message
    for bad in (["a", [1]], [[1], "a"], [1.5], [[[1]]]):
        assert _err(json.dumps({"model": "m", "prompt": bad}).encode(), CompletionRequest).status == 400


def test_no_field_is_silently_ignored():
    """A field this server does not know is a 400 naming it (a typo or a newer field would change nothing
    and the client would not know); OpenAI's bookkeeping fields, which change no output, are accepted, and
    so are unimplemented parameters at their neutral values."""
    raw = json.dumps({"model": "m", "messages": MSG, "max_tokens": 5, "service_tier": "auto", "store": True,
                      "metadata": {"a": "b"}, "user": "u", "stream_options": None, "reasoning_effort": None}).encode()
    assert parse_body(raw, ChatCompletionRequest).max_new_tokens() == 5
    parse_body(json.dumps({"model": "m", "prompt": "x", "best_of": 1, "logit_bias": None, "tools": []}).encode(),
               CompletionRequest)
    e = _err(json.dumps({"model": "m", "messages": MSG, "temprature": 0.5, "colour": 1}).encode())
    assert e.status == 400 and e.info.param == "colour" and "colour, temprature: unknown request field" in str(e)
    for field, value in (("reasoning_effort", "low"), ("echo", True), ("chat_template", "{{ x }}"),
                         ("spaces_between_special_tokens", False), ("best_of", 2),
                         # a neutral value in another JSON type is not that value (true is not 1, 0 not false)
                         ("best_of", True), ("length_penalty", True), ("use_beam_search", 0), ("echo", 0),
                         ("return_tokens_as_token_ids", 0), ("spaces_between_special_tokens", 1)):
        e = _err(json.dumps({"model": "m", "messages": MSG, field: value}).encode())
        assert e.status == 400 and e.info.param == field and "not supported" in str(e), field
    parse_body(json.dumps({"model": "m", "messages": MSG, "length_penalty": 1, "best_of": 1.0}).encode(),
               ChatCompletionRequest)  # 1 and 1.0 are one JSON number


def test_an_openai_assistant_message_round_trips():
    """``messages.append(response.choices[0].message.model_dump())``: the empty fields an OpenAI assistant message
    carries are accepted; a value in one of them is a 400 naming it; reasoning_content goes to the template."""
    dumped = {"role": "assistant", "content": "Paris", "refusal": None, "annotations": None, "audio": None,
              "function_call": None, "tool_calls": None}
    msgs = [*MSG, dumped, {"role": "user", "content": "And Spain?"}]
    r = parse_body(json.dumps({"model": "m", "messages": msgs}).encode(), ChatCompletionRequest)
    assert r.messages[1].text() == "Paris"
    parse_body(json.dumps({"model": "m", "messages": [*MSG, {**dumped, "annotations": []}]}).encode(),
               ChatCompletionRequest)
    for field, value in (("refusal", "no"), ("annotations", [{"type": "url_citation"}]), ("audio", {"id": "a"}),
                         ("function_call", {"name": "f", "arguments": "{}"})):
        e = _err(json.dumps({"model": "m", "messages": [*MSG, {**dumped, field: value}]}).encode())
        assert e.status == 400 and field in str(e), (field, str(e))
    e = _err(json.dumps({"model": "m", "messages": [{"role": "user", "content": "x", "reasoning_content": "t"}]}
                        ).encode())
    assert e.status == 400 and "only an assistant message" in str(e)
    from conflux_cluster.serve.tools import _template_message

    thought = parse_body(json.dumps({"model": "m", "messages": [*MSG, {**dumped, "reasoning_content": "hm"}]}
                                    ).encode(), ChatCompletionRequest).messages[1]
    assert _template_message(thought)["reasoning_content"] == "hm"


@pytest.mark.parametrize("field,value", [("best_of", 3), ("functions", [{"name": "f"}]), ("guided_regex", "a+"),
                                         ("use_beam_search", True)])
def test_unimplemented_parameters_that_change_the_output_are_400(field, value):
    """Ignoring these would silently give a different answer than the client asked for."""
    e = _err(json.dumps({"model": "m", "messages": MSG, field: value}).encode())
    assert e.status == 400 and e.info.param == field and "not supported" in str(e)


def test_max_completion_tokens_wins_and_stop_list():
    r = parse_body(json.dumps({"model": "m", "messages": MSG, "max_tokens": 5, "max_completion_tokens": 9,
                               "stop": "\n"}).encode(), ChatCompletionRequest)
    assert r.max_new_tokens() == 9 and r.stop_list() == ["\n"]
    for empty in ("", [""], ["", "x"]):  # an empty stop string would match nothing: vLLM's 400, not ignored
        e = _err(json.dumps({"model": "m", "messages": MSG, "stop": empty}).encode())
        assert e.status == 400 and e.info.param == "stop" and "must not be empty" in str(e), empty
    assert parse_body(json.dumps({"model": "m", "messages": MSG, "stop": []}).encode(),
                      ChatCompletionRequest).stop_list() == []


def test_choice_seeds_are_distinct_and_stable():
    assert choice_seed(7, 0, 1) == 7
    seeds = [choice_seed(7, i, 3) for i in range(3)]
    assert len(set(seeds)) == 3 and seeds == [choice_seed(7, i, 3) for i in range(3)]
    assert choice_seed(None, 1, 2) is None


def test_serve_config_yaml_and_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("instances: 2\nranks: 1\nrouter_policy: round_robin\nscheduler:\n  tbt_slo: 0.2\n")
    c = ServeConfig.from_yaml(f, port=1234)
    assert (c.instances, c.ranks, c.router_policy.value, c.scheduler.tbt_slo, c.port) == (2, 1, "round_robin", 0.2, 1234)
    f.write_text("instances: 0\nbogus: 1\n")
    with pytest.raises(ValidationError) as e:
        ServeConfig.from_yaml(f)
    msg = format_validation_error(e.value)
    assert "instances" in msg and "bogus" in msg
    with pytest.raises(ValidationError, match="neither a built-in model"):
        ServeConfig(model="/no/such/model")


def test_a_client_disconnect_is_not_logged_as_a_failure(caplog):
    """Serve's proxy cancels the request's task when the client hangs up: an info line, no traceback."""
    import logging

    from ray.exceptions import TaskCancelledError

    from conflux_cluster.serve.errors import client_error

    with caplog.at_level(logging.INFO, logger="conflux_cluster.serve.errors"):
        e = client_error(TaskCancelledError(), "req-1")
    assert e.status == 499 and e.body()["error"]["type"] == "client_closed_request"
    assert [r.levelno for r in caplog.records] == [logging.INFO] and "disconnected" in caplog.text
    with caplog.at_level(logging.INFO, logger="conflux_cluster.serve.errors"):
        assert client_error(RuntimeError("boom"), "req-2").status == 500  # a real failure still is one
    assert any(r.levelno == logging.ERROR for r in caplog.records)


def test_text_longer_than_any_tokenization_of_the_context_is_refused_before_tokenizing():
    """A prompt of megabytes was tokenized (22 s of CPU) before its length was checked; text of more than
    2 x max_token_bytes x max_model_len bytes cannot fit, whatever its tokens: refused at once, and text just
    under that bound is still tokenized and judged by its real token count."""
    import time

    from conflux_cluster.engine.tokenizer import ByteTokenizer
    from conflux_cluster.serve.handlers import OpenAIServing

    class Counting(ByteTokenizer):
        calls = 0

        def encode(self, text: str) -> list[int]:
            Counting.calls += 1
            return super().encode(text)

    serving = OpenAIServing("m", Counting(), 1000, backend=None, vocab_size=320)
    t0 = time.perf_counter()
    with pytest.raises(APIError) as e:
        serving.prepare(CompletionRequest(model="m", prompt="x" * 3_000_000, max_tokens=1))
    assert e.value.info.code == "context_length_exceeded" and e.value.info.param == "prompt"
    assert Counting.calls == 0 and time.perf_counter() - t0 < 1.0
    with pytest.raises(APIError) as e:  # chat: the messages' text together
        serving.prepare(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "é" * 1001}] * 2))
    assert e.value.info.code == "context_length_exceeded" and e.value.info.param == "messages"
    assert Counting.calls == 0
    with pytest.raises(APIError) as e:  # within the bound: tokenized, then too long by its real count
        serving.prepare(CompletionRequest(model="m", prompt="x" * 1500, max_tokens=1))
    assert e.value.info.code == "context_length_exceeded" and Counting.calls == 1
    assert len(serving.prepare(CompletionRequest(model="m", prompt="x" * 500, max_tokens=1))[0].prompt_token_ids) == 500


def test_tokenize_refuses_text_longer_than_any_tokenization_of_the_context_before_tokenizing():
    """``/tokenize`` of a multi-MiB prompt tokenized it all (seconds of CPU in the ingress) where a completion with
    the same prompt is refused at once: the same bound applies (its chat form already took the completion's
    path); text within it is tokenized and counted, even past the context (the count is what a client asks)."""
    from conflux_cluster.engine.tokenizer import ByteTokenizer
    from conflux_cluster.serve.handlers import OpenAIServing
    from conflux_cluster.serve.tokenize_endpoints import tokenize

    class Counting(ByteTokenizer):
        calls = 0

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            Counting.calls += 1
            return super().encode(text, add_special_tokens)

    serving = OpenAIServing("m", Counting(), 1000, backend=None, vocab_size=320)
    for extra in ({}, {"add_special_tokens": False}):
        with pytest.raises(APIError) as e:
            tokenize(serving, json.dumps({"prompt": "x" * 3_000_000, **extra}).encode())
        assert e.value.status == 400 and e.value.info.code == "context_length_exceeded", e.value.info
        assert e.value.info.param == "prompt" and Counting.calls == 0
    assert tokenize(serving, json.dumps({"prompt": "x" * 1500}).encode())["count"] >= 1500


def test_a_body_that_stalls_gets_408_and_one_that_arrives_is_read():
    """Headers, then a body that stops arriving (a stalled or hostile client held a connection > 100 s): 408
    ``body_timeout`` after ``body_timeout_s``; a body in several chunks within it is read whole."""
    import asyncio
    import time

    from starlette.requests import Request

    from conflux_cluster.serve.ingress import read_body

    def request(chunks: list[bytes], stall: bool) -> Request:
        msgs = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]

        async def receive() -> dict:
            if msgs:
                return msgs.pop(0)
            if stall:
                await asyncio.sleep(3600)
            return {"type": "http.request", "body": b"", "more_body": False}

        return Request({"type": "http", "method": "POST", "headers": [(b"content-length", b"1000")]}, receive)

    t0 = time.perf_counter()
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(request([b"{\"model\":"], stall=True), 4096, timeout_s=0.2))
    assert e.value.status == 408 and e.value.info.code == "body_timeout" and time.perf_counter() - t0 < 5
    assert asyncio.run(read_body(request([b"ab", b"cd"], stall=False), 4096, timeout_s=5)) == b"abcd"
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(request([b"x" * 3000, b"x" * 3000], stall=False), 4096, timeout_s=5))
    assert e.value.status == 413
    assert ServeConfig().body_timeout_s == 60


def test_reject_unattainable_travels_from_the_body_to_the_engine_params():
    """ConfluxServe's extension: a request asks to be refused at once (503 slo_unattainable) rather than served
    after its TTFT SLO; the engine reads it from the request's SamplingParams (Scheduler.add(reject=...))."""
    from conflux_cluster.engine.tokenizer import ByteTokenizer
    from conflux_cluster.serve.handlers import OpenAIServing

    serving = OpenAIServing("m", ByteTokenizer(), 1000, backend=None, vocab_size=320)
    asks = serving.prepare(CompletionRequest(model="m", prompt="hi", max_tokens=1, reject_unattainable=True))
    plain = serving.prepare(CompletionRequest(model="m", prompt="hi", max_tokens=1))
    assert asks[0].params.reject_unattainable and not plain[0].params.reject_unattainable
    with pytest.raises(ValidationError):  # a JSON boolean, as OpenAI's own flags
        CompletionRequest(model="m", prompt="hi", reject_unattainable="yes")


@pytest.mark.parametrize("key", ["add_generation_prompt", "continue_final_message", "tools", "chat_template",
                                 "tokenize", "return_dict", "truncation", "max_length", "conversation"])
def test_chat_template_kwargs_cannot_carry_the_templates_own_arguments(key):
    """``chat_template_kwargs`` are template variables. A key the server sets itself (the request's own fields,
    ``--chat-template``) or one of the tokenizer's arguments was dropped unseen (``{"add_generation_prompt":
    false}`` left the assistant turn open as if it had not been sent): a 400 naming the field."""
    body = {"model": "m", "messages": MSG, "chat_template_kwargs": {"enable_thinking": False, key: False}}
    e = _err(json.dumps(body).encode())
    assert e.status == 400 and e.info.param == "chat_template_kwargs" and key in e.info.message, e
    ok = parse_body(json.dumps({**body, "chat_template_kwargs": {"enable_thinking": False}}).encode(),
                    ChatCompletionRequest)
    assert ok.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("kind", ["text", "json_object"])
def test_a_json_schema_is_only_read_with_type_json_schema(kind):
    """``response_format: {"type": "text" | "json_object", "json_schema": {...}}`` generated free text or any
    object: the schema the client sent was dropped unseen. A 400 naming response_format."""
    fmt = {"type": kind, "json_schema": {"name": "x", "schema": {"type": "object", "required": ["a"]}}}
    for cls, base in ((ChatCompletionRequest, {"messages": MSG}), (CompletionRequest, {"prompt": "hi"})):
        e = _err(json.dumps({"model": "m", **base, "response_format": fmt}).encode(), cls)
        assert e.status == 400 and e.info.param == "response_format" and "json_schema" in e.info.message, e
    ok = parse_body(json.dumps({"model": "m", "messages": MSG, "response_format": {"type": kind,
                                                                                   "json_schema": None}}).encode(),
                    ChatCompletionRequest)
    assert ok.response_format.type == kind


@pytest.mark.parametrize("key", [" 5", "5 ", "+5", "05", "5_0", "\u0665", "５"])
def test_logit_bias_keys_are_decimal_token_ids(key):
    """Python's ``int`` read " 5", "+5" and "05" as token 5, "5_0" as 50 and Arabic-Indic or full-width digits
    as numbers, so ``{"5": 100, "05": -100}`` was one token whose first bias was dropped unseen. A key is a
    token id written as OpenAI writes it (ASCII digits, no sign, space or leading zero): anything else is a
    400 naming logit_bias, with the key."""
    e = _err(json.dumps({"model": "m", "prompt": "x", "logit_bias": {"5": 1, key: -1}}).encode(), CompletionRequest)
    assert e.status == 400 and e.info.param == "logit_bias" and repr(key) in e.info.message, e
    ok = parse_body(json.dumps({"model": "m", "prompt": "x", "logit_bias": {"0": 1, "50256": -1}}).encode(),
                    CompletionRequest)
    assert ok.logit_bias_ids() == {0: 1.0, 50256: -1.0}


@pytest.mark.parametrize("tool", [
    {"type": "function", "function": {"name": "f", "parmeters": {"type": "object", "required": ["city"]}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}, "strict": True},
])
def test_a_tool_definition_with_an_unknown_key_is_400(tool):
    """A typo in a tool's definition (``parmeters``) was dropped unseen: the model was told the tool takes no
    arguments, and ``tool_choice: "required"`` forced calls with none. OpenAI refuses additional properties in
    ``tools[].function``; so does this server, naming tools."""
    body = {"model": "m", "messages": MSG, "tools": [tool], "tool_choice": "required"}
    e = _err(json.dumps(body).encode())
    assert e.status == 400 and e.info.param == "tools", e
    assert ("parmeters" if "parmeters" in tool["function"] else "strict") in e.info.message
    ok = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"},
                                           "strict": True}}
    assert parse_body(json.dumps({**body, "tools": [ok]}).encode(), ChatCompletionRequest).tools[0].function.strict


@pytest.mark.parametrize("options", [{"continuous_usage_stats": True},
                                     {"include_usage": False, "continuous_usage_stats": True}])
def test_continuous_usage_stats_needs_include_usage(options):
    """``continuous_usage_stats`` puts the usage in every chunk of a stream that carries usage
    (``include_usage``); without it no chunk carried any, and the option was dropped unseen (vLLM reads it only
    with include_usage too). A 400 naming stream_options, as ``top_logprobs`` without ``logprobs``."""
    for cls, base in ((ChatCompletionRequest, {"messages": MSG}), (CompletionRequest, {"prompt": "hi"})):
        e = _err(json.dumps({"model": "m", **base, "stream": True, "stream_options": options}).encode(), cls)
        assert e.status == 400 and e.info.param == "stream_options" and "include_usage" in e.info.message, e
    both = {"include_usage": True, "continuous_usage_stats": True}
    ok = parse_body(json.dumps({"model": "m", "messages": MSG, "stream": True, "stream_options": both}).encode(),
                    ChatCompletionRequest)
    assert ok.usage_every_chunk()
    for fine in ({"include_usage": True}, {"continuous_usage_stats": False}, {"continuous_usage_stats": None}):
        parse_body(json.dumps({"model": "m", "messages": MSG, "stream": True, "stream_options": fine}).encode(),
                   ChatCompletionRequest)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_output_budget_errors_name_the_field_the_client_sent(field):
    """A chat request's budget is ``max_completion_tokens`` (OpenAI's name) or ``max_tokens`` (the legacy one);
    over the server's ``max_tokens_limit`` or the context, the 400 named ``max_tokens`` even when the client
    sent only ``max_completion_tokens``. It names the field sent (the prompt, when the prompt alone fills it)."""
    from conflux_cluster.engine.tokenizer import ByteTokenizer
    from conflux_cluster.serve.handlers import OpenAIServing

    capped = OpenAIServing("m", ByteTokenizer(), 256, backend=None, vocab_size=320, max_tokens_limit=100)
    uncapped = OpenAIServing("m", ByteTokenizer(), 256, backend=None, vocab_size=320)
    for serving, value, code in ((capped, 101, "max_tokens_exceeded"), (uncapped, 300, "context_length_exceeded")):
        with pytest.raises(APIError) as e:
            serving.prepare(ChatCompletionRequest(model="m", messages=MSG, **{field: value}))
        assert e.value.status == 400 and (e.value.info.param, e.value.info.code) == (field, code), e.value.info
        if code == "max_tokens_exceeded":
            assert e.value.info.message.startswith(f"{field}: "), e.value.info.message
    with pytest.raises(APIError) as e:  # the prompt alone fills the context: the prompt is what to change
        uncapped.prepare(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x" * 300}],
                                               **{field: 5}))
    assert (e.value.info.param, e.value.info.code) == ("messages", "context_length_exceeded"), e.value.info
    with pytest.raises(APIError) as e:  # both given: max_completion_tokens is the budget, and the field named
        capped.prepare(ChatCompletionRequest(model="m", messages=MSG, max_tokens=5, max_completion_tokens=101))
    assert e.value.info.param == "max_completion_tokens", e.value.info


def test_best_of_is_n_or_refused():
    """``best_of`` generates that many candidates and returns the ``n`` best: this server generates exactly ``n``, so
    only ``best_of == n`` (or unset) changes nothing. ``best_of: 1`` with ``n: 2`` was accepted as neutral although
    OpenAI and vLLM refuse ``best_of < n`` (400); ``best_of: 2`` with ``n: 2``, which asks nothing more, was refused."""
    body = {"model": "m", "prompt": "hi"}
    for n, best_of in ((2, 1), (3, 2)):
        e = _err(json.dumps({**body, "n": n, "best_of": best_of}).encode(), CompletionRequest)
        assert e.status == 400 and e.info.param == "best_of" and "less than n" in e.info.message, e
    e = _err(json.dumps({**body, "n": 2, "best_of": 3}).encode(), CompletionRequest)
    assert e.status == 400 and e.info.param == "best_of" and "not supported" in e.info.message, e
    for n, best_of in ((1, 1), (2, 2), (3, None)):
        assert parse_body(json.dumps({**body, "n": n, "best_of": best_of}).encode(), CompletionRequest).n == n


def test_stream_options_include_obfuscation_false_is_what_this_server_does():
    """OpenAI's ``stream_options.include_obfuscation`` pads stream events with random characters (on by default
    there); its docs suggest ``false`` to save bandwidth. This server sends no padding, so ``false`` asks for what
    it does: it was a 400 (unknown key). ``true`` asks for padding it does not send: still a 400, naming it."""
    for cls, base in ((ChatCompletionRequest, {"messages": MSG}), (CompletionRequest, {"prompt": "hi"})):
        for value in (False, None):
            opts = {"include_usage": True, "include_obfuscation": value}
            assert parse_body(json.dumps({"model": "m", **base, "stream": True, "stream_options": opts}).encode(),
                              cls).stream_options.include_usage
        e = _err(json.dumps({"model": "m", **base, "stream": True,
                             "stream_options": {"include_obfuscation": True}}).encode(), cls)
        assert e.status == 400 and e.info.param == "stream_options" and "include_obfuscation" in e.info.message, e
        e = _err(json.dumps({"model": "m", **base, "stream": True, "stream_options": {"obfuscate": False}}).encode(),
                 cls)
        assert e.status == 400 and e.info.param == "stream_options" and "obfuscate" in e.info.message, e


@pytest.mark.parametrize("prompt", [[1.5], [True], ["a", 1], [1, "a"], [[1], "a"], [[[1]]], [[1, None]], {"a": 1}, 5,
                                    [1e300]])
def test_a_prompt_of_no_accepted_form_gets_one_clear_message(prompt):
    """A prompt that is none of text, texts, token ids or token-id lists was answered with pydantic's error for each
    form of the union, naming this module's validator: ``prompt.list[function-before[_json_number(), int]].0: ...``.
    One sentence says which forms a prompt takes (param prompt)."""
    raw = json.dumps({"model": "m", "prompt": prompt}).encode()  # 1e999 is invalid JSON (out of range)
    e = _err(raw, CompletionRequest)
    assert e.status == 400 and e.info.param == "prompt", e
    assert "function-before" not in e.info.message and "list[" not in e.info.message, e.info.message
    assert "token ids" in e.info.message, e.info.message
    for fine in ("x", ["x", "y"], [1, 2.0], [[1], [2, 3]]):
        assert parse_body(json.dumps({"model": "m", "prompt": fine}).encode(), CompletionRequest).prompts()


def test_stop_token_ids_reach_the_engine_once_each():
    """The engine looks up every sampled token in the request's ``stop_token_ids`` list, on the engine thread every
    request of the instance waits for, and sends the list to every rank. A 4 MiB body holds ~500,000 ids (7.8 ms a
    lookup on the CI machine, at every token): the ids repeated change nothing but that cost. Each id reaches the
    engine once, so the list is at most the vocabulary (every id in it is checked to be in the vocabulary)."""
    from conflux_cluster.engine.tokenizer import ByteTokenizer
    from conflux_cluster.serve.handlers import OpenAIServing

    serving = OpenAIServing("m", ByteTokenizer(), 256, backend=None, vocab_size=320)
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "stop_token_ids": [7, 300, 5] * 100_000}
    (request,) = serving.prepare(parse_body(json.dumps(body).encode(), CompletionRequest))
    assert sorted(request.params.stop_token_ids) == [5, 7, 300]


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "f"}}])
def test_a_content_part_other_than_text_gets_one_clear_message(part):
    """A client sending an image or audio part to this text server got pydantic's error for each form of the content
    union (``messages.0.content.list[ContentPart].0.type: Input should be 'text'; ...``); one sentence now names the
    part's type and what is read (param messages)."""
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]}
    e = _err(json.dumps(body).encode())
    assert e.status == 400 and e.info.param == "messages", e
    assert f'content[1]: content parts of type "{part["type"]}" are not supported' in e.info.message, e.info.message
    assert "list[ContentPart]" not in e.info.message
