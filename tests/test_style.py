"""The tree is as ``make lint`` leaves it: ``ruff check`` clean and ``ruff format``ted, with the
formatter switched off only around tables (``# fmt: off`` … ``# fmt: on``), never per line."""

from __future__ import annotations

import ast
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


def _convention_names() -> set[str]:
    """Every attribute and metric name the OpenTelemetry conventions' package defines for
    what the plugin exports: GenAI, session, error, service."""
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes, session_attributes
    from opentelemetry.semconv._incubating.metrics import gen_ai_metrics
    from opentelemetry.semconv.attributes import error_attributes, service_attributes

    modules = (gen_ai_attributes, session_attributes, gen_ai_metrics, error_attributes, service_attributes)
    return {v for m in modules for k, v in vars(m).items() if k.isupper() and isinstance(v, str)}


def test_semantic_convention_names_come_from_the_conventions_package():
    """A typed ``"gen_ai.…"`` string can drift from the conventions unseen; the package's
    constants cannot."""
    names = _convention_names()
    assert "gen_ai.server.time_to_first_token" in names and "session.id" in names
    typed = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}"
        for path in (ROOT / "pte_instrument").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]
    assert not typed, typed
