"""The ``pte_instrument.cli`` package: one error convention, no import cycle, every
sub-command registered (a broken sub-command module fails loudly), and ``pte bench`` running
its bench as ``python -m bench.<name>`` with the checkout on ``PYTHONPATH``."""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pte_instrument.cli import bench as cli_bench
from pte_instrument.cli import errors
from pte_instrument.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "pte_instrument" / "cli"


def _package_imports(path: Path) -> set[str]:
    """Every ``pte_instrument.cli.*`` module a file imports, at any depth of the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pte_instrument.cli"):
            if node.module == "pte_instrument.cli":
                found |= {f"pte_instrument.cli.{a.name}" for a in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pte_instrument.cli.")}
    return found


def test_import_graph_has_no_cycle() -> None:
    graph = {f"pte_instrument.cli.{p.stem}": _package_imports(p) for p in CLI.glob("*.py")}
    assert graph["pte_instrument.cli.errors"] == set()
    assert graph["pte_instrument.cli.bench"] == {"pte_instrument.cli.errors"}
    assert graph["pte_instrument.cli.outputs"] == {"pte_instrument.cli.errors"}
    assert graph["pte_instrument.cli.efficiency"] == {
        "pte_instrument.cli.errors",
        "pte_instrument.cli.outputs",
    }
    assert graph["pte_instrument.cli.calibrate"] == {"pte_instrument.cli.errors"}
    assert graph["pte_instrument.cli.validate"] == {"pte_instrument.cli.errors", "pte_instrument.cli.outputs"}
    assert graph["pte_instrument.cli.main"] == {
        "pte_instrument.cli.bench",
        "pte_instrument.cli.calibrate",
        "pte_instrument.cli.efficiency",
        "pte_instrument.cli.errors",
        "pte_instrument.cli.validate",
    }
    for module, deps in graph.items():
        if module != "pte_instrument.cli.main":
            assert "pte_instrument.cli.main" not in deps, module


def test_every_subcommand_is_registered() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {
        "gamma",
        "devices",
        "tenant-hash",
        "demo",
        "efficiency",
        "report",
        "bench",
        "calibrate",
        "validate",
    }


def test_broken_subcommand_module_fails_loudly() -> None:
    # A dependency of `pte efficiency` that cannot be imported: `pte` must not start without
    # the sub-command (it did once, silently), it must fail with the ImportError.
    code = (
        "import sys; sys.modules['pte_instrument.offline.decomposition'] = None; "
        "from pte_instrument.cli.main import main; sys.exit(main(['--help']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "ModuleNotFoundError: import of pte_instrument.offline.decomposition halted" in r.stderr
    assert "pte_instrument/cli/efficiency.py" in r.stderr and "usage: pte" not in r.stdout


def test_usage_error_is_one_line_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert errors.EXIT_BAD_INPUT == 2 and errors.EXIT_OK == 0
    assert errors.report_error("gamma", errors.UsageError("no such model")) == errors.EXIT_BAD_INPUT
    assert capsys.readouterr().err == "pte gamma: error: no such model\n"
    assert main(["gamma", "/no/such/model"]) == errors.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("pte gamma: error: ") and len(err.strip().splitlines()) == 1


def test_print_json_is_stable_and_refuses_nan(capsys: pytest.CaptureFixture[str]) -> None:
    errors.print_json({"b": 1, "a": [None, 0.5]})
    out = capsys.readouterr().out
    assert out == '{\n  "a": [\n    null,\n    0.5\n  ],\n  "b": 1\n}\n'
    assert json.loads(out) == {"a": [None, 0.5], "b": 1}
    with pytest.raises(ValueError):
        errors.print_json({"x": float("nan")})


def test_bench_runs_the_module_with_the_checkout_on_pythonpath() -> None:
    root = cli_bench.repo_root()
    assert root == ROOT
    cmd = cli_bench.bench_command("gpu-latency", ["--device", "cpu", "--tiny"], root)
    assert cmd == [
        sys.executable,
        "-c",
        cli_bench.RUN_FROM_ROOT,
        str(root),
        "bench.gpu_latency",
        "--device",
        "cpu",
        "--tiny",
    ]
    env = cli_bench.bench_env(root, {"PYTHONPATH": "/elsewhere", "HOME": "/h"})
    assert env == {"PYTHONPATH": os.pathsep.join([str(root), "/elsewhere"]), "HOME": "/h"}
    assert cli_bench.bench_env(root, {})["PYTHONPATH"] == str(root)
    with pytest.raises(FileNotFoundError):
        cli_bench.bench_command("latency", [], ROOT / "pte_instrument")  # no bench/ there


@pytest.mark.parametrize("shadow", [None, "package", "module"])
def test_pte_bench_help_runs_from_another_directory(tmp_path: Path, shadow: str | None) -> None:
    # The bench's own --help, through `pte bench`, from a working directory that is not the
    # checkout: the module is found through PYTHONPATH, the working directory is kept, and a
    # bench/ package or bench.py of the caller's own there does not stand in for the checkout's.
    if shadow == "package":
        (tmp_path / "bench").mkdir()
        (tmp_path / "bench" / "__init__.py").write_text("print('the caller bench ran')\n")
    elif shadow == "module":
        (tmp_path / "bench.py").write_text("print('the caller bench ran')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-m", "pte_instrument.cli.main", "bench", "gpu-latency", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert "the caller bench ran" not in r.stdout
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m bench.gpu_latency")
