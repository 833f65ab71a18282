"""Benchmark (not a test) of the efficiency statistics at published scale (docs/efficiency-model.md §5):
25 models × 14,000 instances (350k records, synthetic and seeded), 500 bootstrap resamples,
200 held-out pool splits, solver-derived workload, visible traces.

Runs the whole offline path — write JSONL, load and validate, build arrays (σ_c and loop
audits), analyse, serialize the JSON report — timing each phase; then the same answers as
lm-eval outputs (one run per model) with the plugin's request log of the server they ran
against (one line per answer, with its prompt digest): read both, join every sample to its
request, price the cost per correct answer with bootstrap intervals, and decompose the joined
samples. Records the peak RSS. Writes bench/results/efficiency-<hostname>-<date>.json and
prints a summary.

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
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path

import numpy as np

from bench.provenance import load_avg_1m, provenance, write_results
from pte_instrument.offline.cost_per_correct import cost_report, eval_records, join_runs, read_request_log
from pte_instrument.offline.decomposition import BenchmarkResult, EvalTable, analyze
from pte_instrument.offline.harness_outputs import load_runs
from pte_instrument.offline.records import build_tables, load_records
from pte_instrument.offline.render import efficiency_json
from pte_instrument.prompt_digest import chat_digest
from pte_instrument.server.records import RequestRecord

WORDS = np.array("the of so we let check sum then value answer step thus is x y z".split())


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


@dataclass
class Planted:
    """Records with planted structure: per-model skill and verbosity, per-instance difficulty
    and workload, truncation that rises with length; traces whose redundancy varies."""

    tokens: np.ndarray  # (models, instances)
    truncated: np.ndarray
    correct: np.ndarray
    traces: list[list[str]] | None

    @classmethod
    def draw(cls, models: int, instances: int, traces: bool, seed: int) -> Planted:
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
        text = None
        if traces:
            text = [
                [
                    " ".join(WORDS[rng.integers(0, len(WORDS), 12)]) * int(repeat[m, i])
                    for i in range(instances)
                ]
                for m in range(models)
            ]
        return cls(tokens, truncated, correct, text)


def synthesize(path: Path, planted: Planted) -> int:
    """The planted answers as evaluation records (JSONL)."""
    models, instances = planted.tokens.shape
    with path.open("w") as fh:
        for m in range(models):
            lines = []
            for i in range(instances):
                row = {
                    "model": f"model-{m:02d}",
                    "benchmark": "synthetic",
                    "instance_id": f"q{i:05d}",
                    "correct": bool(planted.correct[m, i]),
                    "output_tokens": int(planted.tokens[m, i]),
                    "finish_reason": "length" if planted.truncated[m, i] else "stop",
                }
                if planted.traces is not None:
                    row["trace"] = planted.traces[m][i]
                lines.append(json.dumps(row))
            fh.write("\n".join(lines) + "\n")
    return models * instances


def timed_analysis(table: EvalTable, args: argparse.Namespace, phases: dict[str, float]) -> BenchmarkResult:
    """The decomposition against model-00 with a solver workload, its time in ``analyze_s``."""
    t = time.perf_counter()
    result = analyze(
        table, "model-00", workload="solver", n_boot=args.bootstrap, n_splits=args.splits, seed=args.seed
    )
    phases["analyze_s"] = time.perf_counter() - t
    return result


RUN_S = 900.0  # each model's evaluation: its own 15 minutes against one server


def synthesize_harness(root: Path, planted: Planted) -> tuple[list[Path], Path]:
    """The planted answers as lm-eval outputs (one run per model: results and samples files)
    and the plugin's request log of the server they ran against (whole request-log lines,
    with the prompt digests lm-eval's arguments give)."""
    models, instances = planted.tokens.shape
    questions = [json.dumps([{"role": "user", "content": f"question {i}"}]) for i in range(instances)]
    digests = [chat_digest(json.loads(q)) for q in questions]
    line = {f.name: 0 for f in fields(RequestRecord)}  # every field of a real line
    runs, log = [], root / "requests.jsonl"
    with log.open("w") as requests:
        for m in range(models):
            start = 1.8e9 + m * RUN_S
            end = start + RUN_S - 1
            stamp = datetime.fromtimestamp(end).strftime("%Y-%m-%dT%H-%M-%S.%f")
            out = root / f"run-{m:02d}" / f"model-{m:02d}"
            out.mkdir(parents=True)
            results = {
                "configs": {"synthetic": {"task": "synthetic", "metric_list": [{"metric": "exact_match"}]}},
                "config": {"model": "local-chat-completions", "model_args": {"model": f"model-{m:02d}"}},
                "date": start,
            }
            (out / f"results_{stamp}.json").write_text(json.dumps(results))
            samples, lines = [], []
            for i in range(instances):
                t = int(planted.tokens[m, i])
                answer = planted.traces[m][i] if planted.traces is not None else "answer"
                samples.append(
                    json.dumps(
                        {
                            "doc_id": i,
                            "arguments": {
                                "gen_args_0": {"arg_0": [questions[i]], "arg_1": {"max_gen_toks": 4096}}
                            },
                            "resps": [[answer]],
                            "filtered_resps": [answer],
                            "filter": "none",
                            "exact_match": float(planted.correct[m, i]),
                        }
                    )
                )
                at = start + (i + 0.5) * (RUN_S - 2) / instances
                line.update(
                    request_id=f"chatcmpl-{m:02d}{i:06d}",
                    model=f"model-{m:02d}",
                    finish_reason="length" if planted.truncated[m, i] else "stop",
                    output_tokens=t,
                    pte_served=120.0 + 1.3 * t,
                    gpu_seconds=0.002 + 1e-4 * t,
                    cost_usd=(0.002 + 1e-4 * t) * 2.5 / 3600,
                    arrived_at=at,
                    finished_at=at + 0.5,
                    prompt_digest=digests[i],
                )
                lines.append(json.dumps(line))
            (out / f"samples_synthetic_{stamp}.jsonl").write_text("\n".join(samples) + "\n")
            requests.write("\n".join(lines) + "\n")
            runs.append(root / f"run-{m:02d}")
    return runs, log


