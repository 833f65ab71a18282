"""``pte validate REQUEST_LOG [STEP_LOG]``: the latency validation of a server's own logs.

Does PTE, and do the seconds the engine hook attributes, track wall-clock time, and better
than token counts? The same analysis as the latency bench, on the plugin's request log
(``PTE_REQUEST_LOG``) and step log (``PTE_STEP_LOG``) of any server: correlations with
bootstrap intervals at step and request level, the step-time model's error, the seconds
checks, and for each target missed what dominates the miss. Without the bench's phases the
requests are split by what the log shows: those that had the engine to themselves (alone)
and the others (under load). Writes ``report.json``, ``report.md`` and the plots to ``--out``,
all or none (:mod:`pte_instrument.cli.outputs`).
"""

from __future__ import annotations

import argparse
import math
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from pte_instrument.cli.errors import (
    UsageError,
    nonempty,
    output_path,
    print_json,
    report_warning,
    whole_number,
)
from pte_instrument.cli.outputs import check_folder, staged_folder

REPORT_FILES = ("report.json", "report.md")  # what write_report writes into --out, beside its plots


def add_validate_parser(sub: Any) -> None:
    v = sub.add_parser(
        "validate",
        help="does PTE track wall-clock time on this server? the latency validation of its request and step logs",
    )
    v.add_argument(
        "request_log",
        type=nonempty("path"),
        help="the plugin's request log (PTE_REQUEST_LOG; .jsonl or .jsonl.gz)",
    )
    v.add_argument(
        "step_log",
        nargs="?",
        type=nonempty("path"),
        help="the engine hook's step log (PTE_STEP_LOG), for the step level",
    )
    v.add_argument(
        "--out",
        type=output_path,
        default="pte-validation",
        help="folder for report.json, report.md and the plots (written all or none; default pte-validation)",
    )
    v.add_argument(
        "--bootstrap", type=whole_number(10, 100_000), default=1000, help="bootstrap resamples (default 1000)"
    )
    v.add_argument("--seed", type=whole_number(0), default=0)
    v.add_argument("--no-plots", action="store_true", help="no PNG plots (matplotlib not needed)")
    v.add_argument("--json", action="store_true", help="print the targets and phases as JSON")
    v.set_defaults(func=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    from pte_instrument.validation import analysis as A
    from pte_instrument.validation.phases import phases_of_log
    from pte_instrument.validation.report import analyse_logs, strict_json, write_report

    requests_path = Path(args.request_log)
    steps_path = Path(args.step_log) if args.step_log else None
    out = Path(args.out)
    for path in (requests_path, steps_path):
        if path is not None and path.is_dir():
            raise UsageError(f"a directory, not a log: {path}")
        if path is not None and not path.is_file():
            raise UsageError(f"no such file: {path}")
        # report.json and report.md replace whatever --out holds under those names
        if path is not None and any(
            (out / name).exists() and (out / name).samefile(path) for name in REPORT_FILES
        ):
            raise UsageError(f"--out {out} would write its report over {path}, a log it reads")
    check_folder(out, "--out")  # refused now, not after the analysis
    problems: Counter[str] = Counter()
    try:
        table = A.request_table(A.load_jsonl(requests_path, problems), problems)
    except (OSError, EOFError, zlib.error) as e:  # a .gz that is not gzip, corrupt, or cut short
        raise UsageError(f"cannot read {requests_path}: {e}") from None
    usable = A.usable_requests(table)
    if len(usable) < 3:
        raise UsageError(
            f"{requests_path}: {len(usable)} usable requests (finished, with an inference time); "
            "at least 3 are needed"
        )
    finished = usable["finished_at"]
    arrived = usable["arrived_at"] if usable.has("arrived_at") else finished - usable["e2e_s"]
    phases = phases_of_log(usable.request_id, arrived, finished)
    try:  # with the request table given, only the step log is read
        analysis = analyse_logs(
            requests_path,
            steps_path,
            phases,
            n_boot=args.bootstrap,
            seed=args.seed,
            problems=problems,
            requests=table,
        )
    except (OSError, EOFError, zlib.error) as e:
        raise UsageError(f"cannot read {steps_path or requests_path}: {e}") from None
    if problems["not_object"]:
        n = problems["not_object"]
        report_warning("validate", f"{n} line{'s' if n != 1 else ''} skipped (not a JSON object)")
    if problems["not_number"]:
        report_warning("validate", f"{problems['not_number']} values that are not numbers read as missing")
    if problems["out_of_range"]:
        report_warning(
            "validate",
            f"{problems['out_of_range']} values out of range (negative, not finite, or past 2**53) read as missing",
        )
    if problems["header"]:
        report_warning(
            "validate", "the step log's header is not of the types or shape pte calibrate reads: ignored"
        )
    meta = {
        "source": {"request_log": str(requests_path), "step_log": str(steps_path) if steps_path else None},
        "phases": [p.to_dict() for p in phases],
    }
    logs = [p for p in (requests_path, steps_path) if p is not None]
    try:
        with staged_folder(out, "--out", logs) as staging:
            written = write_report(analysis, meta, staging, plots=not args.no_plots)
    except OSError as e:  # a full or read-only disk, a file size limit
        raise UsageError(f"cannot write the report to {out}: {e.strerror or e}; nothing written") from None
    files = [out / f.name for f in written]
    targets = [t.to_dict() for t in analysis.targets]
    if args.json:
        print_json(
            strict_json(
                {
                    "out": str(args.out),
                    "files": [str(f) for f in files],
                    "phases": meta["phases"],
                    "targets": targets,
                }
            )
        )
        return 0
    console = Console(markup=False)  # paths and names are text, whatever brackets they hold
    console.print(_phase_table(phases, analysis))
    console.print(_request_table(analysis))
    console.print(_target_table(targets))
    for x in targets:
        if x["met"] is False and x.get("diagnosis"):
            console.print(Text.assemble((x["name"], "bold"), f" missed: {x['diagnosis']}"), highlight=False)
    console.print(f"report: {', '.join(str(f) for f in files)}")
    return 0


def _num(v: float | None, nd: int = 3) -> str:
    return "—" if v is None or not math.isfinite(v) else f"{v:.{nd}f}"


def _phase_table(phases: list[Any], analysis: Any) -> Table:
    t = Table(title="what the log holds")
    for c in ("phase", "requests", "concurrency", "span s"):
        t.add_column(c)
    for p in phases:
        n = len(analysis.phase_requests.get(p.name, ()))
        t.add_row(p.name, str(n), str(p.concurrency), f"{p.t_end - p.t_start:.1f}")
    return t


def _request_table(analysis: Any) -> Table:
    """Each request-level metric's Pearson r against the request's inference time, per phase."""
    t = Table(title="request level: r with inference time [95% interval]")
    levels = [lv for lv in analysis.levels if lv.level in ("request", "step")]
    t.add_column("metric")
    for lv in levels:
        t.add_column(f"{lv.level} {lv.phase} (n={lv.n})")
    names: list[str] = []
    for lv in levels:
        names += [m.name for m in lv.metrics if m.name not in names]
    for name in names:
        cells = []
        for lv in levels:
            m = lv.get(name)
            if m is None:
                cells.append("")
                continue
            lo, hi = m.corr.pearson_ci
            ci = "" if np.isnan(lo) else f" [{lo:.2f}, {hi:.2f}]"
            cells.append(f"{_num(m.corr.pearson)}{ci}")
        t.add_row(name, *cells)
    return t


def _target_table(targets: list[dict[str, Any]]) -> Table:
    t = Table(title="targets")
    for c in ("", "target", "value", "95% interval", "wanted"):
        t.add_column(c, overflow="fold")
    for x in targets:
        met = {True: "met", False: "MISSED", None: "n/a"}[x["met"]]
        ci = x.get("ci")
        interval = "" if not ci or None in ci else f"[{ci[0]:.3f}, {ci[1]:.3f}]"
        t.add_row(met, x["name"], _num(x["value"], 4), interval, x["target"])
    return t
