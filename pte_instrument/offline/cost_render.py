"""The cost-per-correct report in the terminal (rich tables) and as PNG plots."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import IO

from pte_instrument.offline.cost_per_correct import TERMS, UNIT_LABELS, UNITS, CostReport, Estimate
from pte_instrument.offline.render import fmt

TERM_LABELS = {
    "verbosity": "verbosity",
    "price_per_token": "price per token",
    "truncation": "truncation",
    "logic": "logic",
}
PLAIN_WIDTH = 220  # columns when the output is not a terminal (a file, a pipe)


def _est(e: Estimate | None, digits: int = 3) -> str:
    if e is None or not math.isfinite(e.value):
        return "–"
    if math.isfinite(e.low) and math.isfinite(e.high):
        return f"{fmt(e.value, digits)} [{fmt(e.low, digits)}, {fmt(e.high, digits)}]"
    return fmt(e.value, digits)


def print_cost_report(report: CostReport, file: IO[str] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    out = file or sys.stdout
    # markup off: run labels, task names and problems are the inputs' text, printed as it is
    console = Console(file=out, width=None if out.isatty() else PLAIN_WIDTH, soft_wrap=False, markup=False)

    def table(title: str, names: tuple[str, ...], columns: tuple[str, ...]) -> Table:
        """A table whose first ``names`` columns are text (left) and the rest figures (right)."""
        t = Table(title=title, title_justify="left")
        for col in columns:
            t.add_column(col, justify="left" if col in names else "right")
        return t

    joins = table(
        "Samples joined to the request log",
        ("run", "harness", "model"),
        (
            "run",
            "harness",
            "model",
            "samples",
            "joined",
            "unmatched",
            "requests joined",
            "requests in window, unmatched",
        ),
    )
    for j in report.joins:
        s = j.summary()
        why = ", ".join(f"{n} {reason}" for reason, n in s["samples_unmatched_by_reason"].items())
        joins.add_row(
            s["label"],
            s["harness"],
            s["model"],
            str(s["samples"]),
            str(s["samples_joined"]),
            f"{s['samples_unmatched']}" + (f" ({why})" if why else ""),
            str(s["requests_joined"]),
            f"{s['requests_unmatched']} of {s['requests_in_window']}",
        )
    console.print(joins)

    costs = table(
        "Cost per correct answer (95% bootstrap interval)",
        ("task", "run", "metric"),
        (
            "task",
            "run",
            "metric",
            "n",
            "accuracy",
            "completion",
            "cond. correct",
            "E0",
            *(UNIT_LABELS[u] for u in UNITS),
        ),
    )
    for t in report.tasks:
        costs.add_row(
            t.task,
            t.run,
            t.metric,
            str(t.samples),
            _est(t.accuracy),
            _est(t.completion_rate),
            _est(t.conditional_correctness),
            _est(t.e0),
            *(_est(t.per_correct[u]) for u in UNITS),
        )
    console.print(costs)

    if report.comparisons:
        cmp = table(
            "Each run against its task's reference: the ratio of their costs per correct answer, "
            "and the Δlog terms that sum to its log",
            ("task", "run", "reference", "unit", "explained by"),
            ("task", "run", "reference", "unit", "ratio", *(TERM_LABELS[t] for t in TERMS), "explained by"),
        )
        for c in report.comparisons:
            for unit, u in c.units.items():
                cmp.add_row(
                    c.task,
                    c.run,
                    c.reference,
                    UNIT_LABELS[unit],
                    _est(u.ratio),
                    *(_est(u.terms[t]) for t in TERMS),
                    TERM_LABELS[u.dominant],
                )
        console.print(cmp)
        for c in report.comparisons:
            for note in c.notes:
                console.print(f"{c.task} / {c.run}: {note}")
    problems = [p for j in report.joins for p in (*j.run.problems, *j.problems)] + report.log_problems
    if problems:
        console.print(f"{len(problems)} problem(s) reading the inputs; the first: {problems[0].describe()}")


def cost_plots(report: CostReport, out_dir: str | Path) -> list[Path]:
    """``cost_per_correct.png`` (each unit, per task and run, with intervals) and, with a
    comparison, ``cost_terms.png`` (the Δlog terms of each run against the reference)."""
    from pte_instrument.offline.plots import pyplot, save_figure

    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    units = [u for u in UNITS if any(t.per_correct[u] is not None for t in report.tasks)]
    fig, axes = plt.subplots(1, len(units), figsize=(4 * len(units), 3.6), squeeze=False)
    labels = [f"{t.task}\n{t.run}" for t in report.tasks]
    for ax, unit in zip(axes[0], units, strict=True):
        est = [t.per_correct[unit] for t in report.tasks]
        values = [e.value if e is not None else math.nan for e in est]
        err = [
            [max(0.0, e.value - e.low) if e is not None and math.isfinite(e.low) else 0.0 for e in est],
            [max(0.0, e.high - e.value) if e is not None and math.isfinite(e.high) else 0.0 for e in est],
        ]
        ax.bar(range(len(values)), values, yerr=err, capsize=3, color="#4c72b0")
        ax.set_xticks(range(len(values)), labels, fontsize=7)
        ax.set_title(f"{UNIT_LABELS[unit]} per correct answer", fontsize=9)
    paths.append(save_figure(fig, out / "cost_per_correct.png"))
    rows = [(c, unit, u) for c in report.comparisons for unit, u in c.units.items()]
    if rows:
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.4))
        up = [0.0] * len(rows)  # where each row's positive and negative stacks have reached
        down = [0.0] * len(rows)
        colors = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")
        for term, color in zip(TERMS, colors, strict=True):
            widths = [u.terms[term].value for _, _, u in rows]
            starts = [u0 if w >= 0 else d0 + w for u0, d0, w in zip(up, down, widths, strict=True)]
            ax.barh(
                range(len(rows)), [abs(w) for w in widths], left=starts, color=color, label=TERM_LABELS[term]
            )
            up = [u0 + max(w, 0.0) for u0, w in zip(up, widths, strict=True)]
            down = [d0 + min(w, 0.0) for d0, w in zip(down, widths, strict=True)]
        ax.scatter(
            [math.log(u.ratio.value) for _, _, u in rows],
            range(len(rows)),
            color="black",
            zorder=3,
            label="Δlog total",
        )
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_yticks(
            range(len(rows)), [f"{c.task} {c.run} ({UNIT_LABELS[unit]})" for c, unit, _ in rows], fontsize=7
        )
        ax.set_xlabel("Δlog cost per correct answer against the task's reference")
        ax.legend(fontsize=7, loc="best")
        paths.append(save_figure(fig, out / "cost_terms.png"))
    return paths
