"""Tool calls in generated text, parsed as the text streams: one parser per model family's format.

    hermes       (Qwen, Hermes, and the default)   text <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    llama3_json  (Llama 3.x JSON tool calls)        {"name": "f", "parameters": {...}}; {"name": "g", ...}

``ToolCallParser.feed(text)`` returns events: ``Content`` (text for ``message.content``), ``CallStart``
(a call's name is known) and ``CallArguments`` (the next fragment of its arguments' JSON text, as the
model wrote it). A whole response is the same parser fed once (``parse``), so streamed fragments always
reassemble to the non-streamed ``arguments``. A call whose name is not one of the request's tools, or
whose JSON is not a call, stays content. Llama's format is a call only when the output starts with
``{``: anything else is content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum

_WS = " \t\r\n"


class ToolFormat(str, Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    fragment: str


Event = Content | CallStart | CallArguments


@dataclass(frozen=True)
class _Frame:
    """Where calls sit in the text of one format."""

    open: str  # marker before a call ("" : a call starts with "{" where one may start)
    close: str  # marker after it ("" : the call's JSON object ends it)
    arg_keys: tuple[str, ...]  # the key of the arguments object
    separator: str  # between calls (llama: "; ")


FRAMES = {ToolFormat.HERMES: _Frame("<tool_call>", "</tool_call>", ("arguments", "parameters"), "\n"),
          ToolFormat.LLAMA3_JSON: _Frame("", "", ("parameters", "arguments"), "; ")}


@dataclass
class _Scan:
    """What is known of a call's JSON body so far."""

    name: str | None = None
    args: tuple[int, int | None] | None = None  # [start, end) of the arguments' text (end None: open)
    end: int | None = None  # index after the object's closing brace
    invalid: bool = False


def scan_call(body: str, arg_keys: tuple[str, ...]) -> _Scan:
    """Read ``{"name": ..., "arguments": ...}`` as far as ``body`` goes (it may stop anywhere)."""
    out, i = _Scan(), _skip(body, 0)
    if i == len(body):
        return out
    if body[i] != "{":
        return _Scan(invalid=True)
    i += 1
    while True:
        i = _skip(body, i)
        if i == len(body):
            return out
        if body[i] == "}":
            out.end = i + 1
            return out
        if body[i] == ",":
            i += 1
            continue
        key_end = _value_end(body, i)
        if body[i] != '"' or key_end is None:
            out.invalid = body[i] != '"'
            return out
        key = _string(body[i:key_end])
        if key is None:
            return _Scan(invalid=True)
        i = _skip(body, key_end)
        if i == len(body):
            return out
        if body[i] != ":":
            return _Scan(invalid=True)
        start = _skip(body, i + 1)
        end = _value_end(body, start) if start < len(body) else None
        if key in arg_keys and out.args is None:
            out.args = (start, end)
        if key == "name" and end is not None:
            value = _string(body[start:end]) if body[start] == '"' else None
            if value is None:
                return _Scan(invalid=True)
            out.name = value
        if end is None:
            return out
        i = end


def _string(literal: str) -> str | None:
    """A JSON string literal's value; None when JSON does not allow it (``"\\q"``, a raw control character):
    the model wrote it, so it is text, not a call."""
    try:
        return json.loads(literal)
    except json.JSONDecodeError:
        return None


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _value_end(s: str, i: int) -> int | None:
    """End of the JSON value starting at ``s[i]``, or None if ``s`` stops before it ends."""
    if i >= len(s):
        return None
    if s[i] == '"':
        j = i + 1
        while j < len(s):
            if s[j] == "\\":
                j += 2
                continue
            if s[j] == '"':
                return j + 1
            j += 1
        return None
    if s[i] in "{[":
        depth, j, in_str = 0, i, False
        while j < len(s):
            c = s[j]
            if in_str:
                if c == "\\":
                    j += 1
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(s) else None  # a number may go on


class _State(Enum):
    TEXT = "text"  # outside a call
    CALL = "call"  # inside a call's JSON
    CLOSING = "closing"  # a call's JSON ended; its closing marker may follow


