"""Evaluation records (the observables of docs/efficiency-model.md; schema in docs/efficiency.md):
load them from JSONL, CSV or Parquet, validate every row, and arrange them per benchmark as the
arrays the statistics need.

Nothing is dropped silently: every rejected row becomes a :class:`Problem` naming its file
line (or Parquet row), model and instance, and the report lists them. ``strict=True`` turns
the first problem into an error instead.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import chain
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pte_instrument.offline.decomposition import LOOP_WINDOW, EvalTable, compression_ratio, loop_audit

# Accepted spellings of each field, canonical name first. Evaluation harnesses disagree on
# names; a small documented alias table beats asking users to rewrite their files.
ALIASES: dict[str, tuple[str, ...]] = {
    "model": ("model",),
    "benchmark": ("benchmark", "task", "dataset"),
    "instance_id": ("instance_id", "id", "problem_id"),
    "correct": ("correct", "is_correct"),
    "output_tokens": ("output_tokens", "generated_tokens", "completion_tokens"),
    "truncated": ("truncated",),
    "finish_reason": ("finish_reason",),
    "workload": ("workload",),
    "trace": ("trace", "output_text", "response"),
    "prompt": ("prompt", "prompt_text"),
    "request_id": ("request_id",),
    "session_id": ("session_id",),
    "pte_served": ("pte_served",),
    "pte_reference": ("pte_reference",),
    "pte_ideal": ("pte_ideal",),
}
_KNOWN_COLUMNS = frozenset(a for aliases in ALIASES.values() for a in aliases)
PTE_FIELDS = ("pte_served", "pte_reference", "pte_ideal")
# No count, workload, PTE or second of one answer or request is this large: past 2**53 a float
# stops counting by one, and a few such values sum to infinity (E0 0, totals that JSON refuses).
LARGEST_VALUE = 2.0**53
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_TRUE = {"true", "t", "yes", "y", "1"}
_FALSE = {"false", "f", "no", "n", "0"}
T = TypeVar("T")


class RecordError(ValueError):
    """Input that cannot be analysed at all (unreadable file, no valid row, strict mode)."""


@dataclass(frozen=True)
class EvalRecord:
    """One model's answer to one benchmark instance."""

    model: str
    benchmark: str
    instance_id: str
    correct: bool
    output_tokens: int  # T: visible generated tokens (> 0)
    truncated: bool  # C: hit the output budget (finish_reason == "length")
    workload: float | None = None  # W: native per-instance workload (> 0)
    trace: str | None = None  # visible output text (trace layer)
    prompt: str | None = None  # prompt text (truncation-loop audit)
    request_id: str | None = None  # join key into the plugin's request log
    session_id: str | None = None  # join key for multi-request (agent) answers
    pte_served: float | None = None
    pte_reference: float | None = None
    pte_ideal: float | None = None
    where: str = ""  # "file:line" for messages


@dataclass(frozen=True)
class Problem:
    """A row that was rejected (``action == "dropped"``) or kept with a caveat."""

    where: str
    reason: str
    model: str | None = None
    benchmark: str | None = None
    instance_id: str | None = None
    action: str = "dropped"

    def describe(self, action: bool = True) -> str:
        who = "/".join(x for x in (self.model, self.benchmark, self.instance_id) if x)
        tail = f" [{self.action}]" if action else ""
        return f"{self.where}{f' ({who})' if who else ''}: {self.reason}{tail}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadResult:
    records: list[EvalRecord]
    problems: list[Problem] = field(default_factory=list)
    rows_read: int = 0
    sources: list[str] = field(default_factory=list)

    @property
    def dropped(self) -> list[Problem]:
        return [p for p in self.problems if p.action == "dropped"]

    def summary(self) -> dict[str, Any]:
        return {
            "sources": list(self.sources),
            "rows_read": self.rows_read,
            "rows_used": len(self.records),
            "rows_dropped": len(self.dropped),
            "problems": [p.to_dict() for p in self.problems],
        }


class _RowError(ValueError):
    pass


# --------------------------------------------------------------------------- reading rows


