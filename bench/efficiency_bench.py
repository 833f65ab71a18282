"""Benchmark (not a test) of the efficiency statistics at published scale (docs/efficiency-model.md §5):
25 models × 14,000 instances (350k records, synthetic and seeded), 500 bootstrap resamples,
200 held-out pool splits, solver-derived workload, visible traces.

Runs the whole offline path — write JSONL, load and validate, build arrays (σ_c and loop
audits), analyse, serialize the JSON report — timing each phase, and records the peak RSS.
Writes bench/results/efficiency-<hostname>-<date>.json and prints a summary.

    python -m bench.efficiency_bench [--models 25] [--instances 14000] [--bootstrap 500]
                                     [--splits 200] [--no-traces] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.provenance import load_avg_1m, provenance, write_results
from pte_instrument.offline.decomposition import analyze
from pte_instrument.offline.records import build_tables, load_records
from pte_instrument.offline.render import efficiency_json

WORDS = np.array("the of so we let check sum then value answer step thus is x y z".split())


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def synthesize(path: Path, models: int, instances: int, traces: bool, seed: int) -> int:
    """Records with planted structure: per-model skill and verbosity, per-instance difficulty
    and workload, truncation that rises with length; traces whose redundancy varies."""
    rng = np.random.default_rng(seed)
    skill = rng.normal(0, 1, models)
    verbosity = rng.lognormal(0, 0.4, models)
    difficulty = rng.normal(0, 1, instances)
    workload = rng.lognormal(5, 0.8, instances)
    p_correct = 1 / (1 + np.exp(-(skill[:, None] - difficulty[None, :])))
    tokens = np.maximum(
        1, (verbosity[:, None] * workload[None, :] * rng.lognormal(0, 0.5, (models, instances)))
    ).astype(np.int64)
    truncated = tokens > np.quantile(tokens, 0.93)
    correct = (rng.random((models, instances)) < p_correct) & ~truncated
    repeat = rng.integers(1, 6, (models, instances))
    n = 0
    with path.open("w") as fh:
        for m in range(models):
            lines = []
            for i in range(instances):
                row = {
                    "model": f"model-{m:02d}",
                    "benchmark": "synthetic",
                    "instance_id": f"q{i:05d}",
                    "correct": bool(correct[m, i]),
                    "output_tokens": int(tokens[m, i]),
                    "finish_reason": "length" if truncated[m, i] else "stop",
                }
                if traces:
                    words = WORDS[rng.integers(0, len(WORDS), 12)]
                    row["trace"] = " ".join(words) * int(repeat[m, i])
                lines.append(json.dumps(row))
                n += 1
            fh.write("\n".join(lines) + "\n")
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=25)
    ap.add_argument("--instances", type=int, default=14_000)
    ap.add_argument("--bootstrap", type=int, default=500)
    ap.add_argument("--splits", type=int, default=200)
    ap.add_argument("--no-traces", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/)")
    args = ap.parse_args()

    prov = provenance()  # machine.load_avg_1m: other work on the machine inflates wall times
    phases: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "records.jsonl"
        t0 = time.perf_counter()
        n_records = synthesize(path, args.models, args.instances, not args.no_traces, args.seed)
        phases["synthesize_s"] = time.perf_counter() - t0
        file_mib = path.stat().st_size / 2**20
        rss_before = peak_rss_mib()

        t_start = time.perf_counter()
        t = time.perf_counter()
        loaded = load_records(path)
        phases["load_validate_s"] = time.perf_counter() - t
    t = time.perf_counter()
    table = build_tables(loaded.records)["synthetic"]
    del loaded
    phases["build_arrays_s"] = time.perf_counter() - t
    t = time.perf_counter()
    result = analyze(
        table, "model-00", workload="solver", n_boot=args.bootstrap, n_splits=args.splits, seed=args.seed
    )
    phases["analyze_s"] = time.perf_counter() - t
    t = time.perf_counter()
    report = json.dumps(efficiency_json([result], {}, {}), sort_keys=True, allow_nan=False)
    phases["report_json_s"] = time.perf_counter() - t
    total = time.perf_counter() - t_start

    out = {
        "benchmark": "efficiency",
        **prov,
        "load_avg_1m_end": load_avg_1m(),
        "config": {
            "models": args.models,
            "instances": args.instances,
            "records": n_records,
            "bootstrap": args.bootstrap,
            "splits": args.splits,
            "traces": not args.no_traces,
            "workload": "solver",
            "seed": args.seed,
            "input_file_mib": round(file_mib, 1),
        },
        "results": {
            "wall_s_total_excluding_synthesis": round(total, 3),
            **{k: round(v, 3) for k, v in phases.items()},
            "peak_rss_mib": round(peak_rss_mib(), 1),
            "peak_rss_mib_after_synthesis": round(rss_before, 1),
            "report_json_mib": round(len(report) / 2**20, 2),
            "views": list(result.views),
            "solver_coverage": result.solver.coverage.value if result.solver else None,
        },
        "targets": {"wall_s": 60, "peak_rss_mib": 4096},
    }
    dest = write_results(out, "efficiency", args.out)

    r = out["results"]
    print(
        f"efficiency bench: {args.models} models × {args.instances} instances "
        f"({n_records} records), {args.bootstrap} bootstrap, {args.splits} splits, "
        f"traces {'on' if not args.no_traces else 'off'}"
    )
    for k, v in phases.items():
        print(f"  {k:<18} {v:8.2f} s")
    print(f"  total (load → JSON) {total:7.2f} s   (target < 60 s)")
    print(f"  peak RSS           {r['peak_rss_mib']:8.1f} MiB (target < 4096 MiB)")
    m = out["machine"]
    print(
        f"  machine: {m['platform']}, {m['cpu_count']} CPUs, load average "
        f"{m['load_avg_1m']} → {out['load_avg_1m_end']}"
    )
    print(f"  wrote {dest}")
    ok = total < 60 and r["peak_rss_mib"] < 4096
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
