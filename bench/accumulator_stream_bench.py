"""Benchmark (not a test): the step accumulator on a GPU while a model runs, as under vLLM's
async scheduling, where the engine thread prices step N while step N+1 runs on the device.

Each simulated engine step enqueues the model's work (bf16 matmuls, about ``--model-ms`` of
GPU time) and lets at most two steps be in flight, as vLLM's batch queue does; in the
accumulator's blocks the host then calls ``update()`` once, on its own current stream, with a
scheduler-like batch. The model runs either on a stream of its own (``side``) or on the
accumulator's stream (``same``: both on the engine thread's current stream). Blocks of model
only and of model + accumulator alternate. Reported per backend (torch, triton), batch size
and stream layout:

  host_us       host time per ``update()`` call (mean, p99): what the engine thread pays
  model_us      GPU time per step of the model's stream, without and with the accumulator
                (CUDA events between consecutive steps): what the accumulator delays the model
  synced        whether any ``update()`` synchronised the host (torch's sync debug mode set
                to "error" around each call)
  exact         the accumulator's state after the run equals the numpy reference's on the
                same batches

Writes bench/results/accumulator-stream-<hostname>-<YYYY-MM-DD>.json and prints a table.
Needs a CUDA device.

    python -m bench.accumulator_stream_bench [--sizes 1 64 512 4096] [--steps 400]
                                             [--model-ms 2] [--out F]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.accumulator_bench import WINDOWS, make_batches
from bench.provenance import header_line, load_avg_1m, print_table, provenance, write_results
from pte_instrument.engine.accumulator import StepAccumulator

SIZES = [1, 64, 512, 4096]
BLOCKS = 6  # alternating blocks per case: model only, then model + accumulator, three times
IN_FLIGHT = 2  # steps enqueued and not finished at most (vLLM's batch queue under async scheduling)


@dataclass
class Case:
    backend: str
    layout: str  # "side": the model on a stream of its own; "same": on the accumulator's
    batch: int
    steps: int  # per kind of block, in all
    host_us: float
    host_p99_us: float
    model_us: float  # GPU time per model step, model-only blocks
    model_with_acc_us: float  # the same, in the blocks with the accumulator
    synced: bool
    exact: bool


def model_step(torch: Any, a: Any, b: Any, out: Any, matmuls: int) -> None:
    for _ in range(matmuls):
        torch.matmul(a, b, out=out)


def run_case(
    torch: Any, backend: str, layout: str, size: int, steps: int, model_ms: float, seed: int
) -> Case:
    rng = np.random.default_rng(seed)
    capacity = max(1024, size)
    acc = StepAccumulator(WINDOWS, capacity=capacity, backend=backend, device="cuda")  # type: ignore[arg-type]
    ref = StepAccumulator(WINDOWS, capacity=capacity, backend="numpy", device="cpu")
    slots = acc.allocate_many(capacity)
    ref.allocate_many(capacity)
    batches = make_batches(rng, size, slots)
    for b in batches[:3]:  # compile, fill the pinned pool
        acc.update(b)
        ref.update(b)
    n = 2048
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / n**0.5
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / n**0.5
    out = torch.empty_like(a)
    stream = torch.cuda.Stream() if layout == "side" else torch.cuda.current_stream()
    matmuls = calibrate(torch, stream, a, b, out, model_ms)
    host: list[float] = []
    gpu: dict[bool, list[float]] = {False: [], True: []}
    synced = False
    per_block = max(1, steps // (BLOCKS // 2))
    k = 0
    for block in range(BLOCKS):
        with_acc = block % 2 == 1
        ends: list[Any] = []
        for _ in range(per_block):
            with torch.cuda.stream(stream):
                model_step(torch, a, b, out, matmuls)
                ends.append(torch.cuda.Event(enable_timing=True))
                ends[-1].record()
            if len(ends) > IN_FLIGHT:
                ends[-IN_FLIGHT - 1].synchronize()  # the engine waits for step N-2's outputs
            if with_acc:
                batch = batches[k % len(batches)]
                k += 1
                torch.cuda.set_sync_debug_mode("error")
                t = time.perf_counter()
                try:
                    acc.update(batch)
                except RuntimeError:  # a synchronising call inside update()
                    synced = True
                finally:
                    host.append(time.perf_counter() - t)
                    torch.cuda.set_sync_debug_mode(0)
                ref.update(batch)
        torch.cuda.synchronize()
        gpu[with_acc] += [s.elapsed_time(e) * 1e3 for s, e in itertools.pairwise(ends)]
    every = np.arange(capacity)
    exact = bool(np.array_equal(acc.read(every), ref.read(every)))
    h = np.array(host) * 1e6
    return Case(
        backend,
        layout,
        size,
        per_block * (BLOCKS // 2),
        float(h.mean()),
        float(np.percentile(h, 99)),
        float(np.mean(gpu[False])),
        float(np.mean(gpu[True])),
        synced,
        exact,
    )


def calibrate(torch: Any, stream: Any, a: Any, b: Any, out: Any, model_ms: float) -> int:
    """Matmuls per model step for about ``model_ms`` of GPU time."""
    with torch.cuda.stream(stream):
        model_step(torch, a, b, out, 3)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model_step(torch, a, b, out, 20)
        end.record()
    end.synchronize()
    per_matmul_ms = start.elapsed_time(end) / 20
    return max(1, round(model_ms / max(per_matmul_ms, 1e-6)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.accumulator_stream_bench", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    ap.add_argument("--backends", nargs="+", default=["triton", "torch"], choices=["triton", "torch"])
    ap.add_argument("--steps", type=int, default=400, help="steps per kind of block, in all")
    ap.add_argument("--model-ms", type=float, default=2.0, help="the model's GPU time per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("needs torch with a CUDA device", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"benchmark": "accumulator_stream", **provenance()}
    cases = []
    for backend in args.backends:
        for layout in ("side", "same"):
            for size in args.sizes:
                cases.append(run_case(torch, backend, layout, size, args.steps, args.model_ms, args.seed))
                c = cases[-1]
                print(f"  {backend} {layout} B={size}: host {c.host_us:.1f} µs", file=sys.stderr)
    report |= {
        "windows": list(WINDOWS),
        "model_ms": args.model_ms,
        "in_flight": IN_FLIGHT,
        "load_avg_1m_end": load_avg_1m(),
        "cases": [asdict(c) for c in cases],
    }
    out = write_results(report, "accumulator-stream", args.out)
    print(header_line(report, f"GPU: {report['machine']['gpu']}", f"model {args.model_ms:g} ms per step"))
    print_table(
        [
            "backend",
            "model stream",
            "batch",
            "host µs",
            "host p99 µs",
            "model µs/step",
            "with acc",
            "synced",
            "exact",
        ],
        [
            [
                c.backend,
                c.layout,
                c.batch,
                f"{c.host_us:.1f}",
                f"{c.host_p99_us:.1f}",
                f"{c.model_us:.0f}",
                f"{c.model_with_acc_us:.0f}",
                "yes" if c.synced else "no",
                "yes" if c.exact else "NO",
            ]
            for c in cases
        ],
    )
    print(f"wrote {out}")
    return 0 if all(c.exact and not c.synced for c in cases) else 1


if __name__ == "__main__":
    raise SystemExit(main())
