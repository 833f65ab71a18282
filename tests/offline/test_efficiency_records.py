"""Evaluation records: JSONL/CSV/Parquet loading, every bad-record rule naming its row,
the request-log join and the arrays the statistics read."""

import csv
import json
import math

import numpy as np
import pytest

from pte_instrument.offline.records import (
    EvalRecord,
    RecordError,
    build_tables,
    check_consistency,
    load_records,
    parse_record,
)
from pte_instrument.offline.request_log import join_request_log

GOOD = [
    {
        "model": "A",
        "benchmark": "b",
        "instance_id": "1",
        "correct": True,
        "output_tokens": 10,
        "finish_reason": "stop",
        "workload": 2.0,
    },
    {
        "model": "A",
        "benchmark": "b",
        "instance_id": "2",
        "correct": False,
        "output_tokens": 20,
        "finish_reason": "length",
        "trace": "a b c d a b c d",
        "prompt": "x a b c d y",
    },
    {"model": "B", "task": "b", "id": 1, "is_correct": "1", "generated_tokens": "30", "truncated": "false"},
]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_good_rows_and_aliases(tmp_path):
    res = load_records(write_jsonl(tmp_path / "r.jsonl", GOOD))
    assert res.problems == []
    assert res.rows_read == 3 and len(res.records) == 3
    a1, a2, b1 = res.records
    assert (a1.correct, a1.truncated, a1.workload) == (True, False, 2.0)
    assert a2.truncated is True  # finish_reason "length"
    assert (b1.benchmark, b1.instance_id, b1.correct, b1.output_tokens) == ("b", "1", True, 30)
    # W is an instance property: B's row for instance 1 inherits A's workload
    assert b1.workload == 2.0
    assert a1.where.endswith("r.jsonl:1") and b1.where.endswith("r.jsonl:3")


def bad(*missing, **fields):
    """A row for instance 9 of model A: ``fields`` over a valid base, ``missing`` left out."""
    row = {
        "model": "A",
        "benchmark": "b",
        "instance_id": "9",
        "correct": False,
        "output_tokens": 5,
        "truncated": False,
        **fields,
    }
    return {k: v for k, v in row.items() if k not in missing}


BAD = [
    (bad("model", correct=True, output_tokens=1), "missing field 'model'"),
    (bad("correct", output_tokens=1), "missing field 'correct'"),
    (bad("truncated", correct=True, output_tokens=1), "missing field 'truncated'"),
    (bad(output_tokens=0), "output_tokens must be > 0"),
    (bad(output_tokens=-3), "output_tokens must be > 0"),
    (bad(output_tokens=2.5), "must be an integer"),
    (bad(output_tokens=float("nan")), "output_tokens is NaN"),
    (bad(workload=float("nan")), "workload is NaN"),
    (bad(workload=0), "workload must be > 0"),
    (bad("truncated", correct=True, finish_reason="length"), "correct but truncated"),
    (bad(finish_reason="length"), "contradicts finish_reason"),
    (bad(correct="maybe"), "correct must be true/false"),
    (bad(pte_served=-1), "pte_served must be >= 0"),
    # past 2**53 no count is exact, and two such rows sum to infinity (E0 0, E[T] ∞)
    (bad(output_tokens=10**400), "output_tokens is too large"),
    (bad(output_tokens=1e300), "output_tokens is too large"),
    (bad(workload=10**400), "workload is too large"),
    (bad(pte_served=1e308), "pte_served is too large"),
    # T/W of a subnormal workload is infinite: V̄O ∞ and κ 0
    (bad(workload=1e-320), "workload is too small"),
]


@pytest.mark.parametrize(("row", "reason"), BAD)
def test_each_bad_record_is_named_and_dropped(tmp_path, row, reason):
    res = load_records(write_jsonl(tmp_path / "r.jsonl", [*GOOD, row]))
    assert len(res.records) == 3  # the good rows stay
    assert len(res.problems) == 1
    p = res.problems[0]
    assert reason in p.reason
    assert p.where.endswith("r.jsonl:4") and p.action == "dropped"
    assert res.summary()["rows_dropped"] == 1 and res.summary()["rows_read"] == 4


