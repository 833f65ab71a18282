"""The harness readers on outputs written as the harnesses write them: lm-eval's results and
samples files (made here), and an Inspect AI log made by Inspect itself with its offline
mock model."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from pte_instrument.offline.harness_outputs import is_harness_output, load_runs
from pte_instrument.offline.harness_runs import HarnessError
from pte_instrument.prompt_digest import chat_digest, completion_digest

STAMP = "2026-12-05T03-14-20.691863"


def lm_eval_output(
    root: Path, rows: list[dict], model: str = "local-chat-completions", metric_list=("acc", "f1")
) -> Path:
    out = root / "tiny"
    out.mkdir(parents=True)
    results = {
        "results": {"qa": {"acc,none": 0.5}},
        "configs": {"qa": {"task": "qa", "metric_list": [{"metric": m} for m in metric_list]}},
        "config": {"model": model, "model_args": "model=tiny,base_url=http://x/v1/chat/completions"},
        "date": 1000.0,
        "total_evaluation_time_seconds": "99.0",
    }
    (out / f"results_{STAMP}.json").write_text(json.dumps(results))
    (out / f"samples_qa_{STAMP}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def chat_row(doc_id: int, text: str, acc, filter_name: str = "none", repeats: int = 1) -> dict:
    messages = json.dumps([{"role": "user", "content": text}])
    return {
        "doc_id": doc_id,
        "arguments": {"gen_args_0": {"arg_0": [messages], "arg_1": {"max_gen_toks": 8}}},
        "resps": [[f"answer {k}" for k in range(repeats)]],
        "filtered_resps": [f"answer {doc_id}"],
        "filter": filter_name,
        "metrics": ["f1", "acc"],
        "acc": acc,
        "f1": 0.25,
    }


def test_lm_eval_samples_the_primary_metric_the_first_filter_and_each_repeat(tmp_path):
    rows = [
        chat_row(0, "one", 1.0),
        chat_row(0, "one", 0.0, filter_name="strict"),  # the same document under a second filter
        chat_row(1, "two", 0.0, repeats=3),
    ]
    root = lm_eval_output(tmp_path, rows)
    assert is_harness_output(root) and is_harness_output(root / "tiny" / f"results_{STAMP}.json")
    [run] = load_runs([root])
    assert (run.harness, run.model, run.label, run.metrics) == ("lm-eval", "tiny", "tiny", {"qa": "acc"})
    assert run.started_at == 1000.0
    # the file's time in the zone that puts it nearest date + duration (1970 here: UTC+14)
    assert run.ended_at == datetime(2026, 12, 5, 3, 14, 20, 691863, timezone(timedelta(hours=14))).timestamp()
    assert [(s.sample_id, s.score, s.correct, s.answer) for s in run.samples] == [
        ("0", 1.0, True, "answer 0"),
        ("1", 0.0, False, "answer 1"),
    ]
    one = chat_digest([{"role": "user", "content": "one"}])
    two = chat_digest([{"role": "user", "content": "two"}])
    assert [c.digest for c in run.samples[0].calls] == [one]
    assert [c.digest for c in run.samples[1].calls] == [two] * 3  # a repeat is a request of its own
    [strict] = load_runs([root], lm_eval_filter="strict")
    assert [s.score for s in strict.samples] == [0.0]
    [by_f1] = load_runs([root], metric="f1")
    assert [s.correct for s in by_f1.samples] == [False, False]  # partial credit is not a correct answer
    [unlisted] = load_runs([lm_eval_output(tmp_path / "unlisted", rows, metric_list=())])
    assert unlisted.metrics == {"qa": "f1"}  # no metric_list: the first the samples name


def test_lm_eval_completion_prompts_and_bad_scores(tmp_path):
    rows = [
        {"doc_id": 0, "arguments": [["The sky is", {}]], "resps": [["blue"]], "filter": "none", "acc": True},
        {"doc_id": 1, "arguments": [["Two", {}]], "resps": [["x"]], "filter": "none", "acc": 3},
        {"doc_id": 2, "arguments": [["Three", {}]], "resps": [["x"]], "filter": "none"},
    ]
    [run] = load_runs([lm_eval_output(tmp_path, rows, model="local-completions")])
    assert [(s.sample_id, s.correct, s.calls[0].digest) for s in run.samples] == [
        ("0", True, completion_digest("The sky is"))
    ]
    assert ["not a score in [0, 1]" in p.reason for p in run.problems] == [True, False]
    assert "no value of metric 'acc'" in run.problems[1].reason


def test_lm_eval_errors_name_the_file(tmp_path):
    root = lm_eval_output(tmp_path, [chat_row(0, "one", 1.0)])
    with pytest.raises(HarnessError, match="no sample with filter 'none' has metric 'nope'"):
        load_runs([root], metric="nope")
    with pytest.raises(HarnessError, match="no sample with filter 'other'"):
        load_runs([root], lm_eval_filter="other")
    (root / "tiny" / f"samples_qa_{STAMP}.jsonl").unlink()
    with pytest.raises(HarnessError, match="no task with logged samples"):
        load_runs([root])
    (tmp_path / "empty").mkdir()
    with pytest.raises(HarnessError, match="neither an lm-eval output"):
        load_runs([tmp_path / "empty"])
    with pytest.raises(HarnessError, match="no such file"):
        load_runs([tmp_path / "missing"])


def test_lm_eval_json_past_the_json_modules_limits_is_bad_input_not_a_traceback(tmp_path):
    """Nesting past the recursion limit, or an integer past the digit limit, makes the json
    module raise RecursionError or a plain ValueError: a samples line is then a problem, a
    chat prompt one without a digest, and the results file one that cannot be read."""
    deep, digits = "[" * 200_000, "1" + "0" * 5000
    rows = [chat_row(0, "one", 1.0), chat_row(1, "two", 1.0)]
    rows[1]["arguments"]["gen_args_0"]["arg_0"] = [deep]
    root = lm_eval_output(tmp_path, rows)
    samples = root / "tiny" / f"samples_qa_{STAMP}.jsonl"
    samples.write_text(samples.read_text() + deep + "\n" + '{"doc_id": ' + digits + "}\n")
    [run] = load_runs([root])
    assert [(s.sample_id, [c.digest for c in s.calls]) for s in run.samples] == [
        ("0", [chat_digest([{"role": "user", "content": "one"}])]),
        ("1", [None]),
    ]
    assert [p.where.rsplit(":", 1)[1] for p in run.problems] == ["3", "4"]
    (root / "tiny" / f"results_{STAMP}.json").write_text('{"configs": ' + digits + "}")
    with pytest.raises(HarnessError, match="cannot read"):
        load_runs([root])


@pytest.mark.parametrize(
    ("field", "value"),
    [("config", "a string"), ("config", {"model_args": [1, 2]}), ("date", 10**400), ("date", float("inf"))],
    ids=["config-text", "model-args-list", "date-huge", "date-infinite"],
)
def test_an_lm_eval_run_with_a_field_of_the_wrong_kind_reads_as_if_it_were_missing(tmp_path, field, value):
    """A results file's ``config`` or ``model_args`` that is not an object, or a ``date`` that
    is no time (10**400 overflowed a float): the run is read without them."""
    root = lm_eval_output(tmp_path, [chat_row(0, "one", 1.0)])
    results_file = root / "tiny" / f"results_{STAMP}.json"
    results = json.loads(results_file.read_text())
    results_file.write_text(json.dumps({**results, field: value}))
    [run] = load_runs([root])
    assert [s.sample_id for s in run.samples] == ["0"]
    assert run.model == ("tiny" if field == "date" else "unknown")
    assert run.started_at == (None if field == "date" else 1000.0)


def test_two_runs_of_one_model_are_numbered_and_labels_must_fit(tmp_path):
    a = lm_eval_output(tmp_path / "a", [chat_row(0, "one", 1.0)])
    b = lm_eval_output(tmp_path / "b", [chat_row(0, "one", 0.0)])
    assert [r.label for r in load_runs([a, b])] == ["tiny#1", "tiny#2"]
    assert [r.label for r in load_runs([a, b], labels=["short", "long"])] == ["short", "long"]
    with pytest.raises(HarnessError, match="1 label"):
        load_runs([a, b], labels=["one"])


def echo_eval(log_dir: Path, epochs: int = 1) -> Any:
    """Inspect's offline mock model through a task of two samples (sample a's target is in its
    answer "Default output", b's is not), logged to ``log_dir``; the log."""
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample as InspectSample
    from inspect_ai.model import ModelOutput, ModelUsage, get_model
    from inspect_ai.scorer import includes
    from inspect_ai.solver import generate

    # its answers given with their usage (else it counts tokens with a tokenizer it downloads)
    answers = [ModelOutput.from_content("mockllm/model", "Default output") for _ in range(2 * epochs)]
    for a in answers:
        a.usage = ModelUsage(input_tokens=3, output_tokens=2, total_tokens=5)
    task = Task(
        name="echo",
        dataset=[
            InspectSample(input="hi", target="Default output", id="a"),
            InspectSample(input="x", target="zzz", id="b"),
        ],
        solver=generate(),
        scorer=includes(),
        epochs=epochs,
    )
    model = get_model("mockllm/model", custom_outputs=answers)
    [log] = eval(task, model=model, log_dir=str(log_dir), display="none")
    return log


