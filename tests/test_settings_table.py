"""Settings are declared once (``pte_instrument.settings.TABLE``): the README's and
docs/configuration.md's tables are the ones generated from it, the defaults obey their own
bounds, and no module but the settings reads the plugin's variables from the environment."""

from __future__ import annotations

import ast
from types import ModuleType

import pytest

from pte_instrument import settings
from tests.conftest import ROOT
from tests.helpers import load_script


def settings_tables() -> ModuleType:
    return load_script(ROOT / "scripts" / "settings_tables.py")


@pytest.mark.parametrize("doc", ["README.md", "docs/configuration.md"])
def test_the_committed_table_is_the_generated_one(doc):
    script = settings_tables()
    path = ROOT / doc
    text = path.read_text(encoding="utf-8")
    table = settings.markdown_table(readme=script.TABLES[path])
    assert script.rewritten(text, table) == text, f"{doc} is stale: run python scripts/settings_tables.py"
    documented = {line.split("`")[1] for line in table.splitlines()[2:]}
    assert documented <= settings.NAMES and "PTE_ENABLED" in documented


def test_the_check_names_a_stale_file(tmp_path, monkeypatch, capsys):
    script = settings_tables()
    stale = tmp_path / "README.md"
    stale.write_text(f"# x\n{script.BEGIN}\n| old |\n{script.END}\nafter\n", encoding="utf-8")
    monkeypatch.setattr(script, "ROOT", tmp_path)
    monkeypatch.setattr(script, "TABLES", {stale: True})
    assert script.main(["--check"]) == 1 and "README.md: differs" in capsys.readouterr().out
    assert "| old |" in stale.read_text(encoding="utf-8")  # --check writes nothing
    assert script.main([]) == 0
    text = stale.read_text(encoding="utf-8")
    assert "| `PTE_ENABLED` | `1` |" in text and text.endswith(f"{script.END}\nafter\n")
    assert script.main(["--check"]) == 0


def test_each_default_obeys_its_parser():
    for s in settings.TABLE:
        if isinstance(s.parse, settings.number) and s.default is not None:
            assert s.parse.bounds.admits(s.default), s.name
            assert s.parse(str(s.default), []) == s.default
        if s.default is not None and isinstance(s.default, str):
            assert s.parse(s.default, []) == s.default, s.name


def test_the_docs_defaults_are_the_values():
    by_name = settings.BY_NAME
    assert by_name["PTE_MAX_SESSIONS"].default_text() == "`5000`" == f"`{settings.Settings().max_sessions}`"
    assert by_name["PTE_SESSION_IDLE_TTL_S"].default_text() == "`3600`"
    assert by_name["PTE_ENABLED"].default_text() == "`1`" and by_name["PTE_HOI"].default_text() == "–"
    assert by_name["PTE_N_ACTIVE"].accepted_text() == "number in [1, 10¹⁴] parameters"


# Reads of other projects' variables, and copies of the environment for a child process.
FOREIGN = {
    ("pte_instrument/server/exporters/exposition.py", "PROMETHEUS_MULTIPROC_DIR"),  # prometheus-client's
    ("pte_instrument/vllm_adapter/compat.py", "VLLM_API_KEY"),  # vLLM's
    # the OpenTelemetry SDK's OTEL_*_MAX_QUEUE_SIZE and OTEL_EXPORTER_OTLP_*TIMEOUT, read as it reads them
    ("pte_instrument/server/exporters/otel.py", "variable"),
}


def environment_reads(path) -> list[tuple[int, str]]:
    """``os.environ.get(X)``, ``os.getenv(X)``, ``os.environ[X]`` read, ``X in os.environ``:
    (line, X's source)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr == "get" and is_environ(f.value)) or f.attr == "getenv":
                out.append((node.lineno, ast.unparse(node.args[0]) if node.args else ""))
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            out.append((node.lineno, ast.unparse(node.slice)))
    return out


def test_only_the_settings_read_the_plugins_variables():
    found = []
    for path in sorted((ROOT / "pte_instrument").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == "pte_instrument/settings.py":
            continue
        for line, name in environment_reads(path):
            if (rel, name.strip("'\"")) not in FOREIGN:
                found.append(f"{rel}:{line} reads {name}")
    assert not found, found
