"""The plugin's request log (``PTE_REQUEST_LOG``, JSONL, gzipped or not) read back for
``pte report``: GPU seconds by term of the step-time model, predicted seconds, latency
explained, interference, cost and served PTE, per model and per session.

Seconds exist only for requests priced with the step hook, and money only with
``PTE_GPU_HOURLY_PRICE``: a request without them is counted as such (``requests_timed``,
``requests_priced``), never given a guessed 0. Nothing is dropped silently: a bad line
becomes a :class:`~pte_instrument.offline.records.Problem` naming its file line, and the
report lists it (``strict``: the first one is an error).
"""

from __future__ import annotations

import gzip
import math
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from pte_instrument.offline.records import (
    LARGEST_VALUE,
    PTE_FIELDS,
    EvalRecord,
    Problem,
    RecordError,
    json_lines,
    parse_rows,
    refuse_bad_load,
)
from pte_instrument.offline.render import fmt, md_table, problems_markdown
from pte_instrument.server.records import TIMED
from pte_instrument.server.request_tags import quoted

SCHEMA = "pte-request-log-report/1"
Kind = Literal["requests", "trajectories"]
SortKey = Literal["cost_usd", "gpu_seconds", "pte_served"]
SORT_KEYS: tuple[SortKey, ...] = ("cost_usd", "gpu_seconds", "pte_served")
DEFAULT_LIMIT = 10
DETECT_LINES = 100  # non-blank lines read to find the first JSON object

# The step hook's seconds of one request (docs/cost-model.md §5b; ``TIMED``, the request
# record's own declaration): all present (numbers) or all absent (null) on a line.
SIGNED = frozenset({"interference_s"})  # latency explained minus own work: may dip below 0 by rounding
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class RequestLine:
    """One finished request of the log, as far as the report reads it."""

    where: str  # "file:line"
    request_id: str
    model: str
    session_id: str | None
    pte_served: float
    seconds: tuple[float, ...] | None  # the TIMED fields in order; None: no step hook
    cost_usd: float | None  # None: no step hook, or no price


@dataclass(frozen=True)
class RequestLogLoad:
    lines: tuple[RequestLine, ...]
    problems: tuple[Problem, ...]
    rows_read: int
    source: str

    def summary(self) -> dict[str, Any]:
        return {
            "sources": [self.source],
            "rows_read": self.rows_read,
            "rows_used": len(self.lines),
            "rows_dropped": sum(p.action == "dropped" for p in self.problems),
            "problems": [p.to_dict() for p in self.problems],
        }


@dataclass(frozen=True)
class Totals:
    """Sums over a group of requests. Seconds are summed over the ``requests_timed`` requests
    that have them, cost over the ``requests_priced``; the rest are only counted."""

    requests: int = 0
    pte_served: float = 0.0
    requests_timed: int = 0
    seconds: tuple[float, ...] = (0.0,) * len(TIMED)
    requests_priced: int = 0
    cost_usd: float = 0.0

    def add(self, r: RequestLine) -> Totals:
        return Totals(
            self.requests + 1,
            self.pte_served + r.pte_served,
            self.requests_timed + (r.seconds is not None),
            self.seconds
            if r.seconds is None
            else tuple(a + b for a, b in zip(self.seconds, r.seconds, strict=True)),
            self.requests_priced + (r.cost_usd is not None),
            self.cost_usd + (r.cost_usd or 0.0),
        )

    def value(self, name: str) -> float | None:
        """A summed field by its log name; None when no request of the group has it."""
        if name == "pte_served":
            return self.pte_served
        if name == "cost_usd":
            return self.cost_usd if self.requests_priced else None
        return self.seconds[TIMED.index(name)] if self.requests_timed else None

    @property
    def interference_share(self) -> float | None:
        """Part of the timed requests' latency spent on other requests' work, queue included."""
        explained = self.value("latency_explained_s")
        if not explained:
            return None
        share = self.seconds[TIMED.index("interference_s")] / explained
        return share if math.isfinite(share) else None  # a subnormal explained latency overflows it

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "requests_timed": self.requests_timed,
            "requests_untimed": self.requests - self.requests_timed,
            "requests_priced": self.requests_priced,
            "requests_unpriced": self.requests - self.requests_priced,
            "pte_served": self.pte_served,
            **{k: self.value(k) for k in TIMED},
            "interference_share": self.interference_share,
            "cost_usd": self.value("cost_usd"),
        }