def iter_rows(path: str | Path) -> Iterator[tuple[str, Mapping[str, Any] | _RowError]]:
    """Yield (where, row-or-parse-error) for every data row of a JSONL/CSV/Parquet file."""
    p = Path(path)
    if not p.is_file():
        raise RecordError(f"cannot read {p}: {'not a file' if p.exists() else 'no such file'}")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        yield from _iter_json(p)
    elif suffix in (".csv", ".tsv"):
        yield from _iter_csv(p, "\t" if suffix == ".tsv" else ",")
    elif suffix in (".parquet", ".pq"):
        yield from _iter_parquet(p)
    else:
        raise RecordError(f"{p}: unknown format {suffix or '(no suffix)'}; use .jsonl, .csv or .parquet")


def json_loads(text: str) -> Any:
    """``json.loads``, with input nested past the interpreter's recursion limit (the json
    module recurses once per level), an integer longer than it converts (a plain
    ValueError), or a lone surrogate (``"\\ud800"``: JSON spells it, but it is no Unicode
    text, and printing a report that holds it fails) reported as bad JSON like any other."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError:  # an integer literal past the interpreter's digit limit
        raise json.JSONDecodeError("a number with too many digits", text, 0) from None
    if _SURROGATE_ESCAPE.search(text):  # only an escape makes one: UTF-8 input holds none
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise json.JSONDecodeError(
                "a lone surrogate (\\ud800-\\udfff): not Unicode text", text, 0
            ) from None
    return value


def _iter_json(p: Path) -> Iterator[tuple[str, Mapping[str, Any] | _RowError]]:
    try:
        text = p.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is not the first row's
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(f"cannot read {p}: {e}") from None
    if text.lstrip().startswith("["):  # a JSON array of objects, rows numbered from 1
        try:
            rows = json_loads(text)
        except json.JSONDecodeError as e:
            raise RecordError(f"{p} is not valid JSON: {e}") from None
        for k, row in enumerate(rows, 1):
            where = f"{p}[{k}]"
            yield where, row if isinstance(row, dict) else _RowError("not a JSON object")
        return
    yield from json_lines(p, text_lines(text))


def text_lines(text: str) -> list[str]:
    """The lines of a JSONL text, split at newlines (``\\n``, ``\\r\\n``, ``\\r``) only, as a file
    is read line by line: ``str.splitlines()`` also splits at U+2028, U+2029 and U+0085,
    which ``json.dumps(ensure_ascii=False)`` writes raw inside a string of one valid line."""
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


def json_lines(p: Path, lines: Iterable[str]) -> Iterator[tuple[str, dict[str, Any] | _RowError]]:
    """(``file:line``, its JSON object or why it is none) for every non-blank line of a JSONL
    file: the one reading of a line that every JSONL input shares."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p}:{lineno}"
        try:
            row = json_loads(line)
        except json.JSONDecodeError as e:
            yield where, _RowError(f"invalid JSON ({e.msg})")
            continue
        yield where, row if isinstance(row, dict) else _RowError("not a JSON object")


def _iter_csv(p: Path, delimiter: str) -> Iterator[tuple[str, Mapping[str, Any] | _RowError]]:
    csv.field_size_limit(1 << 30)  # traces can be long
    try:
        fh = p.open(newline="", encoding="utf-8-sig")  # -sig: a byte-order mark is no column's
    except OSError as e:
        raise RecordError(f"cannot read {p}: {e.strerror or e}") from None
    with fh:
        reader = csv.DictReader(fh, delimiter=delimiter)
        try:
            if reader.fieldnames is None:
                return
            # A field in two columns: which one is meant is anyone's guess (DictReader keeps the
            # last), so the file is refused, as a duplicate instance is never picked from.
            known = [c for c in reader.fieldnames if c in _KNOWN_COLUMNS]
            twice = next((c for c in known if known.count(c) > 1), None)
            if twice is not None:
                raise RecordError(
                    f"{p}: column {twice!r} appears {known.count(twice)} times in the header; keep one"
                )
            start = 2  # the header is line 1
            for row in reader:
                # line_num is the line the record *ended* on (fields may span lines)
                yield f"{p}:{start}", row
                start = reader.line_num + 1
        except (csv.Error, UnicodeDecodeError) as e:
            raise RecordError(f"{p}: malformed CSV near line {reader.line_num}: {e}") from None


