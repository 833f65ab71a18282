"""Hostile options and files given to the ``pte`` subcommands in process: each is a usage error
(exit code 2, one line naming what is wrong), never a traceback, and no output file is lost or
left half-written."""

from __future__ import annotations

import codecs
import csv
import gzip
import io
import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from pte_instrument.cli.errors import EXIT_BAD_INPUT
from pte_instrument.cli.main import main
from pte_instrument.cost.step_time import StepTimeModel

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "steps_small.jsonl"
RUN = Path(__file__).resolve().parents[2] / "bench" / "results" / "latency-tiny-vm-2026-12-01"
BOM = codecs.BOM_UTF8


def records(tmp_path: Path) -> Path:
    rows = [
        {
            "model": m,
            "benchmark": "x",
            "instance_id": f"i{i}",
            "correct": i % 2 == 0,
            "output_tokens": 10 + i + 5 * (m == "b"),
            "finish_reason": "stop",
        }
        for m in ("a", "b")
        for i in range(6)
    ]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trajectories(tmp_path: Path) -> Path:
    path = tmp_path / "trajectories.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"t{i}",
                    "model": "m",
                    "task": "x",
                    "correct": i % 2 == 0,
                    "turns": [{"prompt_tokens": 10, "output_tokens": 5}],
                }
            )
            + "\n"
            for i in range(5)
        )
    )
    return path


