"""Reading the plugin's request log back: kind detection, line validation, and the sums
(seconds over the timed requests, cost over the priced ones, the rest only counted)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from pte_instrument.offline.records import RecordError
from pte_instrument.offline.request_log import (
    TIMED,
    detect_kind,
    load_request_log,
    parse_line,
    request_log_report,
    resolve_sort,
    totals,
)

TERMS = ("gpu_seconds_prefill", "gpu_seconds_kv_read", "gpu_seconds_weights", "gpu_seconds_overhead")


def line(
    request_id: str,
    model: str,
    session: str | None,
    pte: float,
    seconds: tuple | None = None,
    cost: float | None = None,
    **extra: object,
) -> dict:
    """A request-log line; ``seconds``: (prefill, kv, weights, overhead, predicted, explained)."""
    row: dict = {
        "request_id": request_id,
        "model": model,
        "session_id": session,
        "engine": 0,
        "pte_served": pte,
        "pte_reference": pte,
        "finish_reason": "stop",
    }
    if seconds is None:
        row.update(dict.fromkeys(TIMED), cost_usd=None)
    else:
        *terms, predicted, explained = seconds
        gpu = sum(terms)
        row.update(
            zip(TERMS, terms, strict=True),
            gpu_seconds=gpu,
            predicted_seconds=predicted,
            latency_explained_s=explained,
            interference_s=explained - gpu,
            cost_usd=cost,
        )
    return {**row, **extra}


# Hand-made: model A with the step hook (priced, then a restart without a price), model B
# without it (one line with the fields null, one older line without them at all).
LINES = [
    line("r1", "A", "s1", 100.0, (0.5, 0.25, 0.125, 0.125, 0.75, 1.5), cost=0.25),  # 1.0 GPU s
    line("r2", "A", "s1", 50.0, (0.25, 0.125, 0.0625, 0.0625, 0.5, 2.5), cost=0.125),  # 0.5 GPU s
    line("r3", "A", "s2", 200.0, (1.0, 0.5, 0.25, 0.25, 1.5, 2.0)),  # 2.0 GPU s, no price
    line("r4", "B", None, 30.0),
    {"request_id": "r5", "model": "B", "session_id": "s3", "pte_served": 400.0},
]


def write_log(tmp_path: Path, rows: list, name: str = "requests.jsonl", bad: tuple[str, ...] = ()) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows) + "\n" + "".join(b + "\n" for b in bad)
    path = tmp_path / name
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_the_kind_is_told_by_the_first_json_object(tmp_path):
    assert detect_kind(write_log(tmp_path, LINES)) == "requests"
    assert detect_kind(write_log(tmp_path, LINES, "r.jsonl.gz")) == "requests"
    traj = {"id": "t1", "model": "m", "task": "x", "correct": True, "turns": []}
    assert detect_kind(write_log(tmp_path, [traj], "t.jsonl")) == "trajectories"
    assert (
        detect_kind(write_log(tmp_path, [{"request_id": "r"}], "e.jsonl")) == "trajectories"
    )  # no pte_served
    (tmp_path / "junk.jsonl").write_text("{not json\n" + json.dumps(LINES[0]) + "\n")
    assert detect_kind(tmp_path / "junk.jsonl") == "requests"  # a broken first line is skipped
    with pytest.raises(RecordError, match="cannot read"):
        detect_kind(tmp_path / "missing.jsonl")


def test_totals_by_hand(tmp_path):
    load = load_request_log(write_log(tmp_path, LINES))
    assert load.rows_read == 5 and not load.problems
    t = totals(load.lines).to_dict()
    assert (t["requests"], t["requests_timed"], t["requests_untimed"]) == (5, 3, 2)
    assert (t["requests_priced"], t["requests_unpriced"]) == (2, 3)
    assert t["pte_served"] == 780.0
    assert t["gpu_seconds"] == 3.5
    assert (t["gpu_seconds_prefill"], t["gpu_seconds_kv_read"]) == (1.75, 0.875)
    assert (t["gpu_seconds_weights"], t["gpu_seconds_overhead"]) == (0.4375, 0.4375)
    assert t["predicted_seconds"] == 2.75
    assert t["latency_explained_s"] == 6.0
    assert t["interference_s"] == 2.5  # 0.5 + 2.0 + 0.0
    assert t["interference_share"] == pytest.approx(2.5 / 6.0)
    assert t["cost_usd"] == 0.375
    untimed = totals(r for r in load.lines if r.model == "B").to_dict()
    assert untimed["requests"] == 2 and untimed["requests_timed"] == 0 and untimed["pte_served"] == 430.0
    assert all(untimed[k] is None for k in (*TIMED, "interference_share", "cost_usd"))  # not 0: unknown


def test_the_report_per_model_and_top_sessions(tmp_path):
    load = load_request_log(write_log(tmp_path, LINES))
    rep = request_log_report(load, "auto", limit=10)
    assert rep["schema"] == "pte-request-log-report/1"
    assert list(rep["models"]) == ["A", "B"]
    a = rep["models"]["A"]
    assert (a["requests"], a["requests_timed"], a["requests_priced"]) == (3, 3, 2)
    assert (a["gpu_seconds"], a["cost_usd"], a["pte_served"]) == (3.5, 0.375, 350.0)
    s = rep["sessions"]
    assert (s["count"], s["requests_without_session"], s["sort"]) == (3, 1, "cost_usd")  # auto: priced
    assert [d["session_id"] for d in s["top"]] == ["s1", "s2", "s3"]  # unpriced last, by id
    s1 = s["top"][0]
    assert s1["models"] == ["A"] and s1["requests"] == 2
    assert (s1["gpu_seconds"], s1["cost_usd"], s1["interference_s"]) == (1.5, 0.375, 2.5)
    assert s1["interference_share"] == pytest.approx(2.5 / 4.0)
    by_gpu = request_log_report(load, "gpu_seconds", limit=2)["sessions"]
    assert [d["session_id"] for d in by_gpu["top"]] == ["s2", "s1"] and by_gpu["count"] == 3
    by_pte = request_log_report(load, "pte_served", limit=10)["sessions"]
    assert [d["session_id"] for d in by_pte["top"]] == ["s3", "s2", "s1"]


def test_sort_auto_falls_back_to_seconds_then_pte(tmp_path):
    load = load_request_log(write_log(tmp_path, LINES))
    assert resolve_sort("auto", totals(load.lines[2:3])) == "gpu_seconds"  # timed, unpriced
    assert resolve_sort("auto", totals(load.lines[3:])) == "pte_served"  # no step hook
    assert resolve_sort("pte_served", totals(load.lines)) == "pte_served"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"model": "A", "pte_served": 1}, "missing field 'request_id'"),
        ({"request_id": "r", "pte_served": 1}, "missing field 'model'"),
        ({"request_id": "r", "model": "A", "pte_served": "lots"}, "pte_served is not a number"),
        ({"request_id": "r", "model": "A", "pte_served": True}, "pte_served is not a number"),
        ({"request_id": "r", "model": "A", "pte_served": -1}, "pte_served is negative"),
        ({"request_id": 7, "model": "A", "pte_served": 1}, "request_id is not a non-empty string"),
        (
            {**line("r", "A", None, 1.0, (1, 0, 0, 0, 1, 1)), "gpu_seconds_kv_read": None},
            "missing field 'gpu_seconds_kv_read'",
        ),
        (
            {**line("r", "A", None, 1.0), "latency_explained_s": 2.0},
            "latency_explained_s without gpu_seconds",
        ),
        ({**line("r", "A", None, 1.0), "cost_usd": 0.1}, "cost_usd without gpu_seconds"),
        ({**line("r", "A", None, 1.0, (1, 0, 0, 0, 1, 1)), "gpu_seconds": -1.0}, "gpu_seconds is negative"),
        # past 2**53: no request's figure, and a few such lines sum to infinity
        ({"request_id": "r", "model": "A", "pte_served": 10**400}, "pte_served is too large"),
        ({**line("r", "A", None, 1.0, (1, 0, 0, 0, 1, 1)), "cost_usd": 1e308}, "cost_usd is too large"),
        (
            {**line("r", "A", None, 1.0, (1, 0, 0, 0, 1, 1)), "interference_s": -1e300},
            "interference_s is too large",
        ),
    ],
)
def test_a_bad_line_is_named(row, message):
    with pytest.raises(ValueError, match=message):
        parse_line(row)


def test_interference_may_dip_below_zero_by_rounding():
    r = parse_line(line("r", "A", None, 1.0, (1.0, 0, 0, 0, 1.0, 1.0 - 1e-12)))
    assert r.seconds is not None and r.seconds[TIMED.index("interference_s")] == pytest.approx(-1e-12)


def test_an_interference_share_past_the_largest_float_is_undefined(tmp_path):
    """Latency explained of a subnormal 1e-320 s against 0.5 s of GPU work: the share
    −0.5/1e-320 is −∞, reported as undefined (null), not a JSON error."""
    row = line("r", "A", "s", 1.0, (0.5, 0, 0, 0, 1.0, 1e-320))
    report = request_log_report(load_request_log(write_log(tmp_path, [row])))
    assert report["overall"]["interference_s"] == pytest.approx(-0.5)
    assert report["overall"]["interference_share"] is None
    json.dumps(report, allow_nan=False)


def test_bad_lines_are_dropped_and_listed_or_refused(tmp_path):
    path = write_log(tmp_path, LINES, bad=("{oops", "[1, 2]", json.dumps({"request_id": "x", "model": "A"})))
    load = load_request_log(path)
    assert len(load.lines) == 5 and load.rows_read == 8
    reasons = [(p.where.rsplit(":", 1)[1], p.reason) for p in load.problems]
    assert reasons == [
        ("7", "invalid JSON (Expecting property name enclosed in double quotes)"),
        ("8", "not a JSON object"),
        ("9", "missing field 'pte_served'"),
    ]
    assert load.summary()["rows_dropped"] == 3
    with pytest.raises(RecordError, match=r"3 bad request-log line\(s\); first: .*:7: invalid JSON"):
        load_request_log(path, strict=True)
    only_bad = write_log(
        tmp_path, [], "bad.jsonl", bad=(json.dumps({"request_id": "x", "model": "A", "pte_served": "?"}),)
    )
    with pytest.raises(RecordError, match=r"no valid request-log lines in .*bad\.jsonl; first problem"):
        load_request_log(only_bad)


def test_gzip_is_read_and_a_broken_one_refused(tmp_path):
    plain = request_log_report(load_request_log(write_log(tmp_path, LINES)))
    gz_path = write_log(tmp_path, LINES, "requests.jsonl.gz")
    gz = request_log_report(load_request_log(gz_path))
    assert {k: v for k, v in gz.items() if k != "input"} == {k: v for k, v in plain.items() if k != "input"}
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(gz_path.read_bytes()[:-12])
    with pytest.raises(RecordError, match="corrupt or truncated gzip"):
        load_request_log(truncated)
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps(LINES[0]).encode() + b"\n\xff\xfe\n")
    with pytest.raises(RecordError, match="not UTF-8"):
        load_request_log(tmp_path / "latin1.jsonl")


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_a_request_log_line_holding_a_unicode_line_separator_is_one_line(tmp_path, separator):
    """json.dumps(ensure_ascii=False) writes U+2028, U+2029 and U+0085 raw inside strings:
    the reader splits on newlines only, so such a line is one request."""
    path = tmp_path / "requests.jsonl"
    rows = [{**LINES[3], "session_id": f"s{separator}1"}, LINES[4]]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    load = load_request_log(path)
    assert load.problems == () and [r.session_id for r in load.lines] == [f"s{separator}1", "s3"]
