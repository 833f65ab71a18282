"""``pte bench`` runs the checkout's bench whatever the working directory holds.

The working directory stays the caller's (relative ``--out`` paths mean what they say), and a
caller's own project often has a ``bench/`` folder or a ``bench.py``: neither may stand in
for the checkout's ``bench`` package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("shadow", ["package", "module"])
def test_a_bench_of_the_working_directory_does_not_shadow_the_checkouts(tmp_path: Path, shadow: str) -> None:
    if shadow == "package":
        (tmp_path / "bench").mkdir()
        (tmp_path / "bench" / "__init__.py").write_text("print('the caller bench ran')\n")
    else:
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