def totals(lines: Iterable[RequestLine]) -> Totals:
    t = Totals()
    for r in lines:
        t = t.add(r)
    return t


# --------------------------------------------------------------------------- reading


def log_lines(p: Path) -> Iterator[str]:
    """The file's lines, gunzipped when it is gzip (by its first bytes, whatever its name);
    an unreadable, corrupt or non-UTF-8 file is a :class:`RecordError`, and so is one that is
    not a regular file: a pipe is read more than once (its first bytes, then its lines; and
    ``pte report`` tells its kind first), and one with no writer would never answer."""
    if p.exists() and not p.is_dir() and not p.is_file():
        raise RecordError(f"cannot read {p}: not a regular file (a pipe?): save it to a file first")
    lineno = 0
    try:
        with p.open("rb") as fh:
            gz = fh.read(2) == _GZIP_MAGIC
        # -sig: a byte-order mark (as some Windows tools write) is not the first line's
        with gzip.open(p, "rt", encoding="utf-8-sig") if gz else p.open(encoding="utf-8-sig") as text:
            for lineno, line in enumerate(text, 1):  # noqa: B007 (read in the except clause)
                yield line
    except UnicodeDecodeError:
        raise RecordError(f"cannot read {p}: not UTF-8 text (line {lineno + 1})") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise RecordError(f"cannot read {p}: corrupt or truncated gzip after line {lineno} ({e})") from None
    except OSError as e:
        reason = "not a file" if p.exists() and not p.is_file() else (e.strerror or str(e))
        raise RecordError(f"cannot read {p}: {reason}") from None


def is_gzip(path: str | Path) -> bool:
    try:
        with Path(path).open("rb") as fh:
            return fh.read(2) == _GZIP_MAGIC
    except OSError:
        return False


def detect_kind(path: str | Path) -> Kind:
    """``"requests"`` when the first JSON object of the file has ``request_id`` and
    ``pte_served`` (the request log's lines do), else ``"trajectories"``."""
    p = Path(path)
    for seen, (_, row) in enumerate(json_lines(p, log_lines(p)), 1):
        if isinstance(row, dict):
            return "requests" if "request_id" in row and "pte_served" in row else "trajectories"
        if seen >= DETECT_LINES:
            break
    return "trajectories"


class _LineError(ValueError):
    pass


def _number(row: Mapping[str, Any], name: str, signed: bool = False) -> float:
    v = row.get(name)
    if v is None:
        raise _LineError(f"missing field {name!r}")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _LineError(f"{name} is not a number: {v!r}")
    try:
        x = float(v)
    except OverflowError:  # an integer too large for a float
        raise _LineError(f"{name} is too large") from None
    if not math.isfinite(x):
        raise _LineError(f"{name} is not finite: {v!r}")
    if x < 0 and not signed:
        raise _LineError(f"{name} is negative: {v!r}")
    if abs(x) > LARGEST_VALUE:
        raise _LineError(f"{name} is too large ({x:.3g})")
    return x


def _text(row: Mapping[str, Any], name: str, required: bool) -> str | None:
    v = row.get(name)
    if v is None:
        if required:
            raise _LineError(f"missing field {name!r}")
        return None
    if not isinstance(v, str) or not v:
        raise _LineError(f"{name} is not a non-empty string: {v!r}")
    return v


def parse_line(row: Mapping[str, Any], where: str = "") -> RequestLine:
    request_id = _text(row, "request_id", True)
    model = _text(row, "model", True)
    assert request_id is not None and model is not None
    present = [k for k in TIMED if row.get(k) is not None]
    if present and row.get("gpu_seconds") is None:
        raise _LineError(f"{present[0]} without gpu_seconds")
    seconds = tuple(_number(row, k, k in SIGNED) for k in TIMED) if present else None
    cost = None if row.get("cost_usd") is None else _number(row, "cost_usd")
    if cost is not None and seconds is None:
        raise _LineError("cost_usd without gpu_seconds")
    return RequestLine(
        where, request_id, model, _text(row, "session_id", False), _number(row, "pte_served"), seconds, cost
    )