def test_invalid_json_line_and_duplicates_are_listed(tmp_path):
    dup = dict(GOOD[0], output_tokens=11)
    res = load_records(write_jsonl(tmp_path / "r.jsonl", [*GOOD, "{not json", dup, "[1, 2]"]))
    by_line = {p.where.rsplit(":", 1)[1]: p for p in res.problems}
    assert "invalid JSON" in by_line["4"].reason
    assert "not a JSON object" in by_line["6"].reason
    # both copies of A/b/1 are dropped, each naming the other line
    assert "duplicate instance id" in by_line["1"].reason and by_line["1"].reason.endswith(":5)")
    assert "duplicate" in by_line["5"].reason and by_line["5"].instance_id == "1"
    assert [(r.model, r.instance_id) for r in res.records] == [("A", "2"), ("B", "1")]
    assert len(res.dropped) == 4


def test_a_number_with_more_digits_than_python_reads_is_invalid_json(tmp_path):
    """The json module refuses an integer literal past the interpreter's digit limit with a
    plain ValueError, not a JSONDecodeError: still one bad line, not a traceback."""
    digits = json.dumps(bad()).replace('"output_tokens": 5', '"output_tokens": 1' + "0" * 5000)
    res = load_records(write_jsonl(tmp_path / "r.jsonl", [*GOOD, digits]))
    assert len(res.records) == 3
    assert [(p.where.rsplit(":", 1)[1], p.reason[:13]) for p in res.problems] == [("4", "invalid JSON ")]


def test_strict_mode_and_empty_input_are_errors(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [*GOOD, BAD[3][0]])
    with pytest.raises(RecordError, match=r"r\.jsonl:4 .*output_tokens must be > 0"):
        load_records(path, strict=True)
    with pytest.raises(RecordError, match="no valid evaluation records"):
        load_records(write_jsonl(tmp_path / "bad.jsonl", [BAD[0][0]]))
    with pytest.raises(RecordError, match="no such file"):
        load_records(tmp_path / "missing.jsonl")
    with pytest.raises(RecordError, match="unknown format"):
        load_records(write_jsonl(tmp_path / "r.txt", GOOD))


def test_conflicting_workload_is_kept_but_unknown(tmp_path):
    rows = [dict(GOOD[0]), dict(GOOD[2], workload=3.0)]  # instance b/1: W 2 vs 3
    res = load_records(write_jsonl(tmp_path / "r.jsonl", rows))
    assert len(res.records) == 2 and all(r.workload is None for r in res.records)
    assert len(res.problems) == 2 and res.dropped == []
    assert all("disagrees" in p.reason and p.action.startswith("kept") for p in res.problems)


def test_csv_with_multiline_trace_names_the_right_lines(tmp_path):
    path = tmp_path / "r.csv"
    fields = [
        "model",
        "benchmark",
        "instance_id",
        "correct",
        "output_tokens",
        "finish_reason",
        "workload",
        "trace",
    ]
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()  # line 1
        w.writerow(
            {
                "model": "A",
                "benchmark": "b",
                "instance_id": "1",
                "correct": "true",
                "output_tokens": "10",
                "finish_reason": "stop",
                "workload": "",
                "trace": "line one\nline two",
            }
        )  # lines 2-3
        w.writerow(
            {
                "model": "A",
                "benchmark": "b",
                "instance_id": "2",
                "correct": "0",
                "output_tokens": "nan",
                "finish_reason": "stop",
            }
        )  # line 4
        w.writerow(
            {
                "model": "A",
                "benchmark": "b",
                "instance_id": "3",
                "correct": "false",
                "output_tokens": "7",
                "finish_reason": "length",
            }
        )  # line 5
    res = load_records(path)
    assert [r.instance_id for r in res.records] == ["1", "3"]
    assert res.records[0].trace == "line one\nline two" and res.records[0].workload is None
    assert res.records[1].where.endswith("r.csv:5") and res.records[1].truncated
    assert len(res.problems) == 1 and res.problems[0].where.endswith("r.csv:4")
    assert "NaN" in res.problems[0].reason


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "model": ["A", "A", "B"],
            "benchmark": ["b", "b", "b"],
            "instance_id": ["1", "2", "1"],
            "correct": [True, False, True],
            "output_tokens": [10, 20, 0],
            "finish_reason": ["stop", "length", "stop"],
            "workload": [2.0, None, 2.0],
        }
    )
    pq.write_table(table, tmp_path / "r.parquet")
    res = load_records(tmp_path / "r.parquet")
    assert [(r.model, r.instance_id) for r in res.records] == [("A", "1"), ("A", "2")]
    assert res.records[1].workload is None and res.records[1].truncated
    assert res.problems[0].where.endswith("r.parquet row 3")


