"""bench/provenance.py: the date, code and machine block every bench writes, and where."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from bench import provenance as P


def test_provenance_has_date_code_and_machine() -> None:
    p = P.provenance()
    assert set(p) == {"date", "git_commit", "git_dirty", "machine"}
    assert dt.datetime.fromisoformat(p["date"]).utcoffset() == dt.timedelta(0)
    assert isinstance(p["git_commit"], str) and p["git_commit"]
    assert p["git_dirty"] in (True, False, None)
    m = p["machine"]
    for key in (
        "hostname",
        "platform",
        "processor",
        "cpu_count",
        "affinity_cpus",
        "load_avg_1m",
        "python",
        "numpy",
        "torch",
        "triton",
        "vllm",
        "transformers",
        "gpu",
        "cuda",
    ):
        assert key in m
    assert m["numpy"]  # installed with the package
    json.dumps(p)  # serialisable as is


def test_provenance_never_fails_without_git(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("no git")

    monkeypatch.setattr(P.subprocess, "run", broken)
    p = P.provenance()
    assert p["git_commit"] == "unknown" and p["git_dirty"] is None


def test_write_results_default_path_and_explicit_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(P, "RESULTS", tmp_path / "results")
    report = {"benchmark": "x", "value": 1.5, "where": Path("/a")}
    path = P.write_results(report, "x")
    day = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    assert path == tmp_path / "results" / f"x-{P.hostname()}-{day}.json"
    text = path.read_text()
    assert text.endswith("}\n") and json.loads(text) == {"benchmark": "x", "value": 1.5, "where": "/a"}
    assert text.startswith('{\n  "benchmark"')  # indent 2
    out = P.write_results(report, "x", tmp_path / "deep" / "er" / "r.json")
    assert out == tmp_path / "deep" / "er" / "r.json" and out.is_file()
    assert P.results_path("y", tmp_path).parent == tmp_path