def load_request_log(path: str | Path, strict: bool = False) -> RequestLogLoad:
    """Read and validate a request log; bad lines are dropped and listed (``strict``: raise)."""
    p = Path(path)
    lines, problems, rows = parse_rows(
        json_lines(p, log_lines(p)),
        parse_line,
        _LineError,
        lambda row: (_soft(row, "model"), None, _soft(row, "request_id")),
    )
    problems += repeated_ids(
        p, [(r.request_id, int(r.where.rpartition(":")[2])) for r in lines], "each copy is counted"
    )
    refuse_bad_load(problems, strict, bool(lines), "request-log line", "request-log lines", str(p))
    return RequestLogLoad(tuple(lines), tuple(problems), rows, str(p))


def repeated_ids(path: Path, ids: Iterable[tuple[str, int]], consequence: str) -> list[Problem]:
    """One kept problem per request id logged more than once (a client's reused
    ``X-Request-Id``, a log read together with a copy of itself), naming its lines: every copy
    may be a request served, so none is dropped, but no total counts them silently."""
    lines: defaultdict[str, list[int]] = defaultdict(list)
    for rid, n in ids:
        lines[rid].append(n)
    problems = []
    for rid, ns in lines.items():
        if len(ns) > 1:
            shown = ", ".join(map(str, ns[:5])) + (", …" if len(ns) > 5 else "")
            reason = f"request_id {quoted(rid, 80)} is logged {len(ns)} times (lines {shown}): {consequence}"
            problems.append(Problem(f"{path}:{ns[0]}", reason, action="kept"))
    return problems


def _soft(row: Mapping[str, Any], name: str) -> str | None:
    v = row.get(name)
    return v if isinstance(v, str) else None


# --------------------------------------------------------------------------- joined to evaluation records


@dataclass(frozen=True)
class _LoggedPTE:
    """The PTE of one request-log line, and the keys it joins by."""

    where: str
    request_id: str | None
    session_id: str | None
    values: dict[str, float]


def _logged_pte(row: Mapping[str, Any], where: str) -> _LoggedPTE:
    return _LoggedPTE(
        where,
        _text(row, "request_id", False),
        _text(row, "session_id", False),
        {name: _number(row, name) for name in PTE_FIELDS},
    )


def join_request_log(
    records: Sequence[EvalRecord], path: str | Path
) -> tuple[list[EvalRecord], list[Problem]]:
    """Fill PTE fields from the plugin's request log (JSONL, gzipped or not, read as ``pte
    report`` reads it): by ``request_id`` (one request) or else by ``session_id`` (summed over
    the session's requests, an agent answer). Records that already carry PTE keep it; records
    whose key is not in the log are kept without PTE and listed. A log line that is not a
    request's PTE (a line cut off by a live writer, a negative value) is listed and joins
    nothing; a ``request_id`` logged more than once is listed and joins none of its copies.
    A log with no usable line is a :class:`RecordError`."""
    p = Path(path)
    logged, read_problems, _ = parse_rows(
        json_lines(p, log_lines(p)), _logged_pte, _LineError, lambda row: (None, None, None)
    )
    refuse_bad_load(read_problems, False, bool(logged), "request-log line", "request-log lines", str(p))
    # a request-log line is no evaluation record: it is not counted among the records dropped
    problems = [replace(pr, action="not joined") for pr in read_problems]
    with_id = [(x.request_id, x) for x in logged if x.request_id is not None]
    problems += repeated_ids(
        p, ((rid, int(x.where.rpartition(":")[2])) for rid, x in with_id), "it joins none of its copies"
    )
    counts = Counter(rid for rid, _ in with_id)
    by_request = {rid: x.values for rid, x in with_id if counts[rid] == 1}
    # every copy of a repeated id may be a request served: the session sums keep each
    by_session: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PTE_FIELDS, 0.0))
    for x in logged:
        if x.session_id is not None:
            acc = by_session[x.session_id]
            for k in PTE_FIELDS:
                acc[k] += x.values[k]
    out = []
    for r in records:
        if r.pte_served is not None:
            out.append(r)
            continue
        values = None
        if r.request_id is not None:
            values = by_request.get(r.request_id)
        elif r.session_id is not None:
            values = by_session.get(r.session_id)
        if values is None and (r.request_id or r.session_id):
            if r.request_id and counts[r.request_id] > 1:
                reason = (
                    f"request_id {r.request_id} is logged {counts[r.request_id]} times in request log {p}"
                )
            else:
                key = f"request_id {r.request_id}" if r.request_id else f"session_id {r.session_id}"
                reason = f"{key} not in request log {p}"
            problems.append(Problem(r.where, reason, r.model, r.benchmark, r.instance_id, "kept without PTE"))
        out.append(replace(r, **values) if values else r)
    return out, problems