def _iter_parquet(p: Path) -> Iterator[tuple[str, Mapping[str, Any] | _RowError]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RecordError("reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow raises several unrelated types for a bad file
        raise RecordError(f"cannot read {p} as Parquet: {e}") from None
    for k, row in enumerate(table.to_pylist(), 1):
        yield f"{p} row {k}", row


# --------------------------------------------------------------------------- parsing one row


@functools.lru_cache(maxsize=256)
def _alias_plan(keys: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    # Rows of one file share their keys: resolve the aliases once per key set, not per row.
    present = set(keys)
    return tuple((name, tuple(a for a in aliases if a in present)) for name, aliases in ALIASES.items())


def _canonical(row: Mapping[str, Any]) -> dict[str, Any]:
    """Canonical field name -> value; None, absent and blank strings are all "missing"."""
    out: dict[str, Any] = {}
    for name, aliases in _alias_plan(tuple(row)):
        for a in aliases:
            v = row[a]
            if v is not None and not (isinstance(v, str) and v.strip() == ""):
                out[name] = v
                break
    return out


def _text(row: Mapping[str, Any], name: str, required: bool) -> str | None:
    v = row.get(name)  # row: a _canonical() dict
    if v is None:
        if required:
            raise _RowError(f"missing field {name!r}")
        return None
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise _RowError(f"{name} must be a string, got {v!r}")
    return str(v)


def _bool(v: Any, name: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise _RowError(f"{name} must be true/false or 1/0, got {v!r}")


def _number(v: Any, name: str) -> float:
    if isinstance(v, bool):
        raise _RowError(f"{name} must be a number, got {v!r}")
    try:
        x = float(v)
    except OverflowError:  # an integer too large for a float
        raise _RowError(f"{name} is too large") from None
    except (TypeError, ValueError):
        raise _RowError(f"{name} must be a number, got {v!r}") from None
    if math.isnan(x):
        raise _RowError(f"{name} is NaN")
    if math.isinf(x):
        raise _RowError(f"{name} is infinite")
    if abs(x) > LARGEST_VALUE:
        raise _RowError(f"{name} is too large ({x:.3g})")
    return x


def parse_record(row: Mapping[str, Any], where: str = "") -> EvalRecord:
    """Validate one row; raises ``ValueError`` with the reason (the loader names the row)."""
    row = _canonical(row)
    model = _text(row, "model", True)
    benchmark = _text(row, "benchmark", True)
    instance_id = _text(row, "instance_id", True)
    raw_correct = row.get("correct")
    if raw_correct is None:
        raise _RowError("missing field 'correct'")
    correct = _bool(raw_correct, "correct")
    raw_t = row.get("output_tokens")
    if raw_t is None:
        raise _RowError("missing field 'output_tokens'")
    t = _number(raw_t, "output_tokens")
    if t <= 0:
        raise _RowError(f"output_tokens must be > 0, got {raw_t!r}")
    if not t.is_integer():
        raise _RowError(f"output_tokens must be an integer, got {raw_t!r}")

    raw_trunc, reason = row.get("truncated"), row.get("finish_reason")
    if raw_trunc is None and reason is None:
        raise _RowError("missing field 'truncated' (or 'finish_reason')")
    by_reason = None if reason is None else str(reason).strip().lower() == "length"
    truncated = _bool(raw_trunc, "truncated") if raw_trunc is not None else bool(by_reason)
    if by_reason is not None and raw_trunc is not None and truncated != by_reason:
        raise _RowError(f"truncated={truncated} contradicts finish_reason={reason!r}")
    if correct and truncated:
        raise _RowError("correct but truncated: a truncated answer is never correct")

    workload = row.get("workload")
    if workload is not None:
        workload = _number(workload, "workload")
        if workload <= 0:
            raise _RowError(f"workload must be > 0, got {workload!r}")
        if workload < 1 / LARGEST_VALUE:  # T/W would overflow: V̄O infinite, κ 0
            raise _RowError(f"workload is too small ({workload:.3g})")
    pte: dict[str, float | None] = {}
    for name in PTE_FIELDS:
        v = row.get(name)
        if v is not None:
            v = _number(v, name)
            if v < 0:
                raise _RowError(f"{name} must be >= 0, got {v!r}")
        pte[name] = v
    return EvalRecord(
        model=model or "",
        benchmark=benchmark or "",
        instance_id=instance_id or "",
        correct=correct,
        output_tokens=int(t),
        truncated=truncated,
        workload=workload,
        trace=_text(row, "trace", False),
        prompt=_text(row, "prompt", False),
        request_id=_text(row, "request_id", False),
        session_id=_text(row, "session_id", False),
        where=where,
        **pte,
    )


# --------------------------------------------------------------------------- loading


def load_records(paths: str | Path | Sequence[str | Path], strict: bool = False) -> LoadResult:
    """Read and validate evaluation records from one or more files.

    Rejected rows are listed as problems; ``strict`` raises :class:`RecordError` on the first.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    records, problems, rows_read = parse_rows(
        chain.from_iterable(iter_rows(path) for path in paths),
        parse_record,
        _RowError,
        lambda row: (_soft(row, "model"), _soft(row, "benchmark"), _soft(row, "instance_id")),
    )
    records, more = check_consistency(records)
    problems += more
    refuse_bad_load(
        problems, strict, bool(records), "record", "evaluation records", ", ".join(map(str, paths))
    )
    return LoadResult(records, problems, rows_read, [str(p) for p in paths])


def parse_rows(
    rows: Iterable[tuple[str, Mapping[str, Any] | _RowError]],
    parse: Callable[[Mapping[str, Any], str], T],
    error: type[Exception],
    identify: Callable[[Mapping[str, Any]], tuple[str | None, str | None, str | None]],
) -> tuple[list[T], list[Problem], int]:
    """Every (where, row) parsed, or listed as a problem: a row that could not be read, or
    one ``parse`` refused (raising ``error``), named by ``identify`` (model, benchmark,
    instance) as far as the row tells. Also the number of rows read."""
    parsed: list[T] = []
    problems: list[Problem] = []
    n = 0
    for where, row in rows:
        n += 1
        if isinstance(row, _RowError):
            problems.append(Problem(where, str(row)))
            continue
        try:
            parsed.append(parse(row, where))
        except error as e:
            problems.append(Problem(where, str(e), *identify(row)))
    return parsed, problems, n


def refuse_bad_load(
    problems: Sequence[Problem], strict: bool, found: bool, row: str, rows: str, where: str
) -> None:
    """A load fails when ``strict`` and any row was bad (a problem whose row was kept is none),
    or when no row was usable."""
    bad = [p for p in problems if p.action != "kept"]
    if strict and bad:
        raise RecordError(f"{len(bad)} bad {row}(s); first: {bad[0].describe(action=False)}")
    if not found:
        first = f"; first problem: {problems[0].describe(False)}" if problems else ""
        raise RecordError(f"no valid {rows} in {where}{first}")


def _soft(row: Mapping[str, Any], name: str) -> str | None:
    try:
        return _text(_canonical(row), name, False)
    except _RowError:
        return None


def drop_duplicates(items: Iterable[Any], key: Any, what: str) -> tuple[list[Any], list[Problem]]:
    """Drop every copy of an item whose ``key`` (model, benchmark, id) repeats — choosing
    one would be arbitrary — and list each copy, naming where the others are."""
    items = list(items)
    copies: dict[tuple[str, str, str], list[Any]] = defaultdict(list)
    for it in items:
        copies[key(it)].append(it)
    problems = [
        Problem(it.where, f"duplicate {what} (also at {', '.join(o.where for o in rows if o is not it)})", *k)
        for k, rows in sorted(copies.items())
        if len(rows) > 1
        for it in rows
    ]
    return [it for it in items if len(copies[key(it)]) == 1], problems


def check_consistency(records: Iterable[EvalRecord]) -> tuple[list[EvalRecord], list[Problem]]:
    """Rules across rows: an instance appears once per model and benchmark (every copy of a
    duplicate is dropped — choosing one would be arbitrary), and a native workload is a
    property of the instance (rows that disagree keep their answers, but the instance's
    workload becomes unknown)."""
    records, problems = drop_duplicates(
        records, lambda r: (r.model, r.benchmark, r.instance_id), "instance id within model+benchmark"
    )

    workloads: dict[tuple[str, str], set[float]] = defaultdict(set)
    for r in records:
        if r.workload is not None:
            workloads[(r.benchmark, r.instance_id)].add(r.workload)
    known = {k: next(iter(v)) for k, v in workloads.items() if len(v) == 1}
    conflict = {k for k, v in workloads.items() if len(v) > 1}
    out = []
    for r in records:
        key = (r.benchmark, r.instance_id)
        if key in conflict:
            if r.workload is not None:
                problems.append(
                    Problem(
                        r.where,
                        f"workload {r.workload:g} disagrees with other rows of this instance "
                        f"({', '.join(f'{w:g}' for w in sorted(workloads[key]))})",
                        r.model,
                        r.benchmark,
                        r.instance_id,
                        action="kept; instance workload unknown",
                    )
                )
            r = replace(r, workload=None)
        elif key in known and r.workload is None:
            r = replace(r, workload=known[key])  # W belongs to the instance, not the row
        out.append(r)
    return out, problems


# --------------------------------------------------------------------------- arrays


def build_tables(records: Iterable[EvalRecord], window: int = LOOP_WINDOW) -> dict[str, EvalTable]:
    """Arrange records per benchmark as (model × instance) arrays, models and instances
    sorted by name so results do not depend on row order. Trace features (σ_c and the
    truncation-loop audit) are computed here, once per record."""
    groups: dict[str, list[EvalRecord]] = defaultdict(list)
    for r in records:
        groups[r.benchmark].append(r)
    return {b: _table(b, rs, window) for b, rs in sorted(groups.items())}


def _table(benchmark: str, recs: list[EvalRecord], window: int) -> EvalTable:
    models = sorted({r.model for r in recs})
    instances = sorted({r.instance_id for r in recs})
    mi = {m: k for k, m in enumerate(models)}
    ii = {i: k for k, i in enumerate(instances)}
    rows = np.fromiter((mi[r.model] for r in recs), np.int64, len(recs))
    cols = np.fromiter((ii[r.instance_id] for r in recs), np.int64, len(recs))
    M, N = len(models), len(instances)

    def grid(values: Iterable[float], fill: float) -> np.ndarray:
        a = np.full((M, N), fill)
        a[rows, cols] = np.fromiter(values, np.float64, len(recs))
        return a

    present = np.zeros((M, N), bool)
    present[rows, cols] = True
    workload = np.full(N, np.nan)
    for r, c in zip(recs, cols, strict=True):
        if r.workload is not None:
            if not (np.isnan(workload[c]) or workload[c] == r.workload):
                raise RecordError(
                    f"{benchmark}/{r.instance_id}: conflicting workloads "
                    f"({workload[c]:g} vs {r.workload:g}); run check_consistency first"
                )
            workload[c] = r.workload
    nan = float("nan")
    loops = [loop_audit(r.trace, r.prompt, window) if r.truncated and r.trace else (nan, nan) for r in recs]
    return EvalTable.from_arrays(
        benchmark=benchmark,
        models=models,
        instances=instances,
        present=present,
        correct=grid((r.correct for r in recs), 0.0),
        tokens=grid((r.output_tokens for r in recs), 0.0),
        truncated=grid((r.truncated for r in recs), 0.0),
        workload=workload,
        sigma=grid((compression_ratio(r.trace) if r.trace else nan for r in recs), nan),
        pte=grid((nan if r.pte_served is None else r.pte_served for r in recs), nan),
        loop_repeat=grid((x[0] for x in loops), nan),
        loop_overlap=grid((x[1] for x in loops), nan),
    )
