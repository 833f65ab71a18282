"""bench/scheduler_bench.py runs end to end at its smallest size and writes what it reports:
vLLM's time per step, the hook's added time with intervals around it, the hook's own
account and, with ``--floor``, what a pass-through subclass adds, for each scheduler kind,
with the hook's totals delivered over its transport."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from bench.scheduler_bench import interval, process_cpu_s
from tests.conftest import ROOT

needs_model = pytest.mark.skipif(
    not (ROOT / "models" / "tiny" / "config.json").exists(), reason="needs the tiny model (make test)"
)


def test_the_interval_takes_in_the_spread_between_runs():
    """Two runs that agree within themselves and differ from each other: a quarter of the
    resamples draw the first run twice (mean 0), a quarter the second (mean 10), so the
    interval reaches both; resampling the pooled steps alone would give about [4.3, 5.7]."""
    lo, hi = interval([np.zeros(100), np.full(100, 10.0)], np.mean, np.random.default_rng(0))
    assert (lo, hi) == (0.0, 10.0)
    one = np.arange(200, dtype=float)  # one run: the steps' bootstrap
    lo, hi = interval([one], np.mean, np.random.default_rng(0))
    assert 99.5 - 20 < lo < 99.5 < hi < 99.5 + 20


BUSY_CHILD = """
import sys, time
for _ in sys.stdin:  # on each line: spend 3 ms of CPU, then say so
    t = time.process_time()
    while time.process_time() - t < 0.003:
        pass
    print(flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a Linux process clock")
def test_another_process_cpu_time_is_read_finer_than_a_clock_tick():
    """The pricing process of a short run may spend a few milliseconds: /proc's 10 ms ticks
    read that as 0 or 10 ms. Three milliseconds of another process's CPU read as three."""
    child = subprocess.Popen(
        [sys.executable, "-c", BUSY_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        spent = []
        for _ in range(3):
            before = process_cpu_s(child.pid)
            child.stdin.write("\n")
            child.stdin.flush()
            child.stdout.readline()
            spent.append(process_cpu_s(child.pid) - before)
    finally:
        child.kill()
        child.wait()
    assert min(spent) >= 0.003 and sorted(spent)[1] < 0.008, spent


@needs_model
def test_the_scheduler_bench_writes_one_case_per_kind_with_provenance(tmp_path):
    out = tmp_path / "scheduler.json"
    args = [
        "--sizes",
        "1",
        "--kinds",
        "sync",
        "async",
        "--repeats",
        "1",
        "--steps",
        "1200",
        "--model-ms",
        "0.5",
        "--floor",
        "--out",
        str(out),
    ]
    run = subprocess.run(
        [sys.executable, "-m", "bench.scheduler_bench", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "scheduler_overhead" and data["git_commit"] and data["machine"]["cpu_count"]
    assert [(c["kind"], c["batch"]) for c in data["cases"]] == [("sync", 1), ("async", 1)]
    for c in data["cases"]:
        assert c["steps"] == 1200 and c["runs"] == 1 and c["vllm_us"] > 0 and c["hook_s_us"] > 0
        assert c["added_mean_per_run_us"] == [pytest.approx(c["added_mean_us"])]
        lo, hi = c["added_mean_ci"]
        assert lo <= c["added_mean_us"] <= hi and math.isfinite(c["ratio"])
        assert c["ratio"] == pytest.approx(c["added_mean_us"] / c["vllm_us"])
        assert 0 < c["finished_per_step"] < 1  # requests finish, and a new one takes each place
        assert c["pricing_cpu_us"] > 0 and c["shipping_cpu_us"] > 0  # shipped, then priced
        lo, hi = c["wake_late_ci"]  # the model waits were timed, each after both classes' step
        assert lo <= c["wake_late_us"] <= hi and math.isfinite(c["wake_late_us"])
        lo, hi = c["floor_mean_ci"]  # the pass-through subclass ran the same stream beside them
        assert lo <= c["floor_mean_us"] <= hi and math.isfinite(c["floor_median_us"])
    assert data["messages_received"] > 0  # the hook's totals went over its transport
    assert f"written: {out}" in run.stdout
