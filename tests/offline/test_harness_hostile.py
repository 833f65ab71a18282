"""The harness readers on outputs as a hostile tester would hand them over: a run analysed in
another time zone than it ran in, task names that are glob patterns, metric lists of the
wrong JSON type, a folder of both harnesses' outputs, and a records file that looks like an
Inspect log at first sight."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from pte_instrument.offline.harness_outputs import is_harness_output, load_runs
from pte_instrument.offline.records import load_records
from tests.offline.test_harness_readers import STAMP, chat_row, echo_eval, lm_eval_output

# The wall-clock time lm-eval's results file is named by (its STAMP), on the evaluating machine.
WRITTEN = datetime(2026, 12, 5, 3, 14, 20, 691863)


def lm_eval_tasks(root: Path, tasks: dict[str, list[dict]], configs: dict[str, Any] | None = None) -> Path:
    """An lm-eval output of several tasks (each with its samples file); ``configs``: the
    results file's, in place of one listing ``acc`` per task."""
    out = root / "tiny"
    out.mkdir(parents=True)
    results = {
        "results": {t: {"acc,none": 0.5} for t in tasks},
        "configs": configs or {t: {"task": t, "metric_list": [{"metric": "acc"}]} for t in tasks},
        "config": {"model": "local-chat-completions", "model_args": "model=tiny"},
        "date": 1000.0,
    }
    (out / f"results_{STAMP}.json").write_text(json.dumps(results))
    for task, rows in tasks.items():
        (out / f"samples_{task}_{STAMP}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def with_times(root: Path, date: float | None, total: Any) -> Path:
    """The results file under ``root`` with its ``date`` and ``total_evaluation_time_seconds``
    set (None: left out)."""
    path = root / "tiny" / f"results_{STAMP}.json"
    results = json.loads(path.read_text())
    results.pop("date"), results.pop("total_evaluation_time_seconds", None)
    if date is not None:
        results["date"] = date
    if total is not None:
        results["total_evaluation_time_seconds"] = total
    path.write_text(json.dumps(results))
    return root


@pytest.fixture
def zone(monkeypatch) -> Iterator[Callable[[str], None]]:
    """Set the analysing machine's time zone (the process's ``TZ``); restored afterwards."""

    def set_zone(name: str) -> None:
        monkeypatch.setenv("TZ", name)
        time.tzset()

    yield set_zone
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize("offset", [timedelta(0), timedelta(hours=5, minutes=45), timedelta(hours=-9.5)])
def test_an_lm_eval_runs_end_is_the_same_in_every_time_zone_it_is_analysed_in(tmp_path, zone, offset):
    """lm-eval names its results file by the evaluating machine's clock, in its zone (UTC, or
    Nepal's +5:45, or the Marquesas' −9:30 here); the run's start and duration in the file
    fix that zone, so the end does not move with the zone of the machine reading it."""
    end = WRITTEN.replace(tzinfo=timezone(offset)).timestamp()
    root = lm_eval_output(tmp_path, [chat_row(0, "one", 1.0)])
    # started 20 minutes before the file was written; the duration counts a little more (model loading)
    with_times(root, end - 1200.0, "1203.5")
    ends = {}
    for name in ("UTC", "Europe/Berlin", "Asia/Tokyo"):
        zone(name)
        [run] = load_runs([root])
        ends[name] = run.ended_at
    assert time.localtime(end).tm_gmtoff == 9 * 3600  # the zone did change: Tokyo, at last
    assert ends == dict.fromkeys(ends, pytest.approx(end, abs=1e-3))


@pytest.mark.parametrize(
    ("date", "total", "expected"),
    [
        (None, "60", WRITTEN.replace(tzinfo=timezone(timedelta(hours=-12))).timestamp()),
        (
            WRITTEN.replace(tzinfo=timezone.utc).timestamp(),
            None,
            WRITTEN.replace(tzinfo=timezone(timedelta(hours=-12))).timestamp(),
        ),
        (WRITTEN.replace(tzinfo=timezone.utc).timestamp() + 15 * 3600, "60", None),
        (
            WRITTEN.replace(tzinfo=timezone.utc).timestamp() - 60,
            "a minute",
            WRITTEN.replace(tzinfo=timezone(timedelta(hours=-12))).timestamp(),
        ),
    ],
    ids=["no-start", "no-duration", "start-after-every-reading", "duration-not-a-number"],
)
def test_an_lm_eval_run_without_start_and_duration_ends_at_the_latest_time_its_name_can_mean(
    tmp_path, zone, date, total, expected
):
    """Without both to fix the zone, the stamp read at UTC−12 (the latest of every zone's
    reading) is an end the run's requests all come before; a start after every reading makes
    the end unknown. None of it depends on the analysing machine's zone."""
    root = with_times(lm_eval_output(tmp_path, [chat_row(0, "one", 1.0)]), date, total)
    for name in ("UTC", "Asia/Tokyo"):
        zone(name)
        [run] = load_runs([root])
        assert run.ended_at == (None if expected is None else pytest.approx(expected, abs=1e-3))


@pytest.mark.parametrize(
    "wrong", ["qa**", "qa[1]", "qa?", "x[ab]"], ids=["double-star", "brackets", "question-mark", "a-set"]
)
def test_an_lm_eval_task_named_like_a_glob_pattern_reads_its_own_samples_file(tmp_path, wrong):
    """A task's samples file is found by its exact name: a glob character in a task's name
    neither breaks the reading nor gives it another task's samples (``x[ab]`` matches ``xa``)."""
    tasks = {
        wrong: [chat_row(0, "one", 0.0), chat_row(1, "two", 0.0)],
        "xa": [chat_row(0, "one", 1.0)],
        "qa1": [chat_row(0, "one", 1.0)],
        "qaz": [chat_row(0, "one", 1.0)],
    }
    [run] = load_runs([lm_eval_tasks(tmp_path, tasks)])
    assert sorted(run.metrics) == sorted(tasks)
    assert [(s.sample_id, s.correct) for s in run.samples if s.task == wrong] == [("0", False), ("1", False)]


def test_an_lm_eval_task_name_that_is_a_path_finds_no_samples_file_outside_the_output(tmp_path):
    """The samples file lies beside its results file: a task named like a path to elsewhere
    (through a folder ``samples_x``) reads nothing from there."""
    root = lm_eval_tasks(tmp_path / "lm", {"qa": [chat_row(0, "one", 1.0)]})
    (root / "tiny" / "samples_x").mkdir()
    (root / "other").mkdir()
    (root / "other" / f"y_{STAMP}.jsonl").write_text(json.dumps(chat_row(0, "one", 1.0)) + "\n")
    results_file = root / "tiny" / f"results_{STAMP}.json"
    results = json.loads(results_file.read_text())
    results["configs"]["x/../../other/y"] = {"metric_list": [{"metric": "acc"}]}
    results_file.write_text(json.dumps(results))
    [run] = load_runs([root])
    assert run.metrics == {"qa": "acc"}
    [problem] = run.problems
    assert (
        problem.reason == "task 'x/../../other/y' skipped: no samples file (run lm_eval with --log_samples)"
    )


@pytest.mark.parametrize(
    "metric_list",
    [5, True, "acc", {"metric": "f1"}, [{"metric": ["f1"]}], [{"metric": {"x": 1}}], [{"metric": None}]],
    ids=["number", "true", "string", "object", "metric-list", "metric-object", "metric-null"],
)
def test_an_lm_eval_metric_list_of_the_wrong_json_type_lists_no_metric(tmp_path, metric_list):
    """A ``metric_list`` that is not a list, or an entry whose ``metric`` is not a name: no
    metric is listed there, and the task is scored by the first metric its samples name."""
    root = lm_eval_output(tmp_path, [chat_row(0, "one", 1.0)])
    results_file = root / "tiny" / f"results_{STAMP}.json"
    results = json.loads(results_file.read_text())
    results["configs"]["qa"]["metric_list"] = metric_list
    results_file.write_text(json.dumps(results))
    [run] = load_runs([root])
    assert run.metrics == {"qa": "f1"}  # chat_row's samples name f1 first
    assert [(s.sample_id, s.score) for s in run.samples] == [("0", 0.25)]


def test_a_folder_of_lm_eval_outputs_and_inspect_logs_gives_the_runs_of_both(tmp_path):
    """Neither harness's outputs hide the other's: every run in the folder is read, lm-eval's
    first."""
    lm_eval_output(tmp_path / "evals", [chat_row(0, "one", 1.0), chat_row(1, "two", 0.0)])
    echo_eval(tmp_path / "evals" / "inspect")
    runs = load_runs([tmp_path / "evals"])
    assert [(r.harness, r.model, len(r.samples)) for r in runs] == [
        ("lm-eval", "tiny", 2),
        ("inspect", "model", 2),
    ]


def record(model: str, i: int) -> dict[str, Any]:
    return {
        "model": model,
        "benchmark": "b",
        "instance_id": f"i{i}",
        "correct": i % 2 == 0,
        "output_tokens": 100 + i,
        "truncated": False,
        "status": "ok",
        "version": "1.2",
    }


@pytest.mark.parametrize("form", ["array", "lines"])
def test_a_json_records_file_with_status_and_version_fields_is_records_not_an_inspect_log(tmp_path, form):
    """An Inspect log is one JSON object whose own keys include ``version``, ``status`` and
    ``eval``: records that carry a status and a version, as an array or as lines, are none."""
    rows = [record(m, i) for m in ("ref", "new") for i in range(3)]
    path = tmp_path / "records.json"
    path.write_text(json.dumps(rows) if form == "array" else "".join(json.dumps(r) + "\n" for r in rows))
    assert not is_harness_output(path) and not is_harness_output(tmp_path)
    assert len(load_records([path]).records) == 6


def test_an_inspect_log_is_told_by_its_own_keys_not_by_a_nested_objects(tmp_path):
    """``version`` and ``status`` inside a record's nested object make no Inspect log; in the
    log itself, with Inspect's indentation or none, they do."""
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps({"meta": {"version": 2, "status": "success", "eval": {}}, "eval": {}}))
    assert not is_harness_output(nested)
    for indent in (None, 2):
        log = tmp_path / f"log{indent}.json"
        log.write_text(json.dumps({"version": 2, "status": "success", "eval": {"task": "t"}}, indent=indent))
        assert is_harness_output(log)