@dataclass
class ToolCallParser:
    """Splits one choice's streamed text into content and tool calls (module docstring)."""

    format: ToolFormat
    tool_names: frozenset[str]
    max_calls: int | None = None  # parallel_tool_calls=false: 1 (later calls are dropped)
    calls: int = 0  # calls started so far
    _frame: _Frame = field(init=False)
    _state: _State = _State.TEXT
    _buf: str = ""  # text not handed out yet (a possible marker's start, or the current call's body)
    _started: bool = False  # the current call's CallStart was sent
    _dropped: bool = False  # the current call is past max_calls: nothing of it is sent
    _sent: int = 0  # characters of the current call's arguments sent
    _prose: bool = False  # llama: the output is text, not calls

    def __post_init__(self) -> None:
        self._frame = FRAMES[self.format]

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        """The rest at the end of the output (an unfinished call keeps what was sent)."""
        return self._run(final=True)

    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            before = (self._state, self._buf, len(events))
            step = {_State.TEXT: self._text, _State.CALL: self._call, _State.CLOSING: self._closing}[self._state]
            step(events, final)
            if (self._state, self._buf, len(events)) == before:
                return _merged(events)

    # ---- outside a call ----------------------------------------------------------------------

    def _text(self, events: list[Event], final: bool) -> None:
        f, buf = self._frame, self._buf
        if not f.open:  # llama: calls only at the start of the output, one after another
            rest = buf.lstrip(_WS + ";") if self.calls else buf.lstrip(_WS)
            if self._prose or (rest and not rest.startswith("{")):
                self._prose = True
                _content(events, buf)
                self._buf = ""
            elif rest:
                self._buf, self._state = rest, _State.CALL
            elif final:
                self._buf = ""  # whitespace (and separators) after the last call
            return
        at = buf.find(f.open)
        if at >= 0:
            _content(events, buf[:at])
            self._buf, self._state = buf[at + len(f.open):], _State.CALL
            return
        keep = 0 if final else _partial_suffix(buf, f.open)
        _content(events, buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]

    # ---- inside a call -----------------------------------------------------------------------

    def _call(self, events: list[Event], final: bool) -> None:
        body = self._buf
        scan = scan_call(body, self._frame.arg_keys)
        if not self._started and not self._dropped:
            if scan.invalid or (scan.name is not None and scan.name not in self.tool_names) or (
                    scan.end is not None and scan.name is None):
                return self._not_a_call(events)
            if scan.name is None or (scan.args is None and scan.end is None):
                if final:
                    self._not_a_call(events)
                return
            if self.max_calls is not None and self.calls >= self.max_calls:
                self._dropped = True
            else:
                self._started = True
                self.calls += 1
                events.append(CallStart(self.calls - 1, scan.name))
        if self._started and scan.args is not None:
            self._send_arguments(events, body, scan.args, final)
        if scan.end is not None:
            if self._started and scan.args is None:
                events.append(CallArguments(self.calls - 1, "{}"))
            self._buf = body[scan.end:]
            self._state = _State.CLOSING if self._frame.close else _State.TEXT
            self._started = self._dropped = False
            self._sent = 0
        elif final:  # cut off (max_tokens): the call keeps what was sent
            self._buf, self._state = "", _State.TEXT

    def _send_arguments(self, events: list[Event], body: str, span: tuple[int, int | None], final: bool) -> None:
        start, end = span
        if end is None and not final and start < len(body) and body[start] not in '{["':
            return  # a bare scalar still being written: sent once complete
        stop = len(body) if end is None else end
        if stop - start > self._sent:
            events.append(CallArguments(self.calls - 1, body[start + self._sent:stop]))
            self._sent = stop - start

    def _closing(self, events: list[Event], final: bool) -> None:
        close, rest = self._frame.close, self._buf.lstrip(_WS)
        if rest.startswith(close):
            self._buf, self._state = rest[len(close):], _State.TEXT
        elif final or not close.startswith(rest):  # no closing marker after all: the rest is text
            self._buf, self._state = rest, _State.TEXT

    def _not_a_call(self, events: list[Event]) -> None:
        """The current 'call' is text after all: hand it out as content."""
        events.append(Content(self._frame.open + self._buf))
        self._buf, self._state = "", _State.TEXT
        self._prose = not self._frame.open


def parse(fmt: ToolFormat, tool_names: frozenset[str], text: str, max_calls: int | None = None
          ) -> tuple[str, list[tuple[str, str]]]:
    """A whole output -> (content, [(name, arguments JSON text)])."""
    parser = ToolCallParser(fmt, tool_names, max_calls)
    content, calls = "", []
    for e in parser.feed(text) + parser.finish():
        if isinstance(e, Content):
            content += e.text
        elif isinstance(e, CallStart):
            calls.append((e.name, ""))
        else:
            name, args = calls[e.index]
            calls[e.index] = (name, args + e.fragment)
    return content, calls


def _content(events: list[Event], text: str) -> None:
    if text:
        events.append(Content(text))


def _scalar_open(body: str, start: int) -> bool:
    """True if the arguments value is a bare scalar still being written (only an object/array/string
    may be streamed in pieces safely; a scalar is sent once complete)."""
    return start < len(body) and body[start] not in '{["'


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (to hold back until it is decided)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent content pieces joined."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, Content) and out and isinstance(out[-1], Content):
            out[-1] = Content(out[-1].text + e.text)
        elif not (isinstance(e, Content) and not e.text):
            out.append(e)
    return out
