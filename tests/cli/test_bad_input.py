"""Hostile inputs to the real `pte` console script: each ends in one line on stderr and
exit code 2 (the convention of pte_instrument.cli.errors), never a traceback."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pte_instrument.cli.errors import EXIT_BAD_INPUT
from tests.cost.test_architecture import FIX

PTE = Path(sys.executable).with_name("pte")
DEEP = "[" * 200_000  # past Python's recursion limit in the json module


def write(tmp_path: Path, name: str, content: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


def config_with(field: str, literal: str) -> str:
    text = json.dumps(json.loads((FIX / "dense_mha.json").read_text()))
    value = json.dumps(json.loads((FIX / "dense_mha.json").read_text())[field])
    return text.replace(f'"{field}": {value}', f'"{field}": {literal}')


BINARY = bytes(range(256)) * 8
CASES = {
    "gamma binary file": (["gamma", "{binary}"], "not UTF-8"),
    "gamma NaN config": (["gamma", "{nan}"], "NaN"),
    "gamma 1e400 config": (["gamma", "{huge}"], "1e400"),
    "gamma --hoi inf --json": (["gamma", str(FIX / "dense_mha.json"), "--hoi", "inf", "--json"], "HOI"),
    "gamma --n-active inf --json": (
        ["gamma", str(FIX / "dense_mha.json"), "--n-active", "inf", "--json"],
        "N_active",
    ),
    "efficiency nested JSON": (["efficiency", "{deep_jsonl}", "--reference", "m"], "nested too deeply"),
    "report nested JSON": (["report", "{deep_jsonl}", "--gamma", "0.1"], "nested too deeply"),
    "report binary --model-dir": (["report", "{trajectories}", "--model-dir", "{binary}"], "not UTF-8"),
    "gamma nested config": (["gamma", "{deep_json}"], "nested too deeply"),
    # neighbours of the nine
    "gamma --hoi inf (table)": (["gamma", str(FIX / "dense_mha.json"), "--hoi", "inf"], "HOI"),
    "gamma --n-active nan --json": (
        ["gamma", str(FIX / "dense_mha.json"), "--n-active", "nan", "--json"],
        "N_active",
    ),
    "report NaN --model-dir": (["report", "{trajectories}", "--model-dir", "{nan}"], "NaN"),
    "efficiency nested request log": (
        ["efficiency", "{records}", "--reference", "m", "--request-log", "{deep_jsonl}"],
        "nested too deeply",
    ),
}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    trajectory = {
        "id": "t1",
        "model": "m",
        "task": "x",
        "correct": True,
        "turns": [{"prompt_tokens": 10, "output_tokens": 5}],
    }
    record = {
        "model": "m",
        "benchmark": "b",
        "instance_id": "i1",
        "correct": True,
        "output_tokens": 10,
        "finish_reason": "stop",
    }
    return {
        "binary": write(tmp_path, "binary.json", BINARY),
        "nan": write(tmp_path, "nan.json", config_with("num_attention_heads", "NaN")),
        "huge": write(tmp_path, "huge.json", config_with("hidden_size", "1e400")),
        "deep_json": write(tmp_path, "deep.json", DEEP),
        "deep_jsonl": write(tmp_path, "deep.jsonl", DEEP + "\n"),
        "trajectories": write(tmp_path, "trajectories.jsonl", json.dumps(trajectory) + "\n"),
        "records": write(tmp_path, "records.jsonl", json.dumps(record) + "\n"),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, files):
    argv, needle = CASES[case]
    args = [a.format(**files) for a in argv]
    r = subprocess.run(
        [str(PTE), *args], capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"}
    )
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == EXIT_BAD_INPUT, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"pte {args[0]}: error: ") and needle in lines[0], lines[0]


@pytest.mark.parametrize("command", ["efficiency", "report", "calibrate"])
def test_an_input_file_name_that_is_not_utf8_is_printed_escaped_not_a_traceback(tmp_path, command):
    """A file name is bytes: one with a Latin-1 é (b"\\xe9") reaches Python as a surrogate
    escape, which a strict UTF-8 standard output (PYTHONIOENCODING=utf-8) cannot encode; the
    report names the file escaped instead of failing after the analysis."""
    from tests.cli.test_bad_options import FIXTURE, records, request_log

    made = {"efficiency": records, "report": request_log, "calibrate": lambda _: FIXTURE}[command](tmp_path)
    path = tmp_path / os.fsdecode(b"r\xe9sultats" + made.suffix.encode())
    shutil.copyfile(made, path)
    if command != "calibrate":  # a bad line: the report names the file in its problems
        path.write_text(made.read_text() + "not json\n")
    more = {
        "efficiency": ["--reference", "a", "--bootstrap", "0"],
        "report": [],
        "calibrate": ["--bootstrap", "0"],
    }
    r = subprocess.run(
        [str(PTE), command, os.fsencode(path), *more[command]],
        capture_output=True,
        timeout=120,
        env={**os.environ, "PYTHONIOENCODING": "utf-8", "COLUMNS": "200"},
    )
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert b"r\\udce9sultats" in b"".join(r.stdout.split())  # a long path may be wrapped