def test_join_request_log_by_request_and_session(tmp_path):
    log = write_jsonl(
        tmp_path / "requests.jsonl",
        [
            {
                "request_id": "r1",
                "session_id": "s1",
                "pte_served": 10.0,
                "pte_reference": 12.0,
                "pte_ideal": 9.0,
            },
            {
                "request_id": "r2",
                "session_id": "s1",
                "pte_served": 5.0,
                "pte_reference": 6.0,
                "pte_ideal": 4.0,
            },
        ],
    )
    recs = [
        parse_record({**GOOD[0], "request_id": "r2"}),
        parse_record({**GOOD[1], "session_id": "s1"}),
        parse_record({**GOOD[2], "request_id": "nope"}),
    ]
    out, problems = join_request_log(recs, log)
    assert (out[0].pte_served, out[0].pte_reference) == (5.0, 6.0)
    assert (out[1].pte_served, out[1].pte_ideal) == (15.0, 13.0)  # the session's sum
    assert out[2].pte_served is None
    assert len(problems) == 1 and "request_id nope" in problems[0].reason


def test_build_tables_arrays():
    recs, _ = check_consistency(
        [parse_record(r, f"x:{k}") for k, r in enumerate(GOOD, 1)]
        + [parse_record({**GOOD[0], "benchmark": "c"})]
    )
    tables = build_tables(recs)
    assert list(tables) == ["b", "c"]
    t = tables["b"]
    assert t.models == ("A", "B") and t.instances == ("1", "2")
    np.testing.assert_array_equal(t.present, [[True, True], [True, False]])
    np.testing.assert_array_equal(t.tokens, [[10, 20], [30, 0]])
    np.testing.assert_array_equal(t.truncated, [[0, 1], [0, 0]])
    np.testing.assert_array_equal(t.workload, [2.0, np.nan])
    # σ_c only where there is a trace; loop audit only for the truncated traced answer:
    # "a b c d a b c d" → 0.2 repeated, 0.4 in the prompt (see test_loop_audit_by_hand)
    assert math.isnan(t.sigma[0, 0]) and t.sigma[0, 1] == 1.0  # 15 bytes compress to > 15
    assert t.loop_repeat[0, 1] == pytest.approx(0.2)
    assert t.loop_overlap[0, 1] == pytest.approx(0.4)
    assert np.isnan(t.loop_repeat[0, 0])


def test_record_dataclass_defaults():
    r = EvalRecord("m", "b", "i", False, 3, True)
    assert r.workload is None and r.trace is None and r.pte_served is None


def join_log_line(rid: str, pte: float, session: str | None = None) -> dict:
    return {
        "request_id": rid,
        "session_id": session,
        "pte_served": pte,
        "pte_reference": pte,
        "pte_ideal": pte,
    }


def test_the_request_log_join_reads_a_gzipped_log_as_report_does(tmp_path):
    """A rotated log is gzipped (requests.jsonl.1.gz): `pte report` reads it, and so must the
    join, by its first bytes rather than its name."""
    import gzip

    text = "".join(json.dumps(join_log_line(r, p)) + "\n" for r, p in (("r1", 10.0), ("r2", 5.0)))
    log = tmp_path / "requests.jsonl.1.gz"
    log.write_bytes(gzip.compress(text.encode()))
    out, problems = join_request_log([parse_record({**GOOD[0], "request_id": "r2"})], log)
    assert out[0].pte_served == 5.0 and problems == []


