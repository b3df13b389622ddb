"""Reasoning parsers: the split of the whole output, and the same split however the text is streamed."""

from __future__ import annotations

import pytest

from conflux_cluster.serve.reasoning import ReasoningParser, ReasoningStream, Split, split_reasoning

R1, QWEN3 = ReasoningParser.DEEPSEEK_R1, ReasoningParser.QWEN3


@pytest.mark.parametrize("parser, text, want", [
    (R1, "I think.</think>The answer.", Split("I think.", "The answer.")),
    (R1, "<think>I think.</think>The answer.", Split("I think.", "The answer.")),
    (R1, "still thinking", Split("still thinking", None)),
    (QWEN3, "<think>\nhm\n</think>\n\nParis.", Split("\nhm\n", "\n\nParis.")),
    (QWEN3, "Paris.", Split(None, "Paris.")),  # thinking off: no tags, all content
    (QWEN3, "<thi", Split(None, "<thi")),  # a partial tag at the end is text after all
    (R1, "a < b </thin", Split("a < b </thin", None)),
])
def test_split_of_the_whole_output(parser, text, want):
    assert split_reasoning(parser, text) == want


@pytest.mark.parametrize("parser", list(ReasoningParser))
@pytest.mark.parametrize("text", ["<think>one two</think>three", "x</think>y", "<think>no end", "plain </th", "",
                                  "  <think>\n a</think>\n\nb<think>c"])
def test_streamed_pieces_add_up_to_the_whole_split(parser, text):
    whole = split_reasoning(parser, text)
    for size in (1, 2, 3, 7):
        stream = ReasoningStream(parser)
        parts = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)] + [stream.finish()]
        reasoning = "".join(p.reasoning or "" for p in parts)
        content = "".join(p.content or "" for p in parts)
        assert reasoning == (whole.reasoning or "") and content == (whole.content or ""), size