def test_an_inspect_log_gives_samples_by_epoch_with_their_scores(tmp_path):
    log = echo_eval(tmp_path, epochs=2)
    assert log.status == "success"
    [path] = tmp_path.glob("*.eval")
    assert is_harness_output(path) and is_harness_output(tmp_path)
    [run] = load_runs([path])
    assert (run.harness, run.model, run.metrics) == ("inspect", "model", {"echo": "includes"})
    got = sorted((s.key, s.correct, len(s.calls)) for s in run.samples)
    # the mock model answers "Default output": sample a's target is in it, b's is not
    assert got == [("a", True, 1), ("a#2", True, 1), ("b", False, 1), ("b#2", False, 1)]
    assert run.started_at is not None and run.ended_at >= run.started_at
    # the same log in Inspect's JSON format reads the same
    from inspect_ai.log import write_eval_log

    as_json = tmp_path / "json" / "log.json"
    as_json.parent.mkdir()
    write_eval_log(log, str(as_json), format="json")
    [again] = load_runs([as_json.parent])
    assert sorted((s.key, s.correct) for s in again.samples) == [(k, c) for k, c, _ in got]
    with pytest.raises(HarnessError, match="no sample has a score of 'nope'"):
        load_runs([path], metric="nope")


@pytest.fixture(scope="module")
def inspect_json_log(tmp_path_factory) -> dict:
    """An Inspect log of two samples (a scored "C", b "I") by the mock model, as Inspect's
    JSON format holds it: to be changed by hand."""
    from inspect_ai.log import write_eval_log

    tmp = tmp_path_factory.mktemp("inspect")
    log = echo_eval(tmp)
    write_eval_log(log, str(tmp / "log.json"), format="json")
    return json.loads((tmp / "log.json").read_text())


