"""The harness readers and ``pte efficiency`` on outputs the installed harnesses wrote
themselves: an lm-eval run of its offline ``dummy`` model over two local tasks (one with two
repeats and two filters), and Inspect AI runs of its offline mock model (a scorer of several
values, a sample that failed, an evaluation stopped by an error, an archive cut short)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pte_instrument.offline.harness_outputs import load_runs
from pte_instrument.offline.harness_runs import HarnessError, Run
from pte_instrument.prompt_digest import completion_digest

LM_EVAL = Path(sys.executable).with_name("lm_eval")
PTE = Path(sys.executable).with_name("pte")
DOCS = [{"q": "Say lol", "a": "lol"}, {"q": "Say cat", "a": "cat"}, {"q": "Say lol again", "a": "lol"}]
# lm-eval's dummy model answers "lol" to every prompt: documents 0 and 2 are right, 1 wrong.
TWO_FILTERS = """
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
repeats: 2
generation_kwargs:
  until: ["\\n"]
filter_list:
  - name: take_first
    filter:
      - function: take_first
  - name: maj
    filter:
      - function: majority_vote
      - function: take_first
metric_list:
  - metric: exact_match
  - metric: bleu
"""
PLAIN = """
task: tiny_gen2
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: ["\\n"]
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def lm_eval_out(tmp_path_factory) -> Path:
    """``lm_eval --model dummy --log_samples`` over the two tasks, offline; its output directory."""
    root = tmp_path_factory.mktemp("lm_eval")
    tasks = root / "tasks"
    tasks.mkdir()
    data = tasks / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tasks / "tiny_gen.yaml").write_text(TWO_FILTERS.format(data=data))
    (tasks / "tiny_gen2.yaml").write_text(PLAIN.format(data=data))
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(root / "cache"),
    }
    done = subprocess.run(
        [
            *(str(LM_EVAL), "--model", "dummy", "--tasks", "tiny_gen,tiny_gen2"),
            *("--include_path", str(tasks), "--output_path", str(root / "out"), "--log_samples"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return root / "out"


def request_log(path: Path, run: Run, only: int | None = None, **fields: Any) -> Path:
    """One request-log line per call of the run's samples (of its first ``only`` samples),
    sent within its time: 2 output tokens, 10 PTE, 0.5 GPU s and 0.001 USD each, unless
    ``fields`` say otherwise."""
    assert run.started_at is not None
    rows = []
    for s in run.samples[:only]:
        for call in s.calls:
            rows.append(
                {
                    "request_id": f"cmpl-{len(rows)}",
                    "model": run.model,
                    "finish_reason": "stop",
                    "output_tokens": 2,
                    "pte_served": 10.0,
                    "gpu_seconds": 0.5,
                    "cost_usd": 0.001,
                    "arrived_at": run.started_at + 0.5,
                    "finished_at": run.started_at + 1.0,
                    "prompt_digest": call.digest,
                    **fields,
                }
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def strict_json(text: str) -> Any:
    def refuse(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def efficiency(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PTE), "efficiency", *args, "--bootstrap", "20", "--splits", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def per_correct(report: dict, unit: str) -> dict[str, float | None]:
    return {t["task"]: t["cost_per_correct"][unit]["value"] for t in report["cost_per_correct"]["tasks"]}


# =========================================================================== lm-eval


def test_a_real_lm_eval_run_is_read_task_by_task_with_each_repeat_a_call(lm_eval_out):
    [run] = load_runs([lm_eval_out])
    assert run.harness == "lm-eval" and not run.problems
    assert run.metrics == {"tiny_gen": "exact_match", "tiny_gen2": "exact_match"}
    got = sorted((s.task, s.key, s.score, len(s.calls), s.answer) for s in run.samples)
    assert got == [
        ("tiny_gen", "0", 1.0, 2, "lol"),  # its first filter, take_first; two repeats: two requests
        ("tiny_gen", "1", 0.0, 2, "lol"),
        ("tiny_gen", "2", 1.0, 2, "lol"),
        ("tiny_gen2", "0", 1.0, 1, "lol"),
        ("tiny_gen2", "1", 0.0, 1, "lol"),
        ("tiny_gen2", "2", 1.0, 1, "lol"),
    ]
    by_doc = {(s.task, s.sample_id): s for s in run.samples}
    assert {c.digest for c in by_doc[("tiny_gen", "1")].calls} == {completion_digest("Say cat")}
    assert run.started_at is not None and run.ended_at is not None and run.ended_at >= run.started_at


def test_an_lm_eval_filter_one_task_lacks_skips_that_task_as_a_named_problem(lm_eval_out):
    """``--filter maj`` names a filter of tiny_gen only: tiny_gen2 is left out and listed,
    not the whole run refused."""
    [run] = load_runs([lm_eval_out], lm_eval_filter="maj")
    assert run.metrics == {"tiny_gen": "exact_match"}
    assert sorted((s.key, s.score) for s in run.samples) == [("0", 1.0), ("1", 0.0), ("2", 1.0)]
    [problem] = run.problems
    assert problem.benchmark == "tiny_gen2" and problem.where.endswith(".jsonl")
    assert problem.reason == "task 'tiny_gen2' skipped: no sample with filter 'maj' has metric 'exact_match'"


def test_an_lm_eval_metric_that_is_no_score_is_named_per_sample_and_per_task(lm_eval_out):
    """bleu is a corpus metric: lm-eval logs each sample's [reference, answer] under it."""
    [run] = load_runs([lm_eval_out], metric="bleu")
    assert run.samples == () and run.metrics == {"tiny_gen": "bleu"}
    reasons = sorted(p.reason for p in run.problems)
    assert reasons[-1] == "task 'tiny_gen2' skipped: no sample with filter 'none' has metric 'bleu'"
    assert [r.endswith("not a score in [0, 1]") for r in reasons] == [True, True, True, False]
    with pytest.raises(
        HarnessError, match=r"no task with logged samples and a metric \(task 'tiny_gen' skipped"
    ):
        load_runs([lm_eval_out], metric="nope")


def test_the_cost_per_correct_answer_of_a_real_lm_eval_run_by_hand(lm_eval_out, tmp_path):
    [run] = load_runs([lm_eval_out])
    log = request_log(tmp_path / "requests.jsonl", run)
    done = efficiency(str(lm_eval_out), "--request-log", str(log), "--json")
    assert done.returncode == 0, done.stderr
    report = strict_json(done.stdout)
    # tiny_gen: 3 samples × 2 requests × 10 PTE over 2 correct; tiny_gen2: 3 × 1 × 10 over 2
    assert per_correct(report, "pte") == {"tiny_gen": 30.0, "tiny_gen2": 15.0}
    assert per_correct(report, "gpu_seconds") == {"tiny_gen": 1.5, "tiny_gen2": 0.75}
    assert per_correct(report, "output_tokens") == {"tiny_gen": 6.0, "tiny_gen2": 3.0}
    [summary] = report["cost_per_correct"]["runs"]
    assert (summary["samples_joined"], summary["requests_joined"], summary["requests_unmatched"]) == (6, 9, 0)


def test_a_run_with_no_correct_answer_has_no_cost_per_correct_and_its_plots_are_drawn(lm_eval_out, tmp_path):
    wrong = tmp_path / "wrong"
    shutil.copytree(lm_eval_out, wrong)
    for f in wrong.rglob("samples_*.jsonl"):
        f.write_text(f.read_text().replace('"exact_match": 1.0', '"exact_match": 0.0'))
    [run] = load_runs([wrong])
    log = request_log(tmp_path / "requests.jsonl", run)
    done = efficiency(str(wrong), "--request-log", str(log), "--json", "--plots", str(tmp_path / "plots"))
    assert done.returncode == 0, done.stderr
    report = strict_json(done.stdout)
    assert per_correct(report, "pte") == {"tiny_gen": None, "tiny_gen2": None}  # undefined, not inf
    assert [t["correct"] for t in report["cost_per_correct"]["tasks"]] == [0, 0]
    assert (tmp_path / "plots" / "cost_per_correct.png").stat().st_size > 0


def test_one_joined_sample_and_costs_of_zero_are_reported_as_they_are(lm_eval_out, tmp_path):
    """Only the first sample's requests (tiny_gen doc 0: correct, two requests) in the log,
    each free: its cost per correct answer is 0, not undefined; the others are counted."""
    [run] = load_runs([lm_eval_out])
    log = request_log(tmp_path / "requests.jsonl", run, only=1, pte_served=0.0, gpu_seconds=0.0, cost_usd=0.0)
    done = efficiency(str(lm_eval_out), "--request-log", str(log), "--json")
    assert done.returncode == 0, done.stderr
    report = strict_json(done.stdout)
    [task] = report["cost_per_correct"]["tasks"]
    assert (task["task"], task["samples"], task["correct"]) == ("tiny_gen", 1, 1)
    assert {u: v["value"] for u, v in task["cost_per_correct"].items()} == {
        "output_tokens": 4.0,
        "pte": 0.0,
        "gpu_seconds": 0.0,
        "cost_usd": 0.0,
    }
    [summary] = report["cost_per_correct"]["runs"]
    assert summary["samples_unmatched_by_reason"] == {"not in the request log": 5}


def test_joined_samples_that_generated_no_token_keep_their_cost_report(lm_eval_out, tmp_path):
    """Every request answered with no token: nothing for the decomposition (T > 0), but each
    sample was joined and cost what its requests did; not "no sample joined"."""
    [run] = load_runs([lm_eval_out])
    log = request_log(tmp_path / "requests.jsonl", run, output_tokens=0)
    done = efficiency(str(lm_eval_out), "--request-log", str(log), "--json")
    assert done.returncode == 0, done.stderr
    report = strict_json(done.stdout)
    assert per_correct(report, "pte") == {"tiny_gen": 30.0, "tiny_gen2": 15.0}
    assert report["decomposition"]["benchmarks"] == {}
    assert report["decomposition"]["input"]["rows_used"] == 0
    assert "no generated token" in done.stderr


# =========================================================================== Inspect AI


def mock_outputs(n: int) -> list[Any]:
    from inspect_ai.model import ModelOutput, ModelUsage

    # given with their usage: else the mock model counts tokens with a tokenizer it downloads
    outputs = [ModelOutput.from_content("mockllm/model", "Default output") for _ in range(n)]
    for o in outputs:
        o.usage = ModelUsage(input_tokens=3, output_tokens=2, total_tokens=5)
    return outputs


def dataset() -> list[Any]:
    from inspect_ai.dataset import Sample

    return [
        Sample(input="hi", target="Default output", id="a"),
        Sample(input="x", target="zzz", id="b"),
        Sample(input="y", target="Default", id=3),
    ]


def inspect_run(log_dir: Path, task: Any, **options: Any) -> Path:
    from inspect_ai import eval
    from inspect_ai.model import get_model

    eval(
        task,
        model=get_model("mockllm/model", custom_outputs=mock_outputs(12)),
        log_dir=str(log_dir),
        display="none",
        **options,
    )
    [path] = log_dir.glob("*.eval")
    return path


@pytest.fixture(scope="module")
def several_values_log(tmp_path_factory) -> Path:
    """Two epochs, scored by a scorer of two values ({"x": 1, "y": 0}) and by match()."""
    from inspect_ai import Task
    from inspect_ai.scorer import Score, match, mean, scorer
    from inspect_ai.solver import generate

    @scorer(metrics={"x": [mean()], "y": [mean()]})
    def two_values():  # type: ignore[no-untyped-def]
        async def score(state, target):  # type: ignore[no-untyped-def]
            return Score(value={"x": 1.0, "y": 0.0})

        return score

    task = Task(name="multi", dataset=dataset(), solver=generate(), scorer=[two_values(), match()], epochs=2)
    return inspect_run(tmp_path_factory.mktemp("several"), task)


def failing_task() -> Any:
    from inspect_ai import Task
    from inspect_ai.scorer import includes
    from inspect_ai.solver import solver

    @solver
    def fails_on_b():  # type: ignore[no-untyped-def]
        async def solve(state, generate):  # type: ignore[no-untyped-def]
            state = await generate(state)
            if state.sample_id == "b":
                raise RuntimeError("the tool broke")
            return state

        return solve

    return Task(name="errs", dataset=dataset(), solver=fails_on_b(), scorer=includes())


def test_an_inspect_scorer_of_several_values_is_read_by_each_of_them(several_values_log):
    """Inspect names such a scorer's results by its keys (x, y): the first is the default, and
    each can be asked for; the scorer's own name has no one value to read."""
    [run] = load_runs([several_values_log])
    assert run.metrics == {"multi": "x"} and not run.problems
    assert sorted((s.key, s.correct) for s in run.samples) == [
        ("3", True),
        ("3#2", True),
        ("a", True),
        ("a#2", True),
        ("b", True),
        ("b#2", True),
    ]
    [y] = load_runs([several_values_log], metric="y")
    assert {s.correct for s in y.samples} == {False} and len(y.samples) == 6
    [m] = load_runs([several_values_log], metric="match")
    assert sorted(s.key for s in m.samples if s.correct) == ["a", "a#2"]
    [whole] = load_runs([several_values_log], metric="two_values")
    assert whole.samples == () and len(whole.problems) == 6
    assert whole.problems[0].reason.endswith(
        "a score of several values: name one of them with --metric (x, y)"
    )


def test_an_inspect_sample_that_failed_is_named_by_its_error(tmp_path):
    path = inspect_run(tmp_path, failing_task(), fail_on_error=False)
    [run] = load_runs([path])
    assert sorted((s.key, s.correct) for s in run.samples) == [("3", True), ("a", True)]
    [problem] = run.problems
    assert (problem.instance_id, problem.action) == ("b", "dropped")
    assert problem.reason == "the sample failed: RuntimeError('the tool broke')"


def test_an_inspect_evaluation_stopped_by_an_error_gives_the_samples_it_scored(tmp_path):
    """Status "error": no results in the log, but the samples scored before it stopped are
    read, and the log's status is listed."""
    path = inspect_run(tmp_path, failing_task(), fail_on_error=True)
    [run] = load_runs([path])
    assert run.metrics == {"errs": "includes"}
    assert sorted((s.key, s.correct) for s in run.samples) == [("3", True), ("a", True)]
    kept = [p for p in run.problems if p.action == "kept"]
    assert [p.reason for p in kept] == [
        "the evaluation did not finish (status error: RuntimeError('the tool broke'))"
    ]
    assert [p.instance_id for p in run.problems if p.action == "dropped"] == ["b"]


def test_an_eval_archive_cut_short_is_refused_in_one_clear_line(several_values_log, tmp_path):
    cut = tmp_path / "cut.eval"
    cut.write_bytes(several_values_log.read_bytes()[:2000])
    with pytest.raises(HarnessError) as e:
        load_runs([cut])
    assert str(e.value) == (
        f"cannot read Inspect log {cut}: not a whole .eval archive (cut short, or still being written)"
    )
