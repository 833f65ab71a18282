"""bench/accumulator_stream_bench.py needs a CUDA device (it runs in bench/device_check.sh):
on a host without one it says so, exits 2 and writes no result."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_without_a_cuda_device_the_stream_bench_says_so_and_writes_nothing(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: bench/device_check.sh runs the bench")
    out = tmp_path / "stream.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.accumulator_stream_bench", "--sizes", "1", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (run.returncode, run.stderr.strip().splitlines()[-1]) == (2, "needs a CUDA device")
    assert not out.exists()
