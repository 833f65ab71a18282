"""The tree is as ``make lint`` leaves it: ``ruff check`` clean and ``ruff format``ted, with the
formatter switched off only around tables (``# fmt: off`` … ``# fmt: on``), never per line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_leaves_the_tree_as_it_is(command):
    run = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_no_line_opts_out_of_the_formatter():
    skipped = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in ROOT.rglob("*.py")
        if not {".venv", "build"} & set(path.relative_to(ROOT).parts)
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if line.rstrip().endswith("# fmt" + ": skip")
    ]
    assert not skipped, skipped
