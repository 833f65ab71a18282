"""``pte efficiency`` and ``pte report``: hooks that add the two subcommands to the ``pte``
argparse CLI. ``pte report`` reads a trajectory log or the plugin's request log, told apart
by the file's first JSON object. Each handler returns an exit code; bad input gives one line on stderr and
exit code 2, never a traceback (the convention of :mod:`pte_instrument.cli.errors`). Human
output is markdown; ``--json`` is stable JSON. matplotlib and pyarrow are imported only by
the commands that use them (``--plots``, Parquet input)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pte_instrument.cli.errors import (
    UsageError,
    name_list,
    nonempty,
    output_path,
    print_json,
    report_error,
    report_warning,
    whole_number,
)
from pte_instrument.cli.outputs import check_folder, staged_folder
from pte_instrument.cost.architecture import ArchitectureError, KVGroup, ModelShape, load_config, parse_shape
from pte_instrument.cost.devices import DeviceProfile, UnknownDeviceError, resolve_device
from pte_instrument.cost.model import CostModel
from pte_instrument.offline.decomposition import DEFAULT_BOOTSTRAP, DEFAULT_SPLITS, AnalysisError, analyze
from pte_instrument.offline.records import RecordError, build_tables, load_records
from pte_instrument.offline.request_log import (
    DEFAULT_LIMIT,
    SORT_KEYS,
    detect_kind,
    is_gzip,
    join_request_log,
    load_request_log,
    request_log_markdown,
    request_log_report,
)

MAX_WARNINGS = 20
_non_negative = whole_number(0)  # a seed too: numpy takes any integer from 0
# Resamples and splits are each a row of an array: past this, numpy cannot allocate them.
_resamples = whole_number(0, 100_000)


def _warn_problems(command: str, problems: list[Any]) -> None:
    for p in problems[:MAX_WARNINGS]:
        report_warning(command, p.describe())
    if len(problems) > MAX_WARNINGS:
        report_warning(command, f"… and {len(problems) - MAX_WARNINGS} more (listed in the report)")


def _write_plots(command: str, plots: list[tuple[Any, Any]], out_dir: str, inputs: list[str]) -> None:
    """Write one command's plots (each ``plot(data, folder)`` of ``plots``) into ``out_dir``,
    all or none, naming each file on stderr; a plotting problem (no matplotlib) is bad input
    like any other."""
    from pte_instrument.offline.plots import PlotError

    try:
        with staged_folder(out_dir, "--plots", inputs) as staging:
            names = [path.name for plot, data in plots for path in plot(data, staging)]
    except PlotError as e:
        raise UsageError(str(e)) from None
    except OSError as e:  # a full or read-only disk, a file size limit
        raise UsageError(f"cannot write the plots to {out_dir}: {e.strerror or e}; nothing written") from None
    for name in names:
        print(f"pte {command}: wrote {Path(out_dir) / name}", file=sys.stderr)


def _run(command: str, fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return fn(args)
    except (UsageError, RecordError, AnalysisError, ArchitectureError, UnknownDeviceError) as e:
        return report_error(command, e)
    except OSError as e:
        return report_error(command, f"{e.strerror or e}: {e.filename or ''}".rstrip(": "))


def _output_options(
    p: argparse.ArgumentParser,
    command: str,
    fn: Callable[[argparse.Namespace], int],
    plots_help: str = "write PNG plots to DIR (all or none)",
) -> argparse.ArgumentParser:
    """The options both commands share, and the command run under the one error convention."""
    p.add_argument("--json", action="store_true", help="stable JSON on stdout")
    p.add_argument("--plots", metavar="DIR", type=output_path, help=plots_help)
    p.set_defaults(func=lambda args: _run(command, fn, args))
    return p


# =========================================================================== efficiency


def add_efficiency_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "efficiency",
        help="evaluation records or harness outputs → reasoning-efficiency decomposition and cost per correct answer",
        description="Decompose token efficiency E0 against a reference model: outcome, "
        "workload and trace layers with bootstrap intervals, solver-derived workload audits "
        "and a diagnostic signature per model. Records: JSONL, CSV or Parquet. Or the outputs "
        "of the evaluation harnesses themselves — lm-eval's --output_path directory (run with "
        "--log_samples) and Inspect AI's logs (.eval, .json) — with the plugin's request log "
        "(--request-log): each sample joined to the requests that served it (by response id, "
        "or by prompt digest), and what a correct answer cost in output tokens, PTE, GPU "
        "seconds and money, per task and run; two runs side by side, with the terms "
        "(verbosity, price per token, truncation, logic) that make the difference.",
    )
    p.add_argument(
        "records",
        nargs="+",
        type=nonempty("path"),
        help="evaluation record file(s) (.jsonl, .csv, .parquet), or harness outputs: "
        "lm-eval output directories or results_*.json files, Inspect AI logs or log directories",
    )
    p.add_argument(
        "--reference",
        type=nonempty("name"),
        help="the reference model (records) or run (harness outputs: default the first) for Δlog terms",
    )
    p.add_argument(
        "--benchmark", type=nonempty("name"), help="analyse only this benchmark or task (default: every one)"
    )
    p.add_argument(
        "--workload",
        choices=("native", "solver"),
        default=None,
        help="workload source (default: native where the records carry it)",
    )
    p.add_argument(
        "--pool",
        type=name_list,
        help="comma-separated reference pool for --workload solver (default: every model)",
    )
    p.add_argument(
        "--bootstrap",
        type=_resamples,
        default=DEFAULT_BOOTSTRAP,
        help=f"bootstrap resamples over instances (default {DEFAULT_BOOTSTRAP}; 0: none)",
    )
    p.add_argument(
        "--splits",
        type=_resamples,
        default=DEFAULT_SPLITS,
        help=f"held-out pool splits for the solver audit (default {DEFAULT_SPLITS})",
    )
    p.add_argument("--seed", type=_non_negative, default=0)
    p.add_argument(
        "--request-log",
        type=nonempty("path"),
        help="the plugin's request log (PTE_REQUEST_LOG): records take PTE from it by request_id or "
        "session_id; harness samples are joined to their requests in it (required with harness outputs)",
    )
    p.add_argument(
        "--strict", action="store_true", help="fail on any bad record instead of dropping and listing it"
    )
    harness = p.add_argument_group("harness outputs")
    harness.add_argument(
        "--metric",
        type=nonempty("name"),
        help="the metric (lm-eval) or scorer (Inspect AI) whose full score is a correct answer "
        "(default: each task's first, its primary one)",
    )
    harness.add_argument(
        "--filter",
        type=nonempty("name"),
        help="lm-eval: the filter whose scores count (default: the first in each samples file)",
    )
    harness.add_argument(
        "--labels",
        type=name_list,
        help="comma-separated names of the runs, in the order read (default: the model's name, "
        "numbered where runs share one)",
    )
    return _output_options(p, "efficiency", _efficiency)


def _each_once(paths: list[str]) -> None:
    """Refuse a file or folder given twice (by another name or a link too): its records would
    all be duplicates of each other, and every copy of a duplicate is dropped. A harness
    output is the results files and logs it is read from: a run given as its folder and as
    its file would be read twice, the second copy finding its requests taken."""
    from pte_instrument.offline.harness_outputs import harness_files

    seen: list[tuple[Path, str]] = []
    for name in paths:
        p = Path(name)
        if not p.exists():
            continue
        for f in harness_files(p) or [p]:
            for q, given in seen:
                if f.samefile(q):
                    raise UsageError(f"{_named(f, name)} is {_named(q, given)} again: give each input once")
            seen.append((f, name))


def _named(path: Path, given: str) -> str:
    """A file read, named as given, or by the folder given that holds it."""
    return given if path == Path(given) else f"{path} (in {given})"


def _efficiency(args: argparse.Namespace) -> int:
    _each_once(args.records)
    pool = args.pool
    if pool is not None and args.workload != "solver":
        raise UsageError("--pool applies only with --workload solver")
    if args.plots:  # refused now, not after the analysis
        check_folder(args.plots, "--plots")
    from pte_instrument.offline.harness_outputs import is_harness_output

    harness = [is_harness_output(p) for p in args.records]
    if any(harness):
        if not all(harness):
            bad = next(p for p, h in zip(args.records, harness, strict=True) if not h)
            raise UsageError(
                f"{bad} is not a harness output: give evaluation records or harness outputs, not both"
            )
        return _harness_efficiency(args, pool)
    for name, flag in (("metric", "--metric"), ("filter", "--filter"), ("labels", "--labels")):
        if getattr(args, name) is not None:
            raise UsageError(f"{flag} applies only to harness outputs")
    if args.reference is None:
        raise UsageError("--reference is required with evaluation records")
    loaded = load_records(args.records, strict=args.strict)
    if args.request_log:
        loaded.records, more = join_request_log(loaded.records, args.request_log)
        loaded.problems += more
    _warn_problems("efficiency", loaded.problems)
    results = _decompose(args, build_tables(loaded.records), lambda _: args.reference, pool)
    return _print_efficiency(args, results, loaded.summary(), args.reference, pool)


def _decompose(
    args: argparse.Namespace, tables: dict[str, Any], reference: Callable[[Any], str], pool: list[str] | None
) -> list[Any]:
    """Each benchmark's decomposition against its ``reference(table)``."""
    if args.benchmark is not None:
        if args.benchmark not in tables:
            raise UsageError(
                f"benchmark {args.benchmark!r} not in the records (benchmarks: {', '.join(tables)})"
            )
        tables = {args.benchmark: tables[args.benchmark]}
    missing = [b for b, t in tables.items() if reference(t) not in t.models]
    if missing:
        ref = reference(tables[missing[0]])
        raise UsageError(f"reference model {ref!r} has no records in benchmark(s) {', '.join(missing)}")
    if pool is not None:
        for b, t in tables.items():
            unknown = [m for m in pool if m not in t.models]
            if unknown:
                raise UsageError(f"pool model(s) {', '.join(unknown)} not in benchmark {b!r}")
    return [
        analyze(
            t,
            reference(t),
            workload=args.workload,
            pool=pool,
            n_boot=args.bootstrap,
            n_splits=args.splits,
            seed=args.seed,
        )
        for t in tables.values()
    ]


