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


STEP_HEADER = {
    "engine": 0,
    "gammas": [0.002],
    "windows": [None],
    "n_active": 1e9,
    "n_total": 1e9,
    "hoi": 295.0,
    "device": "h100-sxm",
    "weights_pte": 295.0,
    "header": True,
}


def step_lines(requests: list[dict], per_request: int = 4) -> list[dict]:
    """``per_request`` decode steps inside each request's time, the context growing."""
    return [
        {
            "engine": 0,
            "step": k + i * per_request,
            "t": r["arrived_at"] + 0.1 + 0.4 * k,
            "n_reqs": 1,
            "tokens": 1,
            "prefill": 0,
            "recompute": 0,
            "decode_tokens": 1,
            "spec_tokens": 0,
            "ctx": [100.0 * (k + 1) + 7 * i],
            "pte": 0.2 * (k + 1),
            "roofline_pte": 295.2,
            "weights_pte": 295.0,
            "hook_s": 1e-6,
            "dt_s": 0.007 + 0.00001 * (k + 1) + 0.000001 * i,
            "model_s": None,
        }
        for i, r in enumerate(requests)
        for k in range(per_request)
    ]


def write_logs(tmp_path: Path, header: dict | None, steps_name: str = "steps.jsonl") -> tuple[Path, Path]:
    requests = finished_requests(6)
    req_path, steps_path = tmp_path / "requests.jsonl", tmp_path / steps_name
    req_path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    lines = ([header] if header is not None else []) + step_lines(requests)
    steps_path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return req_path, steps_path


def validate_steps_json(requests: Path, steps: Path, out: Path) -> list[str]:
    return [
        "validate",
        str(requests),
        str(steps),
        "--out",
        str(out),
        "--bootstrap",
        "10",
        "--no-plots",
        "--json",
    ]


@pytest.mark.parametrize(
    "change",
    [
        {"gammas": "0.002"},
        {"gammas": 0.002},
        {"gammas": [None]},
        {"n_active": "big"},
        {"n_active": None},
        {"hoi": 0},
        {"n_total": -1.0},
        {"gammas": [-0.002]},
        {"windows": [None, None]},
        {"gammas": []},
    ],
)
def test_a_step_log_header_of_the_wrong_types_or_shape_is_ignored_with_a_warning(tmp_path, capsys, change):
    """The header says the cost model the steps were priced with; one whose fields are of the
    wrong type or shape (as `pte calibrate` checks it) is ignored, in a warning that says so:
    the steps are still validated, without it."""
    requests, steps = write_logs(tmp_path, {**STEP_HEADER, **change})
    assert main(validate_steps_json(requests, steps, tmp_path / "out")) == 0
    err = capsys.readouterr().err
    assert "pte validate: warning: the step log's header is not of the types or shape" in err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert "step_log_header" not in report["analysis"]["cost_model"]


def test_a_good_step_log_header_is_read_without_a_warning(tmp_path, capsys):
    """The hand-made logs above are good but for the header each case changes."""
    requests, steps = write_logs(tmp_path, STEP_HEADER)
    assert main(validate_steps_json(requests, steps, tmp_path / "out")) == 0
    assert "warning" not in capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["analysis"]["cost_model"]["step_log_header"]["gammas"] == [0.002]


@pytest.mark.parametrize("name", ["steps**.jsonl", "steps[0].jsonl", "steps?.jsonl"])
def test_a_step_log_whose_name_has_glob_characters_is_read_with_its_other_engines(tmp_path, name):
    """The other engines' logs are found as ``<name>.engine<N>``: the name is a name, not a
    pattern (``**`` inside it is refused by pathlib, ``[0]`` matches no file named so)."""
    from pte_instrument.validation import analysis as A

    _, steps = write_logs(tmp_path, STEP_HEADER, name)
    (tmp_path / (name + ".engine1")).write_text(steps.read_text())
    (tmp_path / "steps0.jsonl.engine1").write_text(steps.read_text() * 2)  # what [0] would match
    table = A.load_steps(steps)
    assert table is not None and len(table) == 2 * 6 * 4


def test_a_turn_number_too_large_for_a_count_is_read_as_missing_and_counted(tmp_path, capsys):
    """A turn of 1e300 (or 10**30) is no turn any session had; read as no turn, counted like
    any other value out of range, not an OverflowError."""
    path = tmp_path / "requests.jsonl"
    lines = [{**line, "session_id": "s", "turn": i + 1} for i, line in enumerate(finished_requests(5))]
    lines[1]["turn"] = 1e300
    lines[2]["turn"] = 10**30
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(validate_json(path, tmp_path / "out")) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["phases"][0]["requests"] == 5
    assert "2 values out of range (negative, not finite, or past 2**53) read as missing" in captured.err


def test_a_turn_number_far_past_the_others_is_one_column_not_a_huge_matrix(tmp_path, capsys):
    """Turn 10**12 is within 2**53 but no session had as many turns: the turn level holds a
    column per turn number present, not one per number up to it (22 TiB here)."""
    path = tmp_path / "requests.jsonl"
    lines = [
        {**line, "session_id": f"s{i % 3}", "turn": i // 3 + 1}
        for i, line in enumerate(finished_requests(12))
    ]
    lines[4]["turn"] = 10**12
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(validate_json(path, tmp_path / "out")) == 0
    profiles = json.loads((tmp_path / "out" / "report.json").read_text())["analysis"]["turn_profiles"]
    assert [p["turn"] for p in profiles.values()] == [[1, 2, 3, 4, 10**12]]
