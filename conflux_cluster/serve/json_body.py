"""A request body's bytes -> its JSON value, for every POST route and the Serve handle's dicts: the checks
that come before any field is read. Arrays and objects nest at most ``MAX_JSON_DEPTH`` deep (an HTTP body
is scanned before it is parsed, a handle's dict walked), the text is strictly UTF-8 (or UTF-16/32), JSON has
no ``NaN`` (nor numbers past a double's range), and no string holds a lone UTF-16 surrogate. Every refusal is a 400 ``invalid_json``."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from .errors import APIError, bad_request

MAX_JSON_DEPTH = 64  # deepest nesting of arrays/objects a request body may have (the API needs 4)

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_INNERMOST = re.compile(rb"\[\]|\{\}")
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \ud800-\udfff: half of a UTF-16 pair


def json_deeper_than(raw: bytes, limit: int) -> bool:
    """True if arrays/objects in ``raw`` nest deeper than ``limit`` (brackets inside strings do not count).
    No recursion and no Python loop per byte: strings are cut out and the brackets left are peeled one
    level per pass (innermost ``[]``/``{}`` pairs removed), at most ``limit`` passes over C-speed regexes."""
    skeleton = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        skeleton, peeled = _INNERMOST.subn(b"", skeleton)
        if not skeleton or not peeled:  # within the limit, or not JSON (json.loads says where)
            return False
    return _INNERMOST.search(skeleton) is not None


def nested_deeper_than(data: object, limit: int) -> bool:
    """True if dicts and lists in ``data`` (a Serve handle caller's body: no JSON text to scan) nest deeper than
    ``limit``, counted as ``json_deeper_than`` counts an HTTP body's; a cycle nests without end. Level by level,
    each object once per level, so neither a cycle nor shared sub-objects make it recurse or blow up."""
    level = [data]
    for _ in range(limit + 1):
        inner: dict[int, object] = {}
        for x in level:
            children = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()
            inner.update((id(c), c) for c in children if isinstance(c, (dict, list, tuple)))
        if not inner:
            return False
        level = list(inner.values())
    return True


def too_deep(max_depth: int) -> APIError:
    return bad_request(f"request body nests arrays/objects deeper than {max_depth} levels", code="invalid_json")


def read_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of a request body (every POST route's), or an APIError(400, ``invalid_json``). Arrays and
    objects nest at most ``max_depth`` deep (checked before parsing). The body is UTF-8 (UTF-16 and UTF-32 too,
    as ``json.loads`` detects them; a BOM is skipped), decoded strictly: ``json.loads`` alone decodes bytes
    with ``surrogatepass``, which turns bytes spelling half of a UTF-16 pair (``ED A0 80``, or an unpaired one
    in a UTF-16 body) into a lone surrogate that no escape in the body shows and no tokenizer can encode."""
    if json_deeper_than(raw, max_depth):
        raise too_deep(max_depth)
    try:
        text = raw.decode(json.detect_encoding(raw))
    except UnicodeDecodeError as e:
        name = e.encoding.upper().removesuffix("-SIG")
        raise bad_request(f"request body is not valid {name} text ({e.reason} at byte {e.start})",
                          code="invalid_json") from None
    try:
        return json.loads(text, parse_constant=_not_json, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    except ValueError:  # valid JSON that Python will not read, e.g. an integer of more than 4,300 digits
        raise bad_request("request body holds a number too long to read", code="invalid_json") from None
    except RecursionError:  # not reached after the depth check; kept so no body can make a 500
        raise bad_request("request body nests too deeply", code="invalid_json") from None


def _finite_float(literal: str) -> float:
    """A JSON number past a double's range (``1e400``) reads as infinity in Python, the ``Infinity`` that
    ``_not_json`` refuses by name; so it is refused too, as other JSON parsers refuse it ("out of range")."""
    value = float(literal)
    if math.isinf(value):
        raise bad_request(f"request body is not valid JSON: the number {literal[:40]} is out of range",
                          code="invalid_json")
    return value


def _not_json(literal: str) -> Any:
    """``json.loads`` reads ``NaN``, ``Infinity`` and ``-Infinity``, which JSON does not have (OpenAI answers 400).
    Read as floats they would reach a typed field as a misleading range error, a schema as xgrammar's parse
    failure, and a template variable or tool parameter as the text "NaN" in the prompt."""
    raise bad_request(f"request body is not valid JSON: {literal} is not a JSON value", code="invalid_json")


def reject_lone_surrogates(data: object, raw: bytes | None = None) -> None:
    """A 400 (``invalid_json``) if a string in ``data`` holds a lone surrogate (``_valid_unicode``); with the
    ``raw`` body it was parsed from, only looked for when that body has a surrogate escape at all."""
    if raw is not None and SURROGATE_ESCAPE.search(raw) is None:
        return
    if not _valid_unicode(data):
        raise bad_request("request body has a string with an unpaired UTF-16 surrogate (\\ud800-\\udfff): "
                          "not valid Unicode, so it cannot be tokenized", code="invalid_json")


def _valid_unicode(data: dict) -> bool:
    """False if a string in ``data`` holds a lone surrogate (JSON allows the escape; UTF-8 has no such
    character, and the tokenizer fails on it). A pair (an emoji written as two escapes) is one character.
    Anything ``json.dumps`` cannot write is left to the field validation."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    except (TypeError, ValueError, RecursionError):  # not JSON-like: the field validation says why
        pass
    return True