def test_a_cut_off_last_line_of_a_live_request_log_is_a_problem_and_the_rest_is_joined(tmp_path):
    """A log being written ends mid-line: that line joins nothing and is listed; it does not
    fail the whole command."""
    log = write_jsonl(
        tmp_path / "requests.jsonl", [join_log_line("r1", 10.0), '{"request_id": "r2", "pte_se']
    )
    out, problems = join_request_log([parse_record({**GOOD[0], "request_id": "r1"})], log)
    assert out[0].pte_served == 10.0
    assert [(p.where, "invalid JSON" in p.reason) for p in problems] == [(f"{log}:2", True)]


def test_a_request_id_logged_twice_joins_none_of_its_copies_and_is_named(tmp_path):
    """Two lines with one id (a reused X-Request-Id, a log read with a copy of itself): which
    copy is the answer's is anyone's guess, so the record is joined to neither and both the
    id and the unjoined record are listed."""
    log = write_jsonl(
        tmp_path / "requests.jsonl",
        [join_log_line("r1", 10.0), join_log_line("r2", 3.0), join_log_line("r1", 99.0)],
    )
    recs = [parse_record({**GOOD[0], "request_id": "r1"}), parse_record({**GOOD[1], "request_id": "r2"})]
    out, problems = join_request_log(recs, log)
    assert out[0].pte_served is None and out[1].pte_served == 3.0
    logged_twice, unjoined = problems
    assert "'r1' is logged 2 times (lines 1, 3)" in logged_twice.reason
    assert logged_twice.where == f"{log}:1"
    assert "request_id r1 is logged 2 times" in unjoined.reason and unjoined.action == "kept without PTE"


@pytest.mark.parametrize("field", ["pte_served", "pte_reference", "pte_ideal"])
def test_a_negative_pte_in_the_request_log_is_refused_as_in_a_record(tmp_path, field):
    """A record's own negative PTE is refused; the same value from the log must not become a
    negative PTE per correct answer."""
    log = write_jsonl(
        tmp_path / "requests.jsonl", [{**join_log_line("r1", 10.0), field: -500.0}, join_log_line("r2", 4.0)]
    )
    recs = [parse_record({**GOOD[0], "request_id": "r1"}), parse_record({**GOOD[1], "request_id": "r2"})]
    out, problems = join_request_log(recs, log)
    assert out[0].pte_served is None and out[1].pte_served == 4.0
    assert any(p.where == f"{log}:1" and f"{field} is negative" in p.reason for p in problems)


def test_a_request_log_with_no_usable_line_is_an_error(tmp_path):
    """Nothing to join from: an error naming the first bad line, not a silent no-op."""
    log = write_jsonl(tmp_path / "requests.jsonl", ['{"request_id": "r1", "pte_se'])
    with pytest.raises(RecordError, match=r"no valid request-log lines.*invalid JSON"):
        join_request_log([parse_record({**GOOD[0], "request_id": "r1"})], log)


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_a_jsonl_line_holding_a_unicode_line_separator_is_one_record(tmp_path, separator):
    """json.dumps(ensure_ascii=False) writes U+2028, U+2029 and U+0085 raw inside strings:
    valid JSON on one line, which str.splitlines() would cut in two."""
    rows = [{**GOOD[0], "trace": f"first{separator}second"}, GOOD[2]]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    res = load_records(path)
    assert res.problems == [] and res.rows_read == 2
    assert res.records[0].trace == f"first{separator}second"


def test_a_request_log_line_holding_a_unicode_line_separator_is_joined(tmp_path):
    """The join reads the log's lines as the other request-log readers do: split on newlines
    only."""
    path = tmp_path / "requests.jsonl"
    row = {**join_log_line("r1", 7.0), "note": "a\u2028b"}
    path.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    out, problems = join_request_log([parse_record({**GOOD[0], "request_id": "r1"})], path)
    assert out[0].pte_served == 7.0 and problems == []
