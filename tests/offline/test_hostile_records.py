"""Request-log records as anyone could write them: values of the wrong kind or size, fields
missing or unknown, a request logged twice, text that is not Unicode, a line of 100 MB, and
a log that is no regular file. Each bad line is named and left out, and the totals are those
of the good lines, by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pte_instrument.cli.errors import EXIT_BAD_INPUT
from pte_instrument.offline.cost_per_correct import read_request_log
from pte_instrument.offline.records import RecordError, load_records
from pte_instrument.offline.request_log import load_request_log, request_log_report
from tests.cli.test_efficiency_cli import run

PTE = Path(sys.executable).with_name("pte")
TIMED = {
    "gpu_seconds": 1.0,
    "gpu_seconds_prefill": 0.5,
    "gpu_seconds_kv_read": 0.25,
    "gpu_seconds_weights": 0.125,
    "gpu_seconds_overhead": 0.125,
    "predicted_seconds": 0.75,
    "latency_explained_s": 1.5,
    "interference_s": 0.5,
}
# Two good lines: 2.5 + 4.0 PTE, one of them timed (1 GPU second) and priced (0.25 USD).
GOOD = [
    {"request_id": "g1", "model": "A", "session_id": "s", "pte_served": 2.5},
    {"request_id": "g2", "model": "A", "session_id": "s", "pte_served": 4.0, **TIMED, "cost_usd": 0.25},
]


def write(tmp_path: Path, lines: list[str], name: str = "requests.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(x + "\n" for x in lines))
    return path


def good_lines() -> list[str]:
    return [json.dumps(x) for x in GOOD]


def assert_totals_of_the_good_lines(report: dict) -> None:
    o = report["overall"]
    assert (o["requests"], o["requests_timed"], o["requests_priced"]) == (2, 1, 1)
    assert (o["pte_served"], o["gpu_seconds"], o["cost_usd"]) == (6.5, 1.0, 0.25)
    assert o["interference_share"] == 0.5 / 1.5


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ('{"request_id": "b", "model": "A", "pte_served": NaN}', "pte_served is not finite"),
        ('{"request_id": "b", "model": "A", "pte_served": Infinity}', "pte_served is not finite"),
        ('{"request_id": "b", "model": "A", "pte_served": -Infinity}', "pte_served is not finite"),
        ('{"request_id": "b", "model": "A", "pte_served": -3}', "pte_served is negative"),
        ('{"request_id": "b", "model": "A", "pte_served": 1e308}', "pte_served is too large"),
        ('{"request_id": "b", "model": "A", "pte_served": "3"}', "pte_served is not a number"),
        ('{"request_id": "b", "model": "A", "pte_served": true}', "pte_served is not a number"),
        ('{"request_id": "b", "model": "A", "pte_served": {"value": 3}}', "pte_served is not a number"),
        ('{"request_id": "b", "model": ["A"], "pte_served": 3}', "model is not a non-empty string"),
        ('{"request_id": "b", "model": "A", "session_id": {"id": 1}, "pte_served": 3}', "session_id is not"),
        ('{"request_id": "b", "model": "A"}', "missing field 'pte_served'"),
        (
            '{"request_id": "b", "model": "A", "pte_served": 3, "gpu_seconds": true}',
            "gpu_seconds is not a number",
        ),
        ('{"request_id": "b", "model": "A", "pte_served": 3, "pte_served": NaN}', "pte_served is not finite"),
    ],
)
def test_a_hostile_value_is_a_named_problem_and_the_totals_are_the_good_lines(tmp_path, bad, reason):
    path = write(tmp_path, [good_lines()[0], bad, good_lines()[1]])
    load = load_request_log(path)
    [problem] = load.problems
    assert problem.where == f"{path}:2" and reason in problem.reason and problem.action == "dropped"
    report = request_log_report(load)
    assert report["input"]["rows_dropped"] == 1 and report["input"]["rows_read"] == 3
    assert_totals_of_the_good_lines(report)
    json.dumps(report, allow_nan=False)


def test_unknown_fields_and_another_schema_version_are_read_by_the_fields_it_knows(tmp_path):
    newer = {**GOOD[1], "schema_version": 99, "future": {"nested": [1, {"x": None}]}, "engine": "zero"}
    path = write(tmp_path, [json.dumps(GOOD[0]), json.dumps(newer)])
    load = load_request_log(path)
    assert not load.problems
    assert_totals_of_the_good_lines(request_log_report(load))


def test_a_request_logged_twice_is_counted_twice_and_named(tmp_path):
    """Two copies of one request id (a log concatenated with its rotated copy, a client's reused
    X-Request-Id): each may be a request served, so both count, but the report says so."""
    path = write(tmp_path, [*good_lines(), json.dumps(GOOD[0])])
    load = load_request_log(path)
    assert len(load.lines) == 3
    [problem] = load.problems
    assert (problem.where, problem.action) == (f"{path}:1", "kept")
    assert problem.reason == "request_id 'g1' is logged 2 times (lines 1, 3): each copy is counted"
    report = request_log_report(load)
    assert report["overall"]["pte_served"] == 9.0 and report["input"]["rows_dropped"] == 0
    # a kept problem is no bad line: --strict refuses bad lines only
    assert len(load_request_log(path, strict=True).lines) == 3


def test_a_string_that_is_not_unicode_text_is_a_named_problem_not_a_traceback(tmp_path):
    """JSON can spell a lone surrogate (\\ud800), which no UTF-8 output can print: the line is
    left out and named, and the report prints."""
    bad = '{"request_id": "b", "model": "A\\ud800", "session_id": "\\udcff", "pte_served": 3}'
    path = write(tmp_path, [good_lines()[0], bad, good_lines()[1]])
    load = load_request_log(path)
    [problem] = load.problems
    assert problem.where == f"{path}:2" and "invalid JSON (a lone surrogate" in problem.reason
    done = subprocess.run([str(PTE), "report", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "| A | 2 |" in done.stdout


def test_an_evaluation_record_whose_text_is_not_unicode_is_a_named_problem(tmp_path):
    row = {"model": "m", "benchmark": "b", "correct": True, "output_tokens": 3, "truncated": False}
    path = tmp_path / "records.jsonl"
    path.write_text(
        json.dumps({**row, "instance_id": "1"})
        + "\n"
        + json.dumps({**row, "instance_id": "2", "trace": "x"}).replace('"x"', '"\\ud800"')
        + "\n"
    )
    loaded = load_records(path)
    assert [r.instance_id for r in loaded.records] == ["1"]
    [problem] = loaded.problems
    assert problem.where == f"{path}:2" and "invalid JSON (a lone surrogate" in problem.reason


def test_a_line_of_100_mb_is_read_and_the_totals_stay_exact(tmp_path):
    junk = json.dumps({**GOOD[0], "request_id": "big", "pte_served": 1.0, "junk": "x" * 100_000_000})
    path = write(tmp_path, [*good_lines(), junk])
    load = load_request_log(path)
    assert not load.problems and request_log_report(load)["overall"]["pte_served"] == 7.5


def test_a_directory_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    code, out, err = run(["report", str(tmp_path / "logs")], capsys)
    assert code == EXIT_BAD_INPUT and out == ""
    assert err == f"pte report: error: cannot read {tmp_path / 'logs'}: not a file\n"


def test_a_pipe_with_no_writer_is_refused_in_one_line_not_waited_on(tmp_path):
    """A named pipe with no writer would block its reader forever: refused before it is opened,
    the user told to save it to a file."""
    fifo = tmp_path / "requests.jsonl"
    os.mkfifo(fifo)
    done = subprocess.run([str(PTE), "report", str(fifo)], capture_output=True, text=True, timeout=30)
    assert done.returncode == EXIT_BAD_INPUT and done.stdout == ""
    assert (
        done.stderr
        == f"pte report: error: cannot read {fifo}: not a regular file (a pipe?): save it to a file first\n"
    )
    with pytest.raises(RecordError, match="not a regular file"):
        read_request_log(fifo)


def test_a_request_log_through_a_pipe_is_refused_not_taken_for_a_trajectory_log(tmp_path):
    """``pte report <(zcat log.gz)``: the lines of a request log must not be read as something else."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    text = "".join(x + "\n" for x in good_lines())

    def feed() -> None:
        try:
            with fifo.open("w") as f:
                f.write(text)
        except BrokenPipeError:
            pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    done = subprocess.run([str(PTE), "report", str(fifo)], capture_output=True, text=True, timeout=30)
    if writer.is_alive():  # refused without opening it: release the writer
        with fifo.open("r") as f:
            f.read()
    writer.join(timeout=10)
    assert done.returncode == EXIT_BAD_INPUT and "trajectory" not in done.stderr
    assert "not a regular file" in done.stderr and "Traceback" not in done.stderr


def test_a_trajectory_whose_text_is_not_unicode_is_a_named_problem_not_a_traceback(tmp_path):
    rows = [
        '{"model": "m\\ud800", "task": "t", "id": "1", "correct": true, "turns": [{"prompt_tokens": 100, "output_tokens": 10}]}',
        '{"model": "m", "task": "t", "id": "2", "correct": false, "turns": [{"prompt_tokens": 300, "output_tokens": 5}]}',
    ]
    path = write(tmp_path, rows, "traj.jsonl")
    done = subprocess.run(
        [str(PTE), "report", str(path), "--gamma", "0.01", "--bootstrap", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    report = json.loads(done.stdout)
    [problem] = report["input"]["problems"]
    assert problem["where"] == f"{path}:1" and "lone surrogate" in problem["reason"]
    assert report["input"]["rows_used"] == 1