def _print_efficiency(
    args: argparse.Namespace,
    results: list[Any],
    summary: dict[str, Any],
    reference: str,
    pool: list[str] | None,
    cost: Any = None,
) -> int:
    """The decomposition (and, from harness outputs, the cost per correct answer) as JSON,
    or as tables and markdown; the plots where asked."""
    from pte_instrument.offline.render import efficiency_json, efficiency_markdown

    if args.plots:
        from pte_instrument.offline.plots import efficiency_plots

        plots: list[tuple[Any, Any]] = [(efficiency_plots, results)]
        if cost is not None:
            from pte_instrument.offline.cost_render import cost_plots

            plots.append((cost_plots, cost))
        inputs = [*args.records, *([args.request_log] if args.request_log else [])]
        _write_plots("efficiency", plots, args.plots, inputs)
    if args.json:
        settings = {
            "reference": reference,
            "workload": args.workload,
            "pool": pool,
            "bootstrap": args.bootstrap,
            "splits": args.splits,
            "seed": args.seed,
            "benchmark": args.benchmark,
            "interval_percentiles": [2.5, 97.5],
        }
        out = efficiency_json(results, summary, settings)
        print_json(out if cost is None else {"cost_per_correct": cost.to_dict(), "decomposition": out})
    else:
        if cost is not None:
            from pte_instrument.offline.cost_render import print_cost_report

            print_cost_report(cost)
            sys.stdout.write("\n")
        sys.stdout.write(efficiency_markdown(results, summary))
    return 0


