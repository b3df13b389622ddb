"""Tool-call parsers of both families, on whole texts and on the same texts streamed in random pieces:
the pieces must reassemble to exactly the whole parse (content and every call's arguments text); a
stream holds whitespace-only content back and drops it when the response is tool calls."""

from __future__ import annotations

import json
import random

import pytest

from conflux_cluster.serve.tool_parsers import CallArguments, CallStart, Content, ToolCallParser, ToolFormat, parse
from conflux_cluster.serve.tools import tool_format

NAMES = frozenset({"get_weather", "f"})
H, L = ToolFormat.HERMES, ToolFormat.LLAMA3_JSON

CASES = [  # (format, text, content, [(name, arguments)])
    (H, 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}\\""}]}}\n'
        '</tool_call>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
     "Sure.\n", [("get_weather", '{"city": "Paris", "n": [1, {"a": "}\\""}]}'), ("f", "{}")]),
    (H, "no calls here <tool", "no calls here <tool", []),
    (H, '<tool_call>{"name": "nope", "arguments": {}}</tool_call> tail',  # not a tool of the request: text
     '<tool_call>{"name": "nope", "arguments": {}}</tool_call> tail', []),
    (H, '<tool_call>\n{"name": "f", "arguments": {"x": 1', "", [("f", '{"x": 1')]),  # cut off by max_tokens
    (H, '<tool_call>\n{"arguments": {"q": "a"}, "name": "f"}\n</tool_call>', "", [("f", '{"q": "a"}')]),
    (L, '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {"k": 2}}',
     "", [("get_weather", '{"city": "Paris"}'), ("f", '{"k": 2}')]),
    (L, 'Hello {"name": "f"}', 'Hello {"name": "f"}', []),  # a Llama call starts the output, or there is none
    (L, '  {"name": "f"}', "", [("f", "{}")]),
    (L, '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),  # JSON that is not a call is content
    # a key or name JSON does not allow (bad escape, raw control character) is text too, not a parser error
    (H, '<tool_call>\n{"name": "f\\q", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "f\\q", "arguments": {}}\n</tool_call>', []),
    (H, '<tool_call>\n{"name": "f", "argu\nments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "f", "argu\nments": {}}\n</tool_call>', []),
    (L, '{"na\\qme": "f", "parameters": {}}', '{"na\\qme": "f", "parameters": {}}', []),
]


def _streamed(fmt: ToolFormat, text: str, rng: random.Random, max_calls: int | None = None):
    parser, events, i = ToolCallParser(fmt, NAMES, max_calls), [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        events += parser.feed(text[i:i + k])
        i += k
    events += parser.finish()
    content, calls = "", []
    for e in events:
        if isinstance(e, Content):
            content += e.text
        elif isinstance(e, CallStart):
            assert e.index == len(calls)  # calls are numbered in order, each started once
            calls.append((e.name, ""))
        else:
            assert isinstance(e, CallArguments) and e.index == len(calls) - 1
            calls[e.index] = (calls[e.index][0], calls[e.index][1] + e.fragment)
    return content, calls


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_whole_and_streamed_parse_agree(fmt, text, content, calls):
    assert parse(fmt, NAMES, text) == (content, calls)
    rng = random.Random(0)
    for _ in range(100):
        assert _streamed(fmt, text, rng) == (content, calls)
    for _, args in calls:
        if not args.endswith("1"):  # the cut-off case is not JSON yet
            json.loads(args)


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    fmt, text, _, calls = CASES[0]
    assert parse(fmt, NAMES, text, max_calls=1) == ("Sure.\n", calls[:1])
    assert _streamed(fmt, text, random.Random(1), max_calls=1) == ("Sure.\n", calls[:1])


def test_the_format_follows_the_chat_template():
    assert tool_format("{% if tools %}<tool_call>{% endif %}") is H  # Qwen / Hermes
    assert tool_format("<|start_header_id|>ipython<|end_header_id|>") is L  # Llama 3.x
    assert tool_format(None) is H and tool_format("{{ message['content'] }}") is H  # the default


def _stream_pieces(pieces: list[str]) -> list[tuple[str | None, list]]:
    from conflux_cluster.serve.tools import ToolCallStream

    s = ToolCallStream(ToolCallParser(H, NAMES))
    return [s.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]


CALL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


def test_streamed_whitespace_around_calls_is_not_content():
    out = _stream_pieces(["\n", " \n", CALL, "\n", "\n", CALL, "\n", ""])
    assert [c for c, _ in out] == [None] * len(out)
    assert sum(len(d) for _, d in out) == 4  # each call's start and its arguments


def test_held_whitespace_goes_out_before_later_text():
    out = _stream_pieces(["Sure.", "\n", CALL, "\n ", "Done.", ""])
    assert [c for c, _ in out] == ["Sure.", None, None, None, "\n\n Done.", None]
    out = _stream_pieces(["Hi", "\n", "\n", "there", "\n"])  # no calls: every character is content
    assert "".join(c or "" for c, _ in out) == "Hi\n\nthere\n" and out[1][0] is None
    assert _stream_pieces(["\n", " "]) == [(None, []), ("\n ", [])]  # a whitespace-only answer is kept
