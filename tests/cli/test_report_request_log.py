"""`pte report` on the plugin's request log: told apart from a trajectory log by its lines,
GPU seconds by term, predicted seconds, latency explained, interference share, cost and PTE,
per model and for the top sessions; requests without the step hook counted, never guessed;
bad input one line and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pte_instrument.cli.errors import EXIT_BAD_INPUT
from tests.cli.test_efficiency_cli import run, trajectories_file
from tests.offline.test_request_log import LINES, write_log

PTE = Path(sys.executable).with_name("pte")


def test_json_by_hand_and_stable(tmp_path, capsys):
    path = write_log(tmp_path, LINES)
    code, out, err = run(["report", str(path), "--json"], capsys)
    assert code == 0 and err == ""
    data = json.loads(out)
    assert out == json.dumps(data, indent=2, sort_keys=True) + "\n"  # sorted keys
    assert data["schema"] == "pte-request-log-report/1"
    o = data["overall"]
    assert (o["requests"], o["requests_timed"], o["requests_untimed"], o["requests_priced"]) == (5, 3, 2, 2)
    assert (o["gpu_seconds"], o["predicted_seconds"], o["latency_explained_s"]) == (3.5, 2.75, 6.0)
    assert o["interference_share"] == pytest.approx(2.5 / 6.0) and o["cost_usd"] == 0.375
    b = data["models"]["B"]
    assert b["requests_untimed"] == 2 and b["gpu_seconds"] is None and b["cost_usd"] is None
    assert b["pte_served"] == 430.0
    s = data["sessions"]
    assert s["sort"] == "cost_usd" and s["limit"] == 10
    assert [d["session_id"] for d in s["top"]] == ["s1", "s2", "s3"]
    code2, out2, _ = run(["report", str(path), "--json"], capsys)
    assert code2 == 0 and out2 == out  # byte-identical


def test_limit_and_sort(tmp_path, capsys):
    path = write_log(tmp_path, LINES)
    code, out, _ = run(["report", str(path), "--json", "--sort", "gpu_seconds", "--limit", "1"], capsys)
    assert code == 0
    s = json.loads(out)["sessions"]
    assert (s["count"], s["sort"], s["limit"]) == (3, "gpu_seconds", 1)
    assert [(d["session_id"], d["gpu_seconds"]) for d in s["top"]] == [("s2", 2.0)]


def test_table_by_default(tmp_path, capsys):
    code, out, _ = run(["report", str(write_log(tmp_path, LINES, "requests.jsonl.gz"))], capsys)
    assert code == 0
    assert out.startswith("# Request-log report\n")
    assert (
        "5 requests; 3 with the step hook's seconds (2 without: no GPU seconds, shown as —); 2 priced" in out
    )
    assert "| model | requests | timed | GPU s | prefill s | KV read s | weights s | overhead s |" in out
    assert "| A | 3 | 3 | 3.5 | 1.75 | 0.875 | 0.4375 | 0.4375 | 2.75 | 6 | 0.417 | 2 | 0.375 | 350 |" in out
    assert "| B | 2 | 0 | — | — | — | — | — | — | — | — | 0 | — | 430 |" in out
    assert "## Top sessions by cost_usd (3 of 3)" in out
    assert "| s1 | A | 2 | 2 | 1.5 |" in out
    assert "Requests without a session: 1." in out


def test_bad_lines_warn_and_strict_refuses(tmp_path, capsys):
    path = write_log(tmp_path, LINES, bad=("{oops",))
    code, out, err = run(["report", str(path), "--json"], capsys)
    assert code == 0 and "requests.jsonl:7: invalid JSON" in err and err.startswith("pte report: warning:")
    assert json.loads(out)["input"]["rows_dropped"] == 1
    code, out, err = run(["report", str(path), "--strict"], capsys)
    assert code == EXIT_BAD_INPUT and out == ""
    assert err.count("\n") == 1 and err.startswith("pte report: error: 1 bad request-log line(s)")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--gamma", "0.1"],
            "is a request log, priced by the server; options for trajectory logs only: --gamma",
        ),
        (
            ["--model-dir", "x", "--variant", "ideal"],
            "options for trajectory logs only: --model-dir, --variant",
        ),
        (["--plots", "p"], "options for trajectory logs only: --plots"),
    ],
)
def test_trajectory_options_on_a_request_log_exit_2(tmp_path, capsys, options, message):
    code, out, err = run(["report", str(write_log(tmp_path, LINES)), *options], capsys)
    assert code == EXIT_BAD_INPUT and out == "" and err.count("\n") == 1
    assert err.startswith("pte report: error:") and message in err


def test_request_log_options_on_a_trajectory_log_exit_2(tmp_path, capsys):
    path = trajectories_file(tmp_path)
    code, out, err = run(["report", str(path), "--gamma", "0.01", "--limit", "3"], capsys)
    assert code == EXIT_BAD_INPUT and out == ""
    assert err == f"pte report: error: {path} is a trajectory log; options for request logs only: --limit\n"
    code, out, _ = run(["report", str(path), "--gamma", "0.01", "--json", "--bootstrap", "20"], capsys)
    assert code == 0 and json.loads(out)["settings"] == {"variant": "served", "bootstrap": 20, "seed": 0}


def test_broken_files_exit_2(tmp_path, capsys):
    gz = write_log(tmp_path, LINES, "requests.jsonl.gz")
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gz.read_bytes()[:-12])
    only_bad = write_log(tmp_path, [{"request_id": "x", "model": "A", "pte_served": "?"}], "bad.jsonl")
    gz_traj = tmp_path / "traj.jsonl.gz"
    gz_traj.write_bytes(__import__("gzip").compress(trajectories_file(tmp_path).read_bytes()))
    for path, message in [
        (cut, "corrupt or truncated gzip"),
        (only_bad, "no valid request-log lines"),
        (gz_traj, "a gzipped trajectory log: gunzip it first"),
        (tmp_path / "none.jsonl.gz", "cannot read"),
    ]:
        code, out, err = run(["report", str(path)], capsys)
        assert code == EXIT_BAD_INPUT and out == "", path
        assert err.count("\n") == 1 and err.startswith("pte report: error:") and message in err, err


@pytest.mark.skipif(not PTE.exists(), reason="the pte console script is not installed")
def test_the_console_script(tmp_path):
    good = subprocess.run(
        [str(PTE), "report", str(write_log(tmp_path, LINES)), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert good.returncode == 0 and json.loads(good.stdout)["overall"]["requests"] == 5
    (tmp_path / "bin.jsonl").write_bytes(bytes(range(256)) * 8)
    bad = subprocess.run(
        [str(PTE), "report", str(tmp_path / "bin.jsonl")], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == EXIT_BAD_INPUT and bad.stdout == "" and "Traceback" not in bad.stderr
    assert bad.stderr.count("\n") == 1 and "not UTF-8" in bad.stderr
