"""Benchmark (not a test) of the engine-side step hook, ``EngineAccounting``, standalone:
microseconds of hook time per scheduler step at batch sizes 1–256, on the tiny model's
cost model (models/tiny/config.json, priced as an H100 SXM), numpy accumulator.

The workload is a steady decode batch as a server sees it: ``batch`` live requests, each
step decodes one token for every one of them; every 8 steps (``--finish-every``) one request
finishes (its totals are read and sent: ``on_finished`` + ``flush``) and a new one takes its
slot with a whole-prompt prefill. ``update_from_output`` calls ``flush()`` after every step, so the
benchmark does too. Timed: every hook call (``on_schedule``, ``on_step_done``,
``on_finished``, ``flush``), so deferred work (a journal processed at a flush) counts in
the step that pays for it. Not timed: building the step's columns from vLLM's state (the
scheduler adapter's part) and the transport (a list append here).

Three figures per case:
  schedule_us  on_schedule alone, per step
  total_us     all hook calls, per step (the cost a server pays)
  hook_s_us    the hook's own account: EngineAccounting.hook_s / steps (on_schedule, and
               journal passes wherever they run; not the reading and sending in flush)

Writes bench/results/hook-<hostname>-<YYYY-MM-DD>.json and prints a table.

    python -m bench.hook_bench [--sizes 1 8 64 256] [--steps 2000] [--repeats 3] [--step-log]
                               [--finish-every 8] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.provenance import header_line, load_avg_1m, print_table, provenance, write_results
from pte_instrument.cost.architecture import parse_shape
from pte_instrument.cost.devices import resolve_device
from pte_instrument.cost.model import CostModel
from pte_instrument.engine.accounting import EngineAccounting

ROOT = Path(__file__).resolve().parents[1]
SIZES = [1, 8, 64, 256]
FINISH_EVERY = 8  # steps between two finished requests (default)
COUNTS = {"prompt_tokens": 0, "output_tokens": 0, "num_preemptions": 0}


@dataclass
class Case:
    batch: int
    steps: int
    step_log: bool
    finish_every: int  # steps between two finished requests
    schedule_us: float  # on_schedule per step (median of the repeats)
    total_us: float  # every hook call per step (median of the repeats)
    hook_s_us: float  # EngineAccounting.hook_s / steps (median of the repeats)
    total_us_runs: list[float]


def cost_model() -> CostModel:
    cfg = json.loads((ROOT / "models" / "tiny" / "config.json").read_text())
    return CostModel(parse_shape(cfg), resolve_device("h100-sxm", None))


def run_once(
    model: CostModel, batch: int, steps: int, seed: int, log: str | None, finish_every: int = FINISH_EVERY
) -> tuple[float, float, float]:
    rng = np.random.default_rng(seed)
    sent: list[dict[str, Any]] = []
    ea = EngineAccounting(model, sent.extend, step_log=log)
    clock = time.perf_counter
    live: dict[str, list[int]] = {}  # rid → [computed, prompt]
    next_id = 0

    def admit() -> None:
        nonlocal next_id
        live[f"r{next_id}"] = [0, int(rng.integers(100, 2000))]
        next_id += 1

    for _ in range(batch):
        admit()
    t_sched = t_total = 0.0
    for step in range(steps):
        rids = list(live)
        state = [live[r] for r in rids]
        n = [p if c == 0 else 1 for c, p in state]
        columns = [[c for c, _ in state], n, [p for _, p in state], [0] * len(rids)]
        t0 = clock()
        ea.on_schedule(rids, columns)
        t1 = clock()
        ea.on_step_done()
        for s, k in zip(state, n, strict=True):
            s[0] += k
        done = None
        if step % finish_every == finish_every - 1:
            done = rids[int(rng.integers(len(rids)))]
            ea.on_finished(done, "length", live[done][0], COUNTS)
        ea.flush()
        t2 = clock()
        t_sched += t1 - t0
        t_total += t2 - t0
        if done is not None:
            del live[done]
            admit()
            sent.clear()
    t0 = clock()
    for rid, (c, _) in live.items():
        ea.on_finished(rid, "length", c, COUNTS)
    ea.flush()
    t_total += clock() - t0
    ea.close()
    return 1e6 * t_sched / steps, 1e6 * t_total / steps, 1e6 * ea.hook_s / max(ea.steps, 1)


def bench_case(
    model: CostModel, batch: int, steps: int, repeats: int, step_log: bool, seed: int, finish_every: int
) -> Case:
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        run_once(model, batch, min(steps, 200), seed, None)  # warm-up: imports, numpy scratch
        for r in range(repeats):
            log = f"{tmp}/steps-{r}.jsonl" if step_log else None
            runs.append(run_once(model, batch, steps, seed + r, log, finish_every))
    med = [statistics.median(x[i] for x in runs) for i in range(3)]
    return Case(batch, steps, step_log, finish_every, *med, [round(x[1], 2) for x in runs])


def print_cases(cases: list[Case]) -> None:
    print_table(
        ["finish/", "batch", "step log", "schedule µs", "total µs", "hook_s µs", "runs (total µs)"],
        [[c.finish_every, c.batch, "on" if c.step_log else "off", f"{c.schedule_us:.1f}", f"{c.total_us:.1f}",
          f"{c.hook_s_us:.1f}", c.total_us_runs] for c in cases],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hook_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-log", action="store_true", help="also time each size with the step log on")
    ap.add_argument(
        "--finish-every",
        type=int,
        nargs="+",
        default=[FINISH_EVERY],
        help="steps between two finished requests (several: one case each)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    model = cost_model()
    report: dict[str, Any] = {"benchmark": "engine_hook", **provenance()}
    cases = []
    for every in args.finish_every:
        for size in args.sizes:
            for log in (False, True) if args.step_log else (False,):
                cases.append(bench_case(model, size, args.steps, args.repeats, log, args.seed, every))
                print(
                    f"  B={size} log={log} finish every {every}: {cases[-1].total_us:.1f} µs/step",
                    file=sys.stderr,
                )
    report |= {
        "model": "models/tiny/config.json",
        "device_profile": "h100-sxm",
        "backend": "numpy",
        "load_avg_1m_end": load_avg_1m(),
        "cases": [asdict(c) for c in cases],
    }
    out = write_results(report, "hook", args.out)
    print(header_line(report, f"numpy {report['machine']['numpy']}"))
    print_cases(cases)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
