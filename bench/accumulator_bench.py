"""Benchmark (not a test) of the batched step accumulator: per backend and batch
size, microseconds per ``StepAccumulator.update()`` call and rows per second.

Backends measured: numpy (CPU), torch on CPU, and — when a GPU is present — torch and
Triton on CUDA. On CUDA three numbers are kept per case:
  host_us    what the scheduler thread pays to enqueue one update (it never waits)
  device_us  GPU time per update, from CUDA events around the whole run
  us_per_update  wall time per update with the pipeline full (synchronised at the end)
Triton on CPU runs under the Triton interpreter: it is timed only for batch sizes ≤ 64,
as a sanity figure, never a performance one (``--no-interp`` skips it).

The workload is scheduler-like: 90 % decode rows (n = 1, long contexts), 10 % prefill
chunks, two KV groups (full attention + a 4096 window), slots drawn from a live pool,
eight distinct pre-built batches per size cycled so no cache sees one batch only.

Writes bench/results/accumulator-<hostname>-<YYYY-MM-DD>.json and prints a table.

    python -m bench.accumulator_bench [--sizes 1 8 64 512 4096 8192] [--seconds 0.5]
                                      [--backends numpy torch triton] [--no-interp] [--out F]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.provenance import header_line, load_avg_1m, print_table, provenance, write_results
from pte_instrument.engine.accumulator import StepAccumulator, StepBatch

SIZES = [1, 8, 64, 512, 4096, 8192]
INTERP_MAX_SIZE = 64
WINDOWS: tuple[int | None, ...] = (None, 4096)


@dataclass
class Case:
    backend: str
    device: str
    batch: int
    calls: int
    us_per_update: float  # wall time per call (CUDA: pipeline full, synchronised at the end)
    rows_per_s: float
    host_us: float | None = None  # CUDA: enqueue time per call
    device_us: float | None = None  # CUDA: GPU time per call (events)
    note: str = ""


def make_batches(rng: np.random.Generator, size: int, slots: np.ndarray, k: int = 8) -> list[StepBatch]:
    out = []
    for _ in range(k):
        decode = rng.random(size) < 0.9
        P = rng.integers(100, 32_000, size)
        c = np.where(decode, P + rng.integers(0, 4000, size), rng.integers(0, 30_000, size) % P)
        n = np.where(decode, 1, np.minimum(rng.integers(1, 2048, size), P - c + 1))
        H = c.copy()
        slot = rng.choice(slots, size, replace=size > len(slots))
        out.append(StepBatch.from_arrays(slot=slot, c=c, n=n, P=P, H=H))
    return out


def bench_case(backend: str, device: str, size: int, seconds: float, seed: int) -> Case:
    rng = np.random.default_rng(seed)
    capacity = max(1024, size)
    acc = StepAccumulator(WINDOWS, capacity=capacity, backend=backend, device=device)  # type: ignore[arg-type]
    slots = acc.allocate_many(capacity)
    batches = make_batches(rng, size, slots)
    cuda = device.startswith("cuda")
    interp = backend == "triton" and not cuda
    torch: Any = None
    if cuda:
        import torch

        sync = torch.cuda.synchronize
    else:

        def sync() -> None:
            return None

    # Warm-up: Triton compiles, the pinned-memory pool fills, numpy's scratch grows.
    for b in batches[:3]:
        acc.update(b)
    sync()
    # Calibrate the number of calls to fill `seconds` of wall time.
    t0 = time.perf_counter()
    probe = 0
    while time.perf_counter() - t0 < min(0.05, seconds / 4) or probe < 2:
        acc.update(batches[probe % len(batches)])
        probe += 1
    sync()
    per_call = (time.perf_counter() - t0) / probe
    calls = max(3 if interp else 20, min(200_000, int(seconds / max(per_call, 1e-7))))

    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for i in range(calls):
        acc.update(batches[i % len(batches)])
    host = time.perf_counter() - t0
    if cuda:
        end.record()
    sync()
    wall = time.perf_counter() - t0
    case = Case(backend, device, size, calls, wall / calls * 1e6, size * calls / wall)
    if cuda:
        case.host_us = host / calls * 1e6
        case.device_us = start.elapsed_time(end) * 1e3 / calls
    if interp:
        case.note = "Triton interpreter on CPU: correctness path, not a performance figure"
    return case


def plan(backends: list[str], sizes: list[int], interp: bool) -> list[tuple[str, str, int]]:
    try:
        import torch

        has_torch, has_cuda = True, torch.cuda.is_available()
    except ImportError:
        has_torch = has_cuda = False
    try:
        import triton  # noqa: F401

        has_triton = has_torch
    except ImportError:
        has_triton = False
    cases = []
    for b in backends:
        if b == "numpy":
            cases += [("numpy", "cpu", s) for s in sizes]
        elif b == "torch" and has_torch:
            cases += [("torch", "cpu", s) for s in sizes]
            if has_cuda:
                cases += [("torch", "cuda", s) for s in sizes]
        elif b == "triton" and has_triton:
            if has_cuda:
                cases += [("triton", "cuda", s) for s in sizes]
            if interp:
                cases += [("triton", "cpu", s) for s in sizes if s <= INTERP_MAX_SIZE]
    return cases


def print_cases(cases: list[Case]) -> None:
    print_table(
        ["backend", "device", "batch", "µs/update", "rows/s", "host µs", "GPU µs", "note"],
        [
            [
                c.backend,
                c.device,
                c.batch,
                f"{c.us_per_update:.1f}",
                f"{c.rows_per_s:.3g}",
                None if c.host_us is None else f"{c.host_us:.1f}",
                None if c.device_us is None else f"{c.device_us:.1f}",
                c.note[:40],
            ]
            for c in cases
        ],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.accumulator_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    ap.add_argument(
        "--backends", nargs="+", default=["numpy", "torch", "triton"], choices=["numpy", "torch", "triton"]
    )
    ap.add_argument("--seconds", type=float, default=0.5, help="wall time per case")
    ap.add_argument("--no-interp", action="store_true", help="skip Triton-interpreter cases")
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads for the CPU cases (default 1: with more, "
        "a busy host makes torch's CPU timings erratic; 0 keeps torch's)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    if args.torch_threads > 0:
        try:
            import torch

            torch.set_num_threads(args.torch_threads)
        except ImportError:
            pass
    tasks = plan(args.backends, args.sizes, not args.no_interp)  # imports torch: provenance sees the GPU
    report: dict[str, Any] = {"benchmark": "accumulator", **provenance()}
    cases = []
    for backend, device, size in tasks:
        cases.append(bench_case(backend, device, size, args.seconds, args.seed))
        print(f"  {backend}/{device} B={size}: {cases[-1].us_per_update:.1f} µs", file=sys.stderr)
    report |= {
        "windows": list(WINDOWS),
        "seconds_per_case": args.seconds,
        "torch_cpu_threads": args.torch_threads or "default",
        "load_avg_1m_end": load_avg_1m(),
        "cases": [asdict(c) for c in cases],
    }
    out = write_results(report, "accumulator", args.out)
    m = report["machine"]
    print(header_line(report, f"GPU: {m['gpu']}", f"torch {m['torch']}", f"triton {m['triton']}"))
    print_cases(cases)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
