"""Reasoning parsers: split a thinking model's output into ``reasoning_content`` and ``content``.

Models of the ``<think> ... </think>`` family write their thinking between the two tags, then the
answer. The parsers differ in where the output starts (vLLM's parsers of the same names)::

    deepseek_r1:  [<think>] reasoning ... </think> content     the template opens <think> in the prompt,
                                                               so output without </think> is all reasoning
    qwen3:        <think> reasoning ... </think> content       output that does not open with <think> is
                                                               all content (enable_thinking: false)

``ReasoningStream`` does the same split on streamed text: a tag split over deltas is held back
until it is known to be one (or not), so the concatenated deltas always equal the whole split.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

START, END = "<think>", "</think>"


class ReasoningParser(str, enum.Enum):
    """``--reasoning-parser``: how the output of a thinking model is split."""

    DEEPSEEK_R1 = "deepseek_r1"
    QWEN3 = "qwen3"

    def starts_in_reasoning(self) -> bool:
        """True when the output is reasoning before any tag (the prompt opened ``<think>``)."""
        return self is ReasoningParser.DEEPSEEK_R1


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: no reasoning text (yet)
    content: str | None  # None: no answer text (yet)


def split_reasoning(parser: ReasoningParser, text: str) -> Split:
    """The whole output's split."""
    stream = ReasoningStream(parser)
    first, last = stream.feed(text), stream.finish()
    return Split(_join(first.reasoning, last.reasoning), _join(first.content, last.content))


def _join(a: str | None, b: str | None) -> str | None:
    return None if a is None and b is None else (a or "") + (b or "")


class _State(enum.Enum):
    START = "start"  # nothing seen yet: the output may open with <think>
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningStream:
    """The split of text that arrives in pieces (one per choice of a streamed response)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.state = _State.START
        self.pending = ""  # text held back: it may be the start of a tag

    def feed(self, text: str) -> Split:
        """The reasoning and content that ``text`` (with what was held back) adds."""
        reasoning, content = [], []
        buf, self.pending = self.pending + text, ""
        while buf:
            if self.state is _State.START:
                stripped = buf.lstrip()
                if stripped.startswith(START):
                    buf, self.state = stripped[len(START):], _State.REASONING
                elif START.startswith(stripped):  # "", "<", "<th" ...: not known yet
                    self.pending = buf
                    break
                else:
                    self.state = _State.REASONING if self.parser.starts_in_reasoning() else _State.CONTENT
            elif self.state is _State.REASONING:
                at = buf.find(END)
                if at >= 0:
                    reasoning.append(buf[:at])
                    buf, self.state = buf[at + len(END):], _State.CONTENT
                    continue
                keep = _partial_tag(buf, END)
                reasoning.append(buf[:len(buf) - keep])
                self.pending, buf = buf[len(buf) - keep:], ""
            else:
                content.append(buf)
                buf = ""
        return Split("".join(reasoning) if reasoning else None, "".join(content) if content else None)

    def finish(self) -> Split:
        """The output ended: what was held back is text after all."""
        held, self.pending = self.pending, ""
        if not held:
            return Split(None, None)
        if self.state is _State.REASONING or (self.state is _State.START and self.parser.starts_in_reasoning()):
            return Split(held, None)
        return Split(None, held)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