def with_first_score(tmp_path, inspect_json_log: dict, raw: str):
    """The log with sample a's score written as ``raw`` JSON text; its path."""
    log = json.loads(json.dumps(inspect_json_log))
    log["samples"][0]["scores"]["includes"]["value"] = "__score__"
    path = tmp_path / "log.json"
    path.write_text(json.dumps(log).replace('"__score__"', raw))
    return path


@pytest.mark.parametrize("raw", ["2", "-1", "1e300", "NaN", "Infinity", '"2"'])
def test_an_inspect_score_outside_0_1_is_a_problem_not_a_correct_or_wrong_answer(
    tmp_path, inspect_json_log, raw
):
    """2 is no full score of a 0/1 scorer (and NaN no wrong answer): sample a is listed, b kept."""
    path = with_first_score(tmp_path, inspect_json_log, raw)
    [run] = load_runs([path])
    assert [(s.key, s.correct) for s in run.samples] == [("b", False)]
    [problem] = run.problems
    assert problem.where == f"{path}#sample 1" and "not a score in [0, 1]" in problem.reason


@pytest.mark.parametrize("raw", ['"abc"', '"nan"', '"inf"', '""'])
def test_an_inspect_score_inspect_cannot_read_is_a_problem_not_a_wrong_answer(
    tmp_path, inspect_json_log, raw, capfd
):
    """Inspect reads a string it does not know as 0 (a wrong answer), with a warning on stderr:
    the sample is listed instead, and nothing is printed beside the problem."""
    path = with_first_score(tmp_path, inspect_json_log, raw)
    [run] = load_runs([path])
    assert [(s.key, s.correct) for s in run.samples] == [("b", False)]
    [problem] = run.problems
    assert problem.where == f"{path}#sample 1" and "not a score Inspect can read" in problem.reason
    assert "Unable to convert" not in capfd.readouterr().err


