"""What a PromQL expression reads, found by pattern (no parser): the series names, the labels
its selectors match on, and the labels its grouping clauses (by, without, on, ignoring,
group_left, group_right) name. Enough for the rule and dashboard expressions this
repository writes; ``promtool check rules`` and a real Prometheus check the syntax."""

from __future__ import annotations

import re

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENT = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
}


def _without_strings(expr: str) -> str:
    return _STRING.sub('""', expr)


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(series name, labels matched on) of every ``name{…}`` selector."""
    return [(name, set(_MATCHER_LABEL.findall(body))) for name, body in _SELECTOR.findall(expr) if name]


def grouping_labels(expr: str) -> set[str]:
    out: set[str] = set()
    for body in _GROUPING.findall(_without_strings(expr)):
        out |= {label.strip() for label in body.split(",") if label.strip()}
    return out


def series_names(expr: str) -> set[str]:
    """Every series name the expression reads: identifiers that are no function,
    aggregation, keyword, label or number."""
    rest = _without_strings(expr)
    rest = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", rest)
    rest = _GROUPING.sub(" ", rest)
    rest = _RANGE.sub(" ", rest)
    return {name for name in _IDENT.findall(rest) if name.lower() not in _KEYWORDS}