def _harness_efficiency(args: argparse.Namespace, pool: list[str] | None) -> int:
    from pte_instrument.offline.cost_per_correct import cost_report, eval_records, join_runs, read_request_log
    from pte_instrument.offline.harness_outputs import load_runs
    from pte_instrument.offline.harness_runs import task_reference
    from pte_instrument.offline.lm_eval_reader import is_output as is_lm_eval_output
    from pte_instrument.prompt_digest import key_bytes
    from pte_instrument.settings import read

    if not args.request_log:
        raise UsageError(
            "harness outputs need --request-log: the plugin's request log of the server they ran against"
        )
    if args.filter is not None and not any(is_lm_eval_output(p) for p in args.records):
        raise UsageError("--filter applies only to lm-eval outputs (Inspect AI logs have no filters)")
    labels = args.labels
    key, _ = read("PTE_PROMPT_DIGEST_KEY")
    runs = load_runs(
        args.records,
        metric=args.metric,
        lm_eval_filter=args.filter,
        labels=labels,
        key=key_bytes(key),
    )
    names = [r.label for r in runs]
    reference = args.reference or names[0]
    if args.reference is not None and reference not in names:
        raise UsageError(f"reference run {reference!r} not among the runs read ({', '.join(names)})")
    requests, log_problems = read_request_log(args.request_log)
    joins = join_runs(runs, requests)
    if args.benchmark is not None:
        tasks = {t for r in runs for t in r.metrics}
        if args.benchmark not in tasks:
            raise UsageError(f"task {args.benchmark!r} not in the runs (tasks: {', '.join(sorted(tasks))})")
        task = args.benchmark
        joins = [
            replace(
                j,
                run=replace(j.run, metrics={task: j.run.metrics[task]}),
                joined=tuple(s for s in j.joined if s.sample.task == task),
            )
            for j in joins
            if task in j.run.metrics
        ]
    cost = cost_report(
        joins,
        reference,
        str(args.request_log),
        n_boot=args.bootstrap,
        seed=args.seed,
        log_problems=log_problems,
    )
    records, problems = eval_records(joins)
    problems = (
        [p for r in runs for p in r.problems]
        + [p for j in joins for p in j.problems]
        + problems
        + log_problems
    )
    _warn_problems("efficiency", problems)
    for j in joins:
        s = j.summary()
        if s["samples_unmatched"] or s["requests_unmatched"]:
            report_warning(
                "efficiency",
                f"{s['label']}: {s['samples_unmatched']} of {s['samples']} samples not joined, "
                f"{s['requests_unmatched']} of the {s['requests_in_window']} requests in its window joined to no sample",
            )
    if not any(j.joined for j in joins):
        raise UsageError("no sample joined to the request log (see the lines above)")
    # Joined samples that generated no token (every request aborted, or answered empty) have
    # a cost per correct answer but no place in the decomposition (T > 0): it is left empty.
    order = {name: k for k, name in enumerate(names)}
    results = _decompose(
        args,
        build_tables(records),
        lambda t: task_reference(args.reference, sorted(t.models, key=order.__getitem__)),
        pool,
    )
    summary = {
        "sources": [str(p) for p in args.records],
        "rows_read": sum(len(r.samples) for r in runs),
        "rows_used": len(records),
        "rows_dropped": sum(len(r.samples) for r in runs) - len(records),
        "problems": [p.to_dict() for p in problems],
    }
    return _print_efficiency(args, results, summary, reference, pool, cost)