# --------------------------------------------------------------------------- the report


def resolve_sort(sort: str, overall: Totals) -> SortKey:
    """``auto``: by cost when any request is priced, else by GPU seconds when any is timed,
    else by served PTE."""
    if sort != "auto":
        if sort not in SORT_KEYS:
            raise ValueError(f"unknown sort {sort!r}")
        return sort  # type: ignore[return-value]
    if overall.requests_priced:
        return "cost_usd"
    return "gpu_seconds" if overall.requests_timed else "pte_served"


def _grouped(lines: Iterable[RequestLine], key: Any) -> dict[str, list[RequestLine]]:
    groups: defaultdict[str, list[RequestLine]] = defaultdict(list)
    for r in lines:
        k = key(r)
        if k is not None:
            groups[k].append(r)
    return dict(groups)


def request_log_report(
    load: RequestLogLoad, sort: str = "auto", limit: int = DEFAULT_LIMIT
) -> dict[str, Any]:
    """The report as stable JSON data (``null`` where a group has no such numbers)."""
    overall = totals(load.lines)
    key = resolve_sort(sort, overall)
    by_model = _grouped(load.lines, lambda r: r.model)
    by_session = _grouped(load.lines, lambda r: r.session_id)
    sessions = [(sid, sorted({r.model for r in rs}), totals(rs)) for sid, rs in by_session.items()]

    def rank(s: tuple[str, list[str], Totals]) -> tuple[bool, float, str]:
        v = s[2].value(key)
        return (v is None, -(v or 0.0), s[0])  # highest first, sessions without the figure last

    sessions.sort(key=rank)
    return {
        "schema": SCHEMA,
        "input": load.summary(),
        "overall": overall.to_dict(),
        "models": {m: totals(rs).to_dict() for m, rs in sorted(by_model.items())},
        "sessions": {
            "count": len(sessions),
            "requests_without_session": sum(r.session_id is None for r in load.lines),
            "sort": key,
            "limit": limit,
            "top": [
                {"session_id": sid, "models": models, **t.to_dict()} for sid, models, t in sessions[:limit]
            ],
        },
    }


_COLUMNS = (
    ("requests", "requests", 6),
    ("requests_timed", "timed", 6),
    ("gpu_seconds", "GPU s", 4),
    ("gpu_seconds_prefill", "prefill s", 4),
    ("gpu_seconds_kv_read", "KV read s", 4),
    ("gpu_seconds_weights", "weights s", 4),
    ("gpu_seconds_overhead", "overhead s", 4),
    ("predicted_seconds", "predicted s", 4),
    ("latency_explained_s", "latency explained s", 4),
    ("interference_share", "interference share", 3),
    ("requests_priced", "priced", 6),
    ("cost_usd", "cost (USD)", 4),
    ("pte_served", "PTE served", 6),
)


def _row(d: Mapping[str, Any]) -> list[str]:
    return [fmt(d[k], digits) for k, _, digits in _COLUMNS]


def _header(first: Sequence[str]) -> list[str]:
    return [*first, *(label for _, label, _ in _COLUMNS)]


def request_log_markdown(report: Mapping[str, Any]) -> str:
    o, s = report["overall"], report["sessions"]
    untimed, unpriced = o["requests_untimed"], o["requests_unpriced"]
    out = [
        "# Request-log report",
        "",
        problems_markdown(report["input"]),
        "",
        f"{o['requests']} requests; {o['requests_timed']} with the step hook's seconds"
        + (f" ({untimed} without: no GPU seconds, shown as —)" if untimed else "")
        + f"; {o['requests_priced']} priced"
        + (f" ({unpriced} without a price: PTE_GPU_HOURLY_PRICE)" if unpriced else "")
        + ". Seconds sum over the timed requests, cost over the priced ones.",
        "",
        "## By model",
        "",
        md_table(_header(["model"]), [[m, *_row(d)] for m, d in report["models"].items()]),
        "",
        f"## Top sessions by {s['sort']} ({len(s['top'])} of {s['count']})",
        "",
    ]
    if s["top"]:
        out.append(
            md_table(
                _header(["session", "model"]),
                [[d["session_id"], ", ".join(d["models"]), *_row(d)] for d in s["top"]],
            )
        )
    else:
        out.append("No request of the log has a session.")
    if s["requests_without_session"]:
        out += ["", f"Requests without a session: {s['requests_without_session']}."]
    return "\n".join(out) + "\n"
