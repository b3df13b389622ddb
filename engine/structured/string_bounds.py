r"""Length-bounded JSON-Schema strings rewritten as patterns before xgrammar compiles them.

Works around xgrammar#800 (a string with ``minLength`` / ``maxLength`` admits raw control characters,
invalid JSON); drop this module when a release with the fix ships.

xgrammar lowers ``{"type": "string", "maxLength": 3}`` to three characters of ``[^"\\\r\n]``: a raw TAB
(or any other byte below 0x20 but CR and LF) may be emitted inside the string, which ``json.loads``
refuses. Its ``pattern`` path keeps JSON strings valid, so such a string becomes the pattern of
``minLength``..``maxLength`` JSON-string characters, an escape counting as one (xgrammar 0.2.9 emits
no escape under a pattern either: the values it allows are plain characters, valid JSON)::

    {"type": "string", "minLength": 1, "maxLength": 3}
        -> {"type": "string", "pattern": "^(CHAR){1,3}$"}
    CHAR = [^"\\\x00-\x1f] | \\["\\/bfnrt] | \\u[0-9a-fA-F]{4}

A string that also has ``format``, ``pattern``, ``enum`` or ``const`` is left as it is (a pattern and
a length do not combine into one regular expression here; the others fix the value already).
"""

from __future__ import annotations

from typing import Any

# the largest count a pattern's {m,n} may hold: xgrammar reads it as an int32 when it compiles the grammar
# against the vocabulary (on the rank, after the ingress built it), so a larger one failed there
MAX_REPEAT = 2**31 - 1
JSON_CHAR = r'([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'  # one character of a JSON string's text
_KEEP = ("format", "pattern", "enum", "const")  # a string with any of these is not rewritten
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [schema]
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")  # schema


def bound_strings(schema: Any) -> Any:
    """``schema`` with every length-bounded string (module docstring) as a pattern; the input is not
    changed. Anything that is not a schema object (``true``, a malformed keyword) is returned as it is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bound_strings(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bound_strings(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), list):  # draft-4 tuple ``items``
            out[key] = [bound_strings(sub) for sub in out[key]]
        elif key in out:
            out[key] = bound_strings(out[key])
    pattern = _length_pattern(out)
    if pattern is not None:
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = pattern
    return out


def _length_pattern(node: dict) -> str | None:
    """The pattern for ``node``'s length bounds, or None when it is not a string it can rewrite."""
    if node.get("type") != "string" or any(k in node for k in _KEEP):
        return None
    if "minLength" not in node and "maxLength" not in node:
        return None
    low, high = node.get("minLength", 0), node.get("maxLength")
    if not _count(low) or low > MAX_REPEAT or (high is not None and (not _count(high) or high < low)):
        return None  # left for xgrammar to take or refuse
    if high is not None and high > MAX_REPEAT:  # longer than any output: no upper bound
        high = None
    return f"^{JSON_CHAR}{{{low},{'' if high is None else high}}}$"


def _count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def bound_tag_schemas(tag: Any) -> Any:
    """A structural tag (JSON) with ``bound_strings`` applied to the schema of each ``json_schema``
    content in it, wherever it is nested."""
    if isinstance(tag, list):
        return [bound_tag_schemas(t) for t in tag]
    if not isinstance(tag, dict):
        return tag
    out = {k: bound_tag_schemas(v) for k, v in tag.items() if k != "json_schema"}
    if "json_schema" in tag:
        out["json_schema"] = bound_strings(tag["json_schema"]) if tag.get("type") == "json_schema" \
            else bound_tag_schemas(tag["json_schema"])
    return {k: out[k] for k in tag}  # the tag's key order