@pytest.mark.parametrize(
    ("raw", "correct"), [('"C"', True), ('"yes"', True), ('"0.0"', False), ('"N"', False)]
)
def test_the_strings_inspect_reads_as_scores_stay_scores(tmp_path, inspect_json_log, raw, correct):
    path = with_first_score(tmp_path, inspect_json_log, raw)
    [run] = load_runs([path])
    assert [(s.key, s.correct) for s in run.samples] == [("a", correct), ("b", False)] and not run.problems


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda log: log["samples"][0].update(epoch="x"), "samples.0.epoch: Input should be a valid integer"),
        (lambda log: log["samples"][0]["scores"]["includes"].update(value=None), "samples.0.scores"),
        (lambda log: log.update(eval=[1]), "eval: Input should be"),
    ],
    ids=["epoch-text", "score-null", "eval-list"],
)
def test_an_inspect_log_that_does_not_fit_inspects_schema_is_one_line(
    tmp_path, inspect_json_log, change, message
):
    """Inspect's schema error lists every field on lines of its own: the error is one line."""
    log = json.loads(json.dumps(inspect_json_log))
    change(log)
    path = tmp_path / "log.json"
    path.write_text(json.dumps(log))
    with pytest.raises(HarnessError) as e:
        load_runs([path])
    assert "\n" not in str(e.value) and f"cannot read Inspect log {path}: " in str(e.value)
    assert message in str(e.value)


def test_an_inspect_sample_id_twice_in_one_epoch_drops_both_and_lists_them(tmp_path, inspect_json_log):
    """Which of the two copies counts would be arbitrary (the cost tables counted both, the
    decomposition kept one): both are dropped, each naming the other, as records' duplicates are."""
    log = json.loads(json.dumps(inspect_json_log))
    log["samples"][1]["id"] = "a"
    path = tmp_path / "log.json"
    path.write_text(json.dumps(log))
    [run] = load_runs([path])
    assert run.samples == ()
    assert [(p.where, p.instance_id) for p in run.problems] == [
        (f"{path}#sample 1", "a"),
        (f"{path}#sample 2", "a"),
    ]
    assert f"also at {path}#sample 2" in run.problems[0].reason


def test_a_score_inspect_cannot_read_is_found_whatever_the_logging_configuration(tmp_path, inspect_json_log):
    """The unreadable score is seen through Inspect's warning: it must be seen with warnings
    off, as a user's logging configuration may have them."""
    import logging

    path = with_first_score(tmp_path, inspect_json_log, '"maybe"')
    logging.disable(logging.WARNING)
    try:
        [run] = load_runs([path])
    finally:
        logging.disable(logging.NOTSET)
    assert [s.key for s in run.samples] == ["b"] and "not a score Inspect can read" in run.problems[0].reason