def request_log(tmp_path: Path, lines: int = 40) -> Path:
    path = tmp_path / "requests.jsonl"
    with gzip.open(RUN / "requests.jsonl.gz", "rt", encoding="utf-8") as f:
        path.write_text("".join(f.readline() for _ in range(lines)))
    return path


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """argparse's refusal: exit code 2 and its message, no traceback."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == EXIT_BAD_INPUT
    return capsys.readouterr().err


def one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"pte {argv[0]}: error: "), err
    return err[0]


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("command", ["efficiency", "report", "calibrate", "validate"])
def test_a_negative_seed_is_a_usage_error(tmp_path, capsys, command):
    argv = {
        "efficiency": ["efficiency", str(records(tmp_path)), "--reference", "a"],
        "report": ["report", str(trajectories(tmp_path)), "--gamma", "0.1"],
        "calibrate": ["calibrate", str(FIXTURE)],
        "validate": ["validate", str(request_log(tmp_path)), "--out", str(tmp_path / "out"), "--no-plots"],
    }[command]
    assert "--seed" in usage_error([*argv, "--seed", "-1"], capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "option",
    [
        ("efficiency", "--bootstrap", "100000000000000000000"),
        ("efficiency", "--splits", "100000000000000000000"),
        ("report", "--bootstrap", "100000000000000000"),
    ],
)
def test_resamples_past_the_cap_are_a_usage_error(tmp_path, capsys, option):
    command, flag, value = option
    argv = {
        "efficiency": ["efficiency", str(records(tmp_path)), "--reference", "a", "--workload", "solver"],
        "report": ["report", str(trajectories(tmp_path)), "--gamma", "0.1"],
    }[command]
    assert flag in usage_error([*argv, flag, value], capsys)


def test_a_gamma_too_large_to_price_with_is_a_usage_error(tmp_path, capsys):
    argv = ["report", str(trajectories(tmp_path)), "--gamma", "1e308", "--json"]
    assert "--gamma" in usage_error(argv, capsys)


@pytest.mark.parametrize(
    "option", [("--port", "-1"), ("--port", "65536"), ("--sessions", "0"), ("--turns", "-1")]
)
def test_demo_refuses_bad_numbers_before_it_builds_or_starts_anything(monkeypatch, capsys, option):
    import pte_instrument.devtools.demo as demo

    def never(**_: object) -> int:
        raise AssertionError("the demo ran")

    monkeypatch.setattr(demo, "run_demo", never)
    assert option[0] in usage_error(["demo", *option], capsys)


def test_demo_refuses_replicas_whose_ports_run_past_65535(monkeypatch, capsys):
    import pte_instrument.devtools.demo as demo

    def never(**_: object) -> int:
        raise AssertionError("the demo ran")

    monkeypatch.setattr(demo, "run_demo", never)
    err = one_line_error(["demo", "--port", "65535", "--replicas", "2"], capsys)
    assert "--port" in err


# --------------------------------------------------------------------------- output paths


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_validate_out_that_cannot_be_a_folder_is_one_line_and_exit_2(tmp_path, capsys, where):
    log = request_log(tmp_path)
    blocker = tmp_path / "blocker"
    blocker.write_text("keep me\n")
    out = blocker if where == "a file" else blocker / "sub"
    err = one_line_error(["validate", str(log), "--out", str(out), "--no-plots", "--bootstrap", "10"], capsys)
    assert str(out) in err
    assert blocker.read_text() == "keep me\n"


def test_validate_refuses_to_write_its_report_over_a_log_it_reads(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    log = out / "report.json"
    log.write_text(request_log(tmp_path).read_text())
    before = log.read_bytes()
    err = one_line_error(["validate", str(log), "--out", str(out), "--no-plots", "--bootstrap", "10"], capsys)
    assert str(log) in err
    assert log.read_bytes() == before


def test_calibrate_refuses_to_save_over_the_step_log_it_reads(tmp_path, capsys):
    steps = tmp_path / "steps.jsonl"
    steps.write_bytes(FIXTURE.read_bytes())
    err = one_line_error(["calibrate", str(steps), "--bootstrap", "0", "--save", str(steps)], capsys)
    assert str(steps) in err
    assert steps.read_bytes() == FIXTURE.read_bytes()


def test_calibrate_save_with_an_empty_path_is_a_usage_error_naming_it(capsys):
    err = usage_error(["calibrate", str(FIXTURE), "--bootstrap", "0", "--save", ""], capsys)
    assert "--save" in err and "an empty path" in err, err


def test_calibrate_save_that_fails_midway_leaves_the_previous_model_whole(tmp_path):
    saved = tmp_path / "fit.json"
    argv = [sys.executable, "-m", "pte_instrument.cli.main", "calibrate", str(FIXTURE), "--bootstrap", "0"]
    subprocess.run([*argv, "--save", str(saved)], check=True, capture_output=True, timeout=120)
    before = saved.read_bytes()
    saved.write_bytes(before.replace(b"fit: 40 steps", b"fit: an earlier run"))
    before = saved.read_bytes()

    def small_files() -> None:  # writes past 64 bytes fail (EFBIG; Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))

    r = subprocess.run(
        [*argv, "--save", str(saved)], capture_output=True, text=True, timeout=120, preexec_fn=small_files
    )
    assert r.returncode == EXIT_BAD_INPUT and "Traceback" not in r.stderr, r.stderr
    assert saved.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fit.json"]  # no temporary file left behind
    StepTimeModel.load(saved)


# --------------------------------------------------------------------------- a byte-order mark


def test_calibrate_reads_a_csv_with_a_byte_order_mark(tmp_path, capsys):
    rows = [
        {"prefill_tokens": p, "ctx": c, "dt_s": 1e-3 + 1e-4 * p + 1e-7 * c}
        for p in (0, 64)
        for c in (10, 99, 999, 5000)
    ]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    path = tmp_path / "steps.csv"
    path.write_bytes(BOM + buf.getvalue().encode())
    assert main(["calibrate", str(path), "--bootstrap", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["input"]["usable_steps"] == len(rows)


def test_calibrate_reads_a_step_log_with_a_byte_order_mark(tmp_path, capsys):
    path = tmp_path / "steps.jsonl"
    path.write_bytes(BOM + FIXTURE.read_bytes())
    assert main(["calibrate", str(path), "--bootstrap", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["input"]["format"] == "step-log"


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_efficiency_reads_records_with_a_byte_order_mark(tmp_path, capsys, suffix):
    plain = records(tmp_path)
    rows = [json.loads(line) for line in plain.read_text().splitlines()]
    if suffix == ".csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
        text = buf.getvalue()
    else:
        text = plain.read_text()
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(BOM + text.encode())
    argv = ["efficiency", str(path), "--reference", "a", "--bootstrap", "0", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert json.loads(out)["input"]["rows_used"] == len(rows)


def test_report_reads_a_trajectory_log_with_a_byte_order_mark(tmp_path, capsys):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(BOM + trajectories(tmp_path).read_bytes())
    assert main(["report", str(path), "--gamma", "0.1", "--bootstrap", "0", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert json.loads(out)["input"]["rows_used"] == 5


@pytest.mark.parametrize("gz", [False, True])
def test_report_reads_a_request_log_with_a_byte_order_mark(tmp_path, capsys, gz):
    data = BOM + request_log(tmp_path).read_bytes()
    path = tmp_path / ("bom.jsonl.gz" if gz else "bom.jsonl")
    path.write_bytes(gzip.compress(data) if gz else data)
    assert main(["report", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert json.loads(out)["input"]["rows_used"] == 40


def test_validate_reads_a_request_log_with_a_byte_order_mark(tmp_path, capsys):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(BOM + request_log(tmp_path).read_bytes())
    argv = ["validate", str(path), "--out", str(tmp_path / "out"), "--no-plots", "--bootstrap", "10"]
    assert main([*argv, "--json"]) == 0
    assert "skipped" not in capsys.readouterr().err


# --------------------------------------------------------------------------- naming the input


@pytest.mark.parametrize("which", ["request log", "step log"])
def test_validate_names_the_log_that_is_torn_gzip(tmp_path, capsys, which):
    torn = tmp_path / "torn.jsonl.gz"
    torn.write_bytes((RUN / "steps.jsonl.gz").read_bytes()[:5000])
    logs = [str(torn)] if which == "request log" else [str(request_log(tmp_path)), str(torn)]
    argv = ["validate", *logs, "--out", str(tmp_path / "out"), "--no-plots", "--bootstrap", "10"]
    assert str(torn) in one_line_error(argv, capsys)


def corrupt_gzip(tmp_path: Path) -> Path:
    """A whole gzip file with bytes of its deflate stream changed: zlib.error, not EOFError."""
    data = bytearray((RUN / "steps.jsonl.gz").read_bytes())
    for k in range(200, 260):
        data[k] ^= 0xFF
    path = tmp_path / "corrupt.jsonl.gz"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("which", ["request log", "step log"])
def test_validate_names_the_log_whose_gzip_is_corrupt(tmp_path, capsys, which):
    bad = corrupt_gzip(tmp_path)
    logs = [str(bad)] if which == "request log" else [str(request_log(tmp_path)), str(bad)]
    argv = ["validate", *logs, "--out", str(tmp_path / "out"), "--no-plots", "--bootstrap", "10"]
    assert str(bad) in one_line_error(argv, capsys)


def test_calibrate_names_the_step_log_whose_gzip_is_corrupt(tmp_path, capsys):
    bad = corrupt_gzip(tmp_path)
    assert str(bad) in one_line_error(["calibrate", str(bad)], capsys)


def test_paths_that_look_like_markup_are_printed_as_they_are(tmp_path, capsys):
    """``[/x]`` in a path is text, not a closing tag of rich's markup (which raised)."""
    odd = tmp_path / "d[" / "x]"
    odd.mkdir(parents=True)
    steps = odd / "steps.jsonl.gz"
    steps.write_bytes((RUN / "steps.jsonl.gz").read_bytes())
    assert main(["calibrate", str(steps), "--bootstrap", "0"]) == 0
    assert str(steps) in "".join(capsys.readouterr().out.split())  # the title wraps where it may
    out = tmp_path / "out[" / "y]"
    assert (
        main(["validate", str(request_log(tmp_path)), "--out", str(out), "--no-plots", "--bootstrap", "10"])
        == 0
    )
    assert str(out) in "".join(capsys.readouterr().out.split())
