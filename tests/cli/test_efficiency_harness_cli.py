"""`pte efficiency` on harness outputs through its argparse hook: the cost tables and JSON from
an lm-eval output and a request log made here, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import os

import pytest

from pte_instrument.prompt_digest import chat_digest
from tests.cli.test_efficiency_cli import records_file, run
from tests.offline.test_harness_readers import chat_row, lm_eval_output


def request_line(rid: str, text: str, at: float, tokens: int, reason: str = "stop") -> dict:
    return {
        "request_id": rid,
        "model": "tiny",
        "finish_reason": reason,
        "output_tokens": tokens,
        "pte_served": 10.0 * tokens,
        "finished_at": at + 0.5,
        "arrived_at": at,
        "prompt_digest": chat_digest([{"role": "user", "content": text}]),
        "gpu_seconds": 0.01 * tokens,
        "cost_usd": 1e-5 * tokens,
    }


@pytest.fixture
def evaluation(tmp_path):
    """An lm-eval run of 3 documents (2 correct), the log of its 3 requests and one stranger."""
    root = lm_eval_output(
        tmp_path / "lm", [chat_row(0, "a", 1.0), chat_row(1, "b", 0.0), chat_row(2, "c", 1.0)]
    )
    lines = [
        request_line("r0", "a", 1001, 4),
        request_line("r1", "b", 1002, 8, "length"),
        request_line("r2", "c", 1003, 6),
        request_line("x", "someone else", 1004, 5),  # another client, inside the run's time
    ]
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root, log


def test_the_cost_of_a_correct_answer_from_an_lm_eval_run(evaluation, capsys, tmp_path):
    root, log = evaluation
    code, out, err = run(
        ["efficiency", str(root), "--request-log", str(log), "--json", "--bootstrap", "0"], capsys
    )
    assert code == 0, err
    cost = json.loads(out)["cost_per_correct"]
    [r] = cost["runs"]
    assert (r["samples_joined"], r["requests_joined"], r["requests_in_window"], r["requests_unmatched"]) == (
        3,
        3,
        4,
        1,
    )
    assert "1 of the 4 requests in its window joined to no sample" in err  # said, not only in the JSON
    [t] = cost["tasks"]
    assert t["accuracy"]["value"] == pytest.approx(2 / 3)
    assert t["completion_rate"]["value"] == pytest.approx(2 / 3)  # the wrong answer was cut
    assert t["conditional_correctness"]["value"] == 1
    assert t["cost_per_correct"]["output_tokens"]["value"] == 9  # 18 tokens, 2 correct
    assert t["cost_per_correct"]["gpu_seconds"]["value"] == pytest.approx(0.09)
    assert t["cost_per_correct"]["cost_usd"]["value"] == pytest.approx(9e-5)
    code, out, _ = run(["efficiency", str(root), "--request-log", str(log), "--bootstrap", "0"], capsys)
    assert code == 0 and "Cost per correct answer" in out and "Reasoning-efficiency report" in out


def test_a_digest_key_that_is_not_utf8_joins_as_the_server_keyed_it(evaluation, capsys, monkeypatch):
    root, log = evaluation
    key = b"k\xff"
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    for line, text in zip(lines, "abc", strict=False):
        line["prompt_digest"] = chat_digest([{"role": "user", "content": text}], key)
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    monkeypatch.setenv("PTE_PROMPT_DIGEST_KEY", os.fsdecode(key))
    code, out, err = run(
        ["efficiency", str(root), "--request-log", str(log), "--json", "--bootstrap", "0"], capsys
    )
    assert code == 0, err
    assert json.loads(out)["cost_per_correct"]["runs"][0]["samples_joined"] == 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "harness outputs need --request-log"),
        (["--request-log", "LOG", "--reference", "nobody"], "reference run 'nobody' not among the runs"),
        (["--request-log", "LOG", "--labels", "a,b"], "2 label(s) given for 1 run(s)"),
        (["--request-log", "LOG", "--metric", "nope"], "has metric 'nope'"),
        (["--request-log", "LOG", "--benchmark", "other"], "task 'other' not in the runs"),
        (["--request-log", "MISSING"], "missing.jsonl: No such file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(evaluation, capsys, tmp_path, extra, message):
    root, log = evaluation
    extra = [
        str(log) if x == "LOG" else str(tmp_path / "missing.jsonl") if x == "MISSING" else x for x in extra
    ]
    code, out, err = run(["efficiency", str(root), *extra], capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith("pte efficiency: error:") and message in err
    assert "Traceback" not in err


def test_records_and_harness_outputs_do_not_mix_and_harness_options_need_harness_outputs(
    evaluation, capsys, tmp_path
):
    root, log = evaluation
    records = records_file(tmp_path)
    code, _, err = run(["efficiency", str(root), str(records), "--request-log", str(log)], capsys)
    assert code == 2 and "not a harness output" in err
    code, _, err = run(["efficiency", str(records), "--reference", "B", "--metric", "acc"], capsys)
    assert code == 2 and "--metric applies only to harness outputs" in err
    code, _, err = run(["efficiency", str(records)], capsys)
    assert code == 2 and "--reference is required" in err


def test_a_corrupt_inspect_log_is_one_line(tmp_path, capsys):
    bad = tmp_path / "broken.eval"
    bad.write_bytes(b"not a zip archive")
    log = tmp_path / "requests.jsonl"
    log.write_text(json.dumps(request_line("r", "a", 1, 1)) + "\n")
    code, _, err = run(["efficiency", str(bad), "--request-log", str(log)], capsys)
    assert code == 2 and "cannot read Inspect log" in err and "Traceback" not in err


def test_a_run_given_as_its_folder_and_as_its_results_file_is_refused_as_given_twice(evaluation, capsys):
    """The folder holds the results file: its run would be read twice, the second copy
    finding its requests taken by the first. Told by the files the arguments read, as a
    file given twice by two names is."""
    root, log = evaluation
    [results_file] = root.rglob("results_*.json")
    for twice in ([root, results_file], [results_file, root], [root, root / "tiny"]):
        code, out, err = run(["efficiency", *map(str, twice), "--request-log", str(log)], capsys)
        assert code == 2 and out == "" and "give each input once" in err, err
        assert "Traceback" not in err


def test_folders_that_share_no_file_are_two_inputs_however_they_nest(evaluation, capsys, tmp_path):
    """Only a file read twice is refused: an output beside another inside one folder is not."""
    root, log = evaluation
    other = lm_eval_output(tmp_path / "lm" / "again", [chat_row(0, "a", 1.0)])
    code, _, err = run(["efficiency", str(root / "tiny"), str(other), "--request-log", str(log)], capsys)
    assert code == 0, err
