"""``pte validate`` on a server's logs: the phases it finds in them (hand-computed), and on the
committed latency-bench run, the bench's own figures reproduced from the logs alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pte_instrument.cli.errors import EXIT_BAD_INPUT
from pte_instrument.cli.main import main
from pte_instrument.validation.phases import MIN_ALONE, Phase, merged, phases_of_log, served_alone
from pte_instrument.validation.report import analyse_logs

RUN = Path(__file__).resolve().parents[2] / "bench" / "results" / "latency-tiny-vm-2026-12-01"
N_BOOT = 100


def test_served_alone_is_no_other_request_in_flight():
    # a: 0–1 alone; b, c overlap (2–4, 3–5); d: 5–6 starts as c ends (touching is not overlap);
    # e: 7–10 holds f (8–9) inside it
    arrived = np.array([0.0, 2.0, 3.0, 5.0, 7.0, 8.0])
    finished = np.array([1.0, 4.0, 5.0, 6.0, 10.0, 9.0])
    assert served_alone(arrived, finished).tolist() == [True, False, False, True, False, False]
    # order of the log does not matter
    perm = np.array([5, 2, 0, 4, 1, 3])
    assert served_alone(arrived[perm], finished[perm]).tolist() == [False, False, True, False, False, True]


def test_merged_windows_and_the_steps_they_hold():
    assert merged([(4.0, 5.0), (0.0, 1.0), (0.5, 2.0), (2.0, 3.0)]) == ((0.0, 3.0), (4.0, 5.0))
    p = Phase("x", 2, 0.0, 5.0, windows=((0.0, 3.0), (4.0, 5.0)))
    t = np.array([-1.0, 0.0, 2.9, 3.5, 4.0, 5.0, 5.1])
    assert p.holds_times(t).tolist() == [False, True, True, False, True, True, False]


def test_phases_of_a_log_split_alone_from_under_load():
    n = MIN_ALONE
    # n requests one after another, then three at once
    arrived = np.array([*(2.0 * i for i in range(n)), 100.0, 100.0, 100.5])
    finished = np.array([*(2.0 * i + 1 for i in range(n)), 102.0, 102.0, 101.5])
    ids = [f"r{i}" for i in range(n + 3)]
    alone, load = phases_of_log(ids, arrived, finished)
    assert (alone.name, alone.concurrency, len(alone.request_ids)) == ("alone", 1, n)
    assert alone.windows[0] == (0.0, 1.0) and len(alone.windows) == n
    # under load: 2 + 2 + 1 request-seconds over the 2 s they span: 2.5 in flight → 2
    assert (load.name, load.concurrency, load.request_ids) == ("under-load", 2, frozenset(ids[n:]))
    assert load.windows == ((100.0, 102.0),)
    # too few alone: one phase of everything
    [only] = phases_of_log(ids[n - 2 :], arrived[n - 2 :], finished[n - 2 :])
    assert only.name == "all" and len(only.request_ids) == 5


def test_validate_reproduces_the_benchs_figures_from_the_logs_alone(tmp_path, capsys):
    requests, steps = RUN / "requests.jsonl.gz", RUN / "steps.jsonl.gz"
    code = main(
        [
            "validate",
            str(requests),
            str(steps),
            "--out",
            str(tmp_path),
            "--bootstrap",
            str(N_BOOT),
            "--no-plots",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    report = json.loads((tmp_path / "report.json").read_text())
    assert [p["name"] for p in out["phases"]] == ["alone", "under-load"]
    assert out["targets"] == report["analysis"]["targets"] and len(out["targets"]) >= 8
    assert (tmp_path / "report.md").read_text().startswith("#")

    # the bench's analysis of the same logs, with the phases its driver recorded
    run = json.loads((RUN / "run.json").read_text())
    bench = analyse_logs(requests, steps, [Phase(**p) for p in run["phases"]], n_boot=N_BOOT, seed=0)
    c1 = set(bench.phase_requests["c1"].request_id)
    found = {p["name"]: p for p in out["phases"]}
    # every request the bench ran alone is found alone; hardly any other is
    levels = {(lv["level"], lv["phase"]): lv for lv in report["analysis"]["levels"]}
    alone = levels[("request", "alone")]
    assert found["alone"]["requests"] == alone["n"]
    assert c1 <= set(_ids_alone(requests)) and alone["n"] - len(c1) <= 0.03 * len(c1)
    # and the request-level figures alone fall in the bench's intervals for its c1 phase
    bench_c1 = bench.level("request", "c1")
    for name in ("PTE served", "predicted seconds", "GPU seconds", "output tokens"):
        got = next(m for m in alone["metrics"] if m["name"] == name)["pearson"]
        lo, hi = bench_c1.get(name).corr.pearson_ci
        assert lo <= got <= hi, (name, got, lo, hi)


def _ids_alone(requests: Path) -> list[str]:
    from pte_instrument.validation import analysis as A

    t = A.usable_requests(A.request_table(A.load_jsonl(requests)))
    return [
        r for r, ok in zip(t.request_id, served_alone(t["arrived_at"], t["finished_at"]), strict=True) if ok
    ]


@pytest.mark.parametrize("what", ["missing", "directory", "empty", "not gzip", "torn gzip"])
def test_a_log_that_cannot_be_validated_is_one_line_and_exit_2(tmp_path, capsys, what):
    path = tmp_path / ("requests.jsonl.gz" if "gzip" in what else "requests.jsonl")
    if what == "directory":
        path.mkdir()
    elif what == "empty":
        path.write_text('{"request_id": "a", "finish_reason": "stop"}\nnot json\n')
    elif what == "not gzip":
        path.write_text("plain text under a .gz name\n")
    elif what == "torn gzip":
        path.write_bytes((RUN / "requests.jsonl.gz").read_bytes()[:5000])
    assert main(["validate", str(path), "--out", str(tmp_path / "out")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pte validate: error: ")
    said = {"missing": "no such file", "directory": "a directory, not a log"}
    if what in said:  # says which it is
        assert err[0].endswith(f"{said[what]}: {path}")
    assert not (tmp_path / "out").exists()


def finished_requests(n: int) -> list[dict]:
    """``n`` request-log lines of finished requests, one after another, PTE and time rising."""
    return [
        {
            "request_id": f"r{i}",
            "finish_reason": "stop",
            "inference_s": 1.0 + i,
            "output_tokens": 10 * (i + 1),
            "prompt_tokens": 5,
            "pte_served": 3.0 * (i + 1),
            "arrived_at": 10.0 * i,
            "finished_at": 10.0 * i + 2,
        }
        for i in range(n)
    ]


def validate_json(path: Path, out: Path) -> list[str]:
    """``pte validate`` of ``path`` into ``out``, quick: 10 bootstrap draws, no plots, JSON."""
    return ["validate", str(path), "--out", str(out), "--bootstrap", "10", "--no-plots", "--json"]


def test_lines_and_values_that_are_not_what_the_log_holds_are_skipped_and_counted(tmp_path, capsys):
    """Torn lines, lines that are not objects and fields of the wrong type: each skipped
    (a value read as missing), counted on stderr, the rest validated."""
    path = tmp_path / "requests.jsonl"
    good = finished_requests(4)
    bad = [
        '{"request_id": "x", "finish_reason": "stop", "inference_s": "fast", "prompt_tokens": {"a": 1}}',
        "[1, 2]",
        '{"request_id": "torn", "inference',
    ]
    path.write_text("\n".join([*map(json.dumps, good), *bad]) + "\n")
    assert main(validate_json(path, tmp_path / "out")) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["phases"][0]["requests"] == 4  # "x" has no inference time: not usable
    assert "2 lines skipped (not a JSON object)" in captured.err
    assert "2 values that are not numbers read as missing" in captured.err


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_log_without_the_cost_model_fields_reports_them_unknown_without_numpy_warnings(tmp_path, capsys):
    """A request log of a plugin that logged no γ or HOI (another version, a filtered log):
    the report says they are unknown, and says nothing about all-NaN slices."""
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in finished_requests(4)))
    assert main(validate_json(path, tmp_path / "out")) == 0
    cost_model = json.loads((tmp_path / "out" / "report.json").read_text())["analysis"]["cost_model"]
    assert cost_model["gamma_logged"] is None and cost_model["hoi_logged"] is None


def test_values_no_log_can_hold_are_read_as_missing_and_counted(tmp_path, capsys):
    """Negative tokens, PTE or seconds, and NaN or infinite numbers (a hand-edited or foreign
    log): each read as missing and counted; interference may be negative (queueing counted)."""
    path = tmp_path / "requests.jsonl"
    lines = [{**line, "interference_s": -0.5} for line in finished_requests(5)]
    lines[0]["prompt_tokens"] = -5
    lines[1]["pte_served"] = -1.0
    lines[2]["inference_s"] = -3.0  # no longer usable
    path.write_text(
        "".join(json.dumps(line) + "\n" for line in lines)
        + '{"request_id": "n", "finish_reason": "stop", "inference_s": NaN, "output_tokens": Infinity}\n'
    )
    assert main(validate_json(path, tmp_path / "out")) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["phases"][0]["requests"] == 4
    assert "5 values out of range (negative, not finite, or past 2**53) read as missing" in captured.err
    assert "not numbers" not in captured.err


def test_numbers_past_what_a_log_holds_are_read_as_missing_not_a_traceback(tmp_path, capsys):
    """An integer too large for a float (10**400), one past the interpreter's digit limit
    (a plain ValueError from the json module) and a time of 1e308 (whose sums overflow):
    each read as missing or its line skipped, counted, and the rest validated."""
    path = tmp_path / "requests.jsonl"
    lines = finished_requests(5)
    text = "".join(json.dumps(line) + "\n" for line in lines)
    text = text.replace(f'"prompt_tokens": {lines[0]["prompt_tokens"]}', '"prompt_tokens": 1' + "0" * 400, 1)
    text = text.replace(f'"finished_at": {lines[1]["finished_at"]}', '"finished_at": 1e308', 1)
    path.write_text(text + '{"request_id": "d", "output_tokens": 1' + "0" * 5000 + "}\n")
    assert main(validate_json(path, tmp_path / "out")) == 0
    captured = capsys.readouterr()
    assert "1 line skipped (not a JSON object)" in captured.err
    assert "2 values out of range" in captured.err