def run_harness_path(root: Path, planted: Planted, args: argparse.Namespace) -> dict[str, float]:
    """The cost-per-correct path, timed by phase: read the runs and the request log, join,
    price per correct answer with intervals, then the decomposition of the joined samples."""
    phases: dict[str, float] = {}
    t = time.perf_counter()
    runs_dirs, log = synthesize_harness(root, planted)
    phases["synthesize_s"] = time.perf_counter() - t
    t0 = t = time.perf_counter()
    runs = load_runs(runs_dirs)
    phases["read_runs_s"] = time.perf_counter() - t
    t = time.perf_counter()
    requests, _ = read_request_log(log)
    phases["read_request_log_s"] = time.perf_counter() - t
    t = time.perf_counter()
    joins = join_runs(runs, requests)
    del requests
    phases["join_s"] = time.perf_counter() - t
    t = time.perf_counter()
    report = cost_report(joins, runs[0].label, str(log), n_boot=args.bootstrap, seed=args.seed)
    phases["cost_per_correct_s"] = time.perf_counter() - t
    t = time.perf_counter()
    records, _ = eval_records(joins)
    table = build_tables(records)["synthetic"]
    del records, joins, runs
    phases["build_arrays_s"] = time.perf_counter() - t
    result = timed_analysis(table, args, phases)
    t = time.perf_counter()
    json.dumps(
        {"cost": report.to_dict(), "decomposition": efficiency_json([result], {}, {})}, allow_nan=False
    )
    phases["report_json_s"] = time.perf_counter() - t
    phases["total_s"] = time.perf_counter() - t0
    phases["samples_joined"] = sum(s["samples_joined"] for s in report.to_dict()["runs"])
    phases["request_log_mib"] = log.stat().st_size / 2**20
    return phases


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
        planted = Planted.draw(args.models, args.instances, not args.no_traces, args.seed)
        n_records = synthesize(path, planted)
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
    result = timed_analysis(table, args, phases)
    t = time.perf_counter()
    report = json.dumps(efficiency_json([result], {}, {}), sort_keys=True, allow_nan=False)
    phases["report_json_s"] = time.perf_counter() - t
    total = time.perf_counter() - t_start
    views, solver_coverage = list(result.views), result.solver.coverage.value if result.solver else None
    del table, result
    with tempfile.TemporaryDirectory() as tmp:
        joined = run_harness_path(Path(tmp), planted, args)

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
            "views": views,
            "solver_coverage": solver_coverage,
        },
        # the same answers as lm-eval outputs, joined to a request log by prompt digest
        "harness_join": {k: round(v, 3) for k, v in joined.items()},
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
    print(f"  with the join: {args.models} lm-eval runs + a {joined['request_log_mib']:.0f} MiB request log")
    for k, v in joined.items():
        if k.endswith("_s"):
            print(f"    {k:<20} {v:8.2f} s")
    print(f"    samples joined       {joined['samples_joined']:8.0f} of {n_records}")
    print(f"  peak RSS           {r['peak_rss_mib']:8.1f} MiB (target < 4096 MiB)")
    m = out["machine"]
    print(
        f"  machine: {m['platform']}, {m['cpu_count']} CPUs, load average "
        f"{m['load_avg_1m']} → {out['load_avg_1m_end']}"
    )
    print(f"  wrote {dest}")
    ok = total < 60 and joined["total_s"] < 60 and r["peak_rss_mib"] < 4096
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
