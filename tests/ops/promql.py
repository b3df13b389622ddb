"""Tiny PromQL helpers for the ops tests: metric names in an expr, Grafana variable expansion."""

from __future__ import annotations

import re

# PromQL words that look like identifiers but are not metric names.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
             "unless", "offset", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_LABELSET = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![A-Za-z0-9_.:$])[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Metric names an expr selects (identifiers that are not functions, keywords or labels).

    >>> sorted(metric_names('sum by (le) (rate(a_bucket{x=~"$y"}[5m])) / b'))
    ['a_bucket', 'b']
    """
    s = _STRING.sub('""', expr)
    s = _LABELSET.sub(" ", s)
    s = _RANGE.sub(" ", s)
    s = _GROUPING.sub(" ", s)
    names = set()
    for m in _IDENT.finditer(s):
        word, rest = m.group(0), s[m.end():].lstrip()
        if word.lower() in _KEYWORDS or rest.startswith("("):
            continue  # keyword or function call
        names.add(word)
    return names


_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(.*),)?\s*([A-Za-z_]\w*)\s*\)\s*$", re.S)


def variable_query_selector(query: str) -> str | None:
    """The series selector of a Grafana ``label_values(selector, label)`` variable query."""
    m = _LABEL_VALUES.match(query)
    if not m:
        raise ValueError(f"unsupported variable query {query!r}")
    return m.group(1)


def expand_grafana_vars(expr: str, variables: dict[str, str], rate_interval: str,
                        range_: str) -> str:
    """Replace Grafana variables the way Grafana does for an "All" selection."""
    out = expr.replace("$__rate_interval", rate_interval).replace("$__range", range_)
    out = out.replace("$__interval", rate_interval)
    for name in sorted(variables, key=len, reverse=True):
        out = out.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    if "$" in out:
        raise ValueError(f"unexpanded Grafana variable in {out!r}")
    return out