# =========================================================================== report


def _positive_float(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {v!r}") from None
    # 2γ finite too: cost_model_for_gamma stores 2γ bytes per token (past it, γ prices as inf)
    if not (math.isfinite(2.0 * x) and x > 0):
        raise argparse.ArgumentTypeError(
            f"must be a positive number below {sys.float_info.max / 2:.3g}, got {v}"
        )
    return x


def cost_model_for_gamma(gamma: float) -> CostModel:
    """A CostModel whose γ is exactly ``gamma``: one full-attention KV group of 2γ bytes per
    token, N_active = 1, HOI = 1 (γ = bytes · HOI / (2 · N_active)). Pricing then goes
    through the same core formula as a model read from its config."""
    shape = ModelShape.from_kv_groups("gamma-override", (KVGroup(1, 2.0 * gamma, None),), n_active=1.0)
    device = DeviceProfile(f"gamma={gamma:g}", 1.0, 1.0, "γ given on the command line")
    return CostModel(shape, device)


def _positive_int(v: str) -> int:
    n = _non_negative(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


# Options of one kind of log only (dest → flag): given with the other kind, bad input.
TRAJECTORY_ONLY = {
    "model_dir": "--model-dir",
    "gamma": "--gamma",
    "device": "--device",
    "variant": "--variant",
    "bootstrap": "--bootstrap",
    "seed": "--seed",
    "plots": "--plots",
}
REQUEST_LOG_ONLY = {"limit": "--limit", "sort": "--sort"}


def add_report_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help="trajectory log → PTE tables and patterns; request log → GPU seconds and cost",
        description="A trajectory log (JSONL, see docs/efficiency.md): price the agent trajectories "
        "in PTE and report accuracy, uncached tokens, tool calls, average PTE, the four tool-use "
        "inefficiency patterns with their PTE multipliers, per-step PTE and correct vs incorrect "
        "PTE (needs --model-dir or --gamma). The plugin's request log (PTE_REQUEST_LOG, JSONL or "
        ".gz; told apart by its lines' request_id and pte_served): GPU seconds by term, predicted "
        "seconds, latency explained, interference share, cost and served PTE, per model and for "
        "the top sessions (already priced by the server: no cost options).",
    )
    p.add_argument(
        "log",
        metavar="LOG",
        type=nonempty("path"),
        help="trajectory JSONL file, or the plugin's request log (.jsonl, .gz)",
    )
    cost = p.add_mutually_exclusive_group()
    cost.add_argument(
        "--model-dir",
        type=nonempty("path"),
        help="trajectories: model directory or config.json (γ from its shape)",
    )
    cost.add_argument("--gamma", type=_positive_float, help="trajectories: use this γ directly")
    p.add_argument(
        "--device",
        type=nonempty("device name"),
        default=None,
        help="trajectories: device profile with --model-dir (default auto)",
    )
    p.add_argument(
        "--variant",
        choices=("served", "reference", "ideal"),
        default=None,
        help="trajectories: PTE variant for patterns, steps and correct-vs-incorrect (default served)",
    )
    p.add_argument(
        "--bootstrap", type=_resamples, default=None, help=f"trajectories (default {DEFAULT_BOOTSTRAP})"
    )
    p.add_argument("--seed", type=_non_negative, default=None, help="trajectories (default 0)")
    p.add_argument(
        "--limit",
        type=_positive_int,
        default=None,
        help=f"request log: sessions shown (default {DEFAULT_LIMIT})",
    )
    p.add_argument(
        "--sort",
        choices=("auto", *SORT_KEYS),
        default=None,
        help="request log: rank sessions by this total (default auto: cost_usd when priced, "
        "else gpu_seconds with the step hook, else pte_served)",
    )
    p.add_argument(
        "--strict", action="store_true", help="fail on any bad line instead of dropping and listing it"
    )
    p.set_defaults(report_parser=p)
    # a request log has no plots: --plots with one is refused
    return _output_options(p, "report", _report, "trajectories: write PNG plots to DIR (all or none)")


def _given(args: argparse.Namespace, options: dict[str, str]) -> list[str]:
    return [flag for dest, flag in options.items() if getattr(args, dest) is not None]


def _report(args: argparse.Namespace) -> int:
    if detect_kind(args.log) == "requests":
        return _report_requests(args)
    if is_gzip(args.log):
        raise UsageError(
            f"{args.log}: a gzipped trajectory log: gunzip it first (only request logs are read as .gz)"
        )
    given = _given(args, REQUEST_LOG_ONLY)
    if given:
        raise UsageError(f"{args.log} is a trajectory log; options for request logs only: {', '.join(given)}")
    if args.gamma is None and args.model_dir is None:
        # a command-line error like argparse's own (usage line, exit 2)
        args.report_parser.error(
            f"{args.log} is a trajectory log: one of the arguments --model-dir --gamma is required"
        )
    if args.gamma is not None and args.device is not None:  # γ given: no device to price with
        raise UsageError("--device applies only with --model-dir (--gamma is γ on its own device)")
    return _report_trajectories(args)


def _report_requests(args: argparse.Namespace) -> int:
    given = _given(args, TRAJECTORY_ONLY)
    if given:
        raise UsageError(
            f"{args.log} is a request log, priced by the server; options for trajectory logs only: "
            f"{', '.join(given)}"
        )
    loaded = load_request_log(args.log, strict=args.strict)
    _warn_problems("report", list(loaded.problems))
    limit = DEFAULT_LIMIT if args.limit is None else args.limit
    report = request_log_report(loaded, args.sort or "auto", limit)
    if args.json:
        print_json(report)
    else:
        sys.stdout.write(request_log_markdown(report))
    return 0


def _report_trajectories(args: argparse.Namespace) -> int:
    from pte_instrument.offline.patterns import load_trajectories, trajectory_report
    from pte_instrument.offline.render import trajectory_json, trajectory_markdown

    if args.plots:  # refused now, not after the analysis
        check_folder(args.plots, "--plots")
    variant = args.variant or "served"
    bootstrap = DEFAULT_BOOTSTRAP if args.bootstrap is None else args.bootstrap
    seed = 0 if args.seed is None else args.seed
    if args.gamma is not None:
        model = cost_model_for_gamma(args.gamma)
    else:
        model = CostModel(parse_shape(load_config(args.model_dir)), resolve_device(args.device or "auto"))
    loaded = load_trajectories(args.log, strict=args.strict)
    _warn_problems("report", loaded.problems)
    groups = trajectory_report(loaded.trajectories, model, variant, bootstrap, seed)
    info = model.describe()
    cost = {
        "gamma": info["gamma"],
        "device": info["device"],
        "hoi": info["hoi"],
        "source": "--gamma" if args.gamma is not None else str(args.model_dir),
    }
    if args.plots:
        from pte_instrument.offline.plots import trajectory_plots

        _write_plots("report", [(trajectory_plots, groups)], args.plots, [args.log])
    if args.json:
        settings = {"variant": variant, "bootstrap": bootstrap, "seed": seed}
        print_json(trajectory_json(groups, cost, loaded.summary(), settings))
    else:
        sys.stdout.write(trajectory_markdown(groups, cost, loaded.summary(), variant))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m pte_instrument.cli.efficiency``) with both commands."""
    parser = argparse.ArgumentParser(prog="pte")
    sub = parser.add_subparsers(dest="command", required=True)
    add_efficiency_parser(sub)
    add_report_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
