"""Reports: stable JSON dicts (for ``--json``, sorted keys, no NaN — undefined is ``null``)
and markdown tables (the human output) for the efficiency and trajectory analyses."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pte_instrument.offline.decomposition import (
    BenchmarkResult,
    Estimate,
    Signature,
    SolverResult,
    ViewResult,
)
from pte_instrument.offline.patterns import PATTERNS, GroupReport
from pte_instrument.offline.statistics import finite_or_none as _num

EFFICIENCY_SCHEMA = "pte-efficiency/1"
TRAJECTORY_SCHEMA = "pte-trajectory-report/1"

CAVEATS = (
    "Token counts are visible output tokens: they are not FLOPs or latency. PTE (beside E0 "
    "where the records carry it) prices the work those tokens cost.",
    "Compression (σ_c, q_trace) measures surface redundancy, not semantic validity.",
    "Each view's Δlog decomposition is exact on the instances the model shares with the "
    "reference in that view; views can cover different instance sets.",
    "Intervals are 95 % percentile bootstrap intervals over instances (paired across models).",
)
TERM_LABELS = {
    "ctx": "Δlog r_ctx",
    "logic": "Δlog r_logic",
    "length": "−Δlog E[T]",
    "overhead": "−Δlog V̄O",
    "coupling": "−Δlog κ",
    "q_trace": "Δlog q_trace",
    "overhead_sig": "−Δlog V̄O_sig",
    "coupling_sig": "−Δlog κ_sig",
    "length_sig": "−Δlog E[T_sig]",
}
QUANTITY_LABELS = {
    "n": "n",
    "accuracy": "accuracy",
    "e0": "E0 (correct/1k tok)",
    "mean_tokens": "E[T]",
    "r_ctx": "r_ctx",
    "r_logic": "r_logic",
    "pte_per_correct": "PTE/correct",
    "mean_pte": "mean PTE",
    "loop_repeat": "loop: repeated 4-grams",
    "loop_prompt_overlap": "loop: prompt overlap",
    "n_truncated_traces": "truncated traces",
    "mean_workload": "E[W]",
    "vo": "V̄O",
    "kappa": "κ",
    "q_trace": "q_trace",
    "mean_signal_tokens": "E[T_sig]",
    "vo_sig": "V̄O_sig",
    "kappa_sig": "κ_sig",
}


# =========================================================================== JSON


def _view_json(v: ViewResult) -> dict[str, Any]:
    return {
        "terms": list(v.terms),
        "models": {
            m: {
                "quantities": {q: e.to_dict() for q, e in v.quantities[m].items()},
                "decomposition": {
                    "n_shared": d.n_shared,
                    "dlog_e0": d.dlog_e0.to_dict(),
                    "terms": {t: e.to_dict() for t, e in d.terms.items()},
                    "residual": _num(d.residual),
                },
            }
            for m, d in v.decomposition.items()
        },
    }


def _solver_json(s: SolverResult) -> dict[str, Any]:
    a = s.audits
    return {
        "ordering": [{"model": m, "e0": _num(e)} for m, e in s.ordering],
        "instance_solver": dict(s.instance_solver),
        "n_covered": s.n_covered,
        "coverage": s.coverage.to_dict(),
        "shares": {m: e.to_dict() for m, e in s.shares.items()},
        "top1_share": s.top1_share.to_dict(),
        "top3_share": s.top3_share.to_dict(),
        "effective_solvers": s.effective_solvers.to_dict(),
        "audits": {
            "leave_self_out": {k: _num(v) for k, v in a.leave_self_out.items()},
            "leave_top_k": {
                str(k): {"removed": v["removed"], "vo": _num(v["vo"]), "kappa": _num(v["kappa"])}
                for k, v in a.leave_top_k.items()
            },
            "held_out": {
                k: {
                    "n_splits": h.n_splits,
                    "n_valid": h.n_valid,
                    "median": _num(h.median),
                    "p5": _num(h.p5),
                    "p95": _num(h.p95),
                }
                for k, h in a.held_out.items()
            },
        },
    }


def _signature_json(s: Signature) -> dict[str, Any]:
    return {
        "label": s.label,
        "view": s.view,
        "term": s.term,
        "value": _num(s.value),
        "significant": s.significant,
    }


def benchmark_json(r: BenchmarkResult) -> dict[str, Any]:
    return {
        "reference": r.reference,
        "models": list(r.models),
        "n_instances": r.n_instances,
        "workload_source": r.workload_source,
        "views": {name: _view_json(v) for name, v in r.views.items()},
        "solver": None if r.solver is None else _solver_json(r.solver),
        "signatures": {m: _signature_json(s) for m, s in r.signatures.items()},
        "notes": list(r.notes),
    }


def efficiency_json(
    results: Sequence[BenchmarkResult], input_summary: dict[str, Any], settings: dict[str, Any]
) -> dict[str, Any]:
    return {
        "schema": EFFICIENCY_SCHEMA,
        "settings": dict(settings),
        "input": input_summary,
        "caveats": list(CAVEATS),
        "benchmarks": {r.benchmark: benchmark_json(r) for r in results},
    }


def _group_json(g: GroupReport) -> dict[str, Any]:
    c = g.correct_vs_incorrect
    return {
        "model": g.model,
        "task": g.task,
        "n": g.n,
        "accuracy": _num(g.accuracy),
        "avg_uncached_tokens": _num(g.avg_uncached_tokens),
        "tool_calls_per_trajectory": _num(g.tool_calls_per_trajectory),
        "avg_pte": {k: _num(v) for k, v in g.avg_pte.items()},
        "patterns": {
            k: {
                "count": p.count,
                "frequency": _num(p.frequency),
                "mean_pte": _num(p.mean_pte),
                "multiplier": _num(p.multiplier),
            }
            for k, p in g.patterns.items()
        },
        "pattern_free": {"count": g.pattern_free_n, "mean_pte": _num(g.pattern_free_mean_pte)},
        "per_step": [{"turn": s.turn, "n": s.n, "mean_pte": _num(s.mean_pte)} for s in g.per_step],
        "step_rho": _num(g.step_rho),
        "correct_vs_incorrect": {
            "n_correct": c.n_correct,
            "n_incorrect": c.n_incorrect,
            "mean_correct": c.mean_correct.to_dict(),
            "mean_incorrect": c.mean_incorrect.to_dict(),
            "ratio_incorrect_to_correct": c.ratio.to_dict(),
        },
    }


def trajectory_json(
    groups: Sequence[GroupReport],
    cost: dict[str, Any],
    input_summary: dict[str, Any],
    settings: dict[str, Any],
) -> dict[str, Any]:
    return {
        "schema": TRAJECTORY_SCHEMA,
        "cost_model": cost,
        "settings": dict(settings),
        "input": input_summary,
        "groups": [_group_json(g) for g in groups],
    }


# =========================================================================== markdown


def fmt(x: float | None, digits: int = 4) -> str:
    if x is None or math.isnan(x):
        return "—"
    if math.isinf(x):
        return "∞" if x > 0 else "−∞"
    if x == 0:
        return "0"  # never "-0"
    if abs(x) >= 1e5 or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def fmt_est(e: Estimate, digits: int = 4) -> str:
    if math.isnan(e.low) and math.isnan(e.high):
        return fmt(e.value, digits)
    return f"{fmt(e.value, digits)} [{fmt(e.low, 3)}, {fmt(e.high, 3)}]"


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|")

    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(cell, r)) + " |" for r in rows]
    return "\n".join(lines)


def _quantity_table(v: ViewResult, skip: Sequence[str] = ()) -> str:
    names = [q for q in next(iter(v.quantities.values())) if q not in skip]
    names = [q for q in names if any(math.isfinite(v.quantities[m][q].value) for m in v.quantities)]
    rows = []
    for m, qs in v.quantities.items():
        rows.append(
            [m] + [fmt(qs[q].value, 6) if q in ("n", "n_truncated_traces") else fmt_est(qs[q]) for q in names]
        )
    return md_table(["model"] + [QUANTITY_LABELS[q] for q in names], rows)


def _decomposition_table(v: ViewResult, reference: str) -> str:
    rows = []
    for m, d in v.decomposition.items():
        if m == reference:
            continue
        rows.append([m, d.n_shared, fmt_est(d.dlog_e0)] + [fmt_est(d.terms[t]) for t in v.terms])
    return md_table(["model", "shared n", "Δlog E0"] + [TERM_LABELS[t] for t in v.terms], rows)


def _solver_md(s: SolverResult) -> list[str]:
    out = ["### Solver-derived workload", ""]
    out.append("Reference ordering (by E0): " + ", ".join(f"{m} ({fmt(e)})" for m, e in s.ordering))
    out.append("")
    out.append(
        md_table(
            ["coverage", "covered", "top-1 share", "top-3 share", "effective solvers (1/Σ share²)"],
            [
                [
                    fmt_est(s.coverage),
                    s.n_covered,
                    fmt_est(s.top1_share),
                    fmt_est(s.top3_share),
                    fmt_est(s.effective_solvers),
                ]
            ],
        )
    )
    out += ["", md_table(["solver", "share"], [[m, fmt_est(e)] for m, e in s.shares.items()]), ""]
    a = s.audits
    rows = [["leave-self-out", fmt(a.leave_self_out["vo"]), fmt(a.leave_self_out["kappa"]), ""]]
    for k, v in a.leave_top_k.items():
        rows.append([f"leave-top-{k}", fmt(v["vo"]), fmt(v["kappa"]), ", ".join(v["removed"])])
    ho = a.held_out
    rows.append(
        [
            f"held-out halves ({ho['vo'].n_valid}/{ho['vo'].n_splits} valid)",
            f"{fmt(ho['vo'].median)} [{fmt(ho['vo'].p5, 3)}, {fmt(ho['vo'].p95, 3)}]",
            f"{fmt(ho['kappa'].median)} [{fmt(ho['kappa'].p5, 3)}, {fmt(ho['kappa'].p95, 3)}]",
            "median [5 %, 95 %]",
        ]
    )
    out += [
        "Audits — Spearman ρ of rankings against the full pool:",
        "",
        md_table(["audit", "ρ(V̄O)", "ρ(κ)", "note"], rows),
        "",
        "Per-instance solvers are in the JSON output (`--json`).",
        "",
    ]
    return out


def benchmark_markdown(r: BenchmarkResult) -> str:
    out = [
        f"## {r.benchmark}",
        "",
        f"Reference: **{r.reference}** · {r.n_instances} instances · {len(r.models)} models · "
        f"workload: {r.workload_source or 'none'} · bootstrap: {r.n_bootstrap} (seed {r.seed})",
        "",
    ]
    out += [f"- {n}" for n in r.notes] + ([""] if r.notes else [])
    titles = {
        "outcome": "Outcome layer (all instances)",
        "workload": "Workload layer (instances with W)",
        "trace": "Trace layer (instances with a visible trace)",
    }
    for name, v in r.views.items():
        out += [
            f"### {titles[name]}",
            "",
            _quantity_table(v),
            "",
            f"Δlog against {r.reference} (terms add up to Δlog E0):",
            "",
            _decomposition_table(v, r.reference),
            "",
        ]
    out += [
        "### Diagnostic signatures",
        "",
        md_table(
            ["model", "signature", "dominant term", "value", "interval below 0"],
            [
                [
                    m,
                    s.label,
                    TERM_LABELS.get(s.term or "", "—"),
                    fmt(s.value),
                    "—" if s.significant is None else ("yes" if s.significant else "no"),
                ]
                for m, s in r.signatures.items()
            ],
        ),
        "",
    ]
    if r.solver is not None:
        out += _solver_md(r.solver)
    return "\n".join(out)


def problems_markdown(summary: dict[str, Any], limit: int = 50) -> str:
    problems = summary["problems"]
    head = (
        f"Input: {summary['rows_read']} rows read, {summary['rows_used']} used, "
        f"{summary['rows_dropped']} dropped."
    )
    if not problems:
        return head
    rows = [
        [p["where"], p.get("model") or "", p.get("instance_id") or "", p["reason"], p["action"]]
        for p in problems[:limit]
    ]
    more = (
        ["", f"… and {len(problems) - limit} more (all listed with --json)."] if len(problems) > limit else []
    )
    return "\n".join([head, "", md_table(["row", "model", "instance", "problem", "action"], rows), *more])


def efficiency_markdown(results: Sequence[BenchmarkResult], input_summary: dict[str, Any]) -> str:
    out = ["# Reasoning-efficiency report", ""]
    out += [f"> {c}" for c in CAVEATS] + [""]
    out += [problems_markdown(input_summary), ""]
    out += [benchmark_markdown(r) + "\n" for r in results]
    return "\n".join(out).rstrip() + "\n"


def trajectory_markdown(
    groups: Sequence[GroupReport],
    cost: dict[str, Any],
    input_summary: dict[str, Any],
    variant: str = "served",
) -> str:
    out = [
        "# Trajectory PTE report",
        "",
        f"γ = {fmt(cost.get('gamma'), 6)} ({cost.get('device', '?')}); patterns, steps and "
        f"correct-vs-incorrect use the **{variant}** PTE variant.",
        "",
        problems_markdown(input_summary),
        "",
        "## PTE by model × task",
        "",
    ]
    out.append(
        md_table(
            [
                "model",
                "task",
                "n",
                "accuracy",
                "avg uncached tokens",
                "tool calls / traj",
                "avg PTE (served)",
                "avg PTE (reference)",
                "avg PTE (ideal)",
            ],
            [
                [
                    g.model,
                    g.task,
                    g.n,
                    fmt(g.accuracy),
                    fmt(g.avg_uncached_tokens, 6),
                    fmt(g.tool_calls_per_trajectory),
                    fmt(g.avg_pte["served"], 6),
                    fmt(g.avg_pte["reference"], 6),
                    fmt(g.avg_pte["ideal"], 6),
                ]
                for g in groups
            ],
        )
    )
    out += [
        "",
        "## Inefficiency patterns",
        "",
        "Multiplier: mean PTE of trajectories with the pattern ÷ mean PTE of pattern-free "
        "trajectories of the same model × task.",
        "",
    ]
    rows = []
    for g in groups:
        for name in PATTERNS:
            p = g.patterns[name]
            rows.append(
                [
                    g.model,
                    g.task,
                    name.replace("_", " "),
                    p.count,
                    fmt(p.frequency),
                    fmt(p.mean_pte, 6),
                    fmt(p.multiplier),
                ]
            )
        rows.append(
            [
                g.model,
                g.task,
                "(pattern-free)",
                g.pattern_free_n,
                fmt(g.pattern_free_n / g.n),
                fmt(g.pattern_free_mean_pte, 6),
                "1",
            ]
        )
    out.append(md_table(["model", "task", "pattern", "count", "frequency", "mean PTE", "multiplier"], rows))
    out += ["", "## Correct vs incorrect", ""]
    out.append(
        md_table(
            [
                "model",
                "task",
                "n correct",
                "n incorrect",
                "mean PTE correct",
                "mean PTE incorrect",
                "incorrect ÷ correct",
            ],
            [
                [
                    g.model,
                    g.task,
                    c.n_correct,
                    c.n_incorrect,
                    fmt_est(c.mean_correct),
                    fmt_est(c.mean_incorrect),
                    fmt_est(c.ratio),
                ]
                for g in groups
                for c in [g.correct_vs_incorrect]
            ],
        )
    )
    out += [
        "",
        "## PTE per step",
        "",
        "Mean PTE of the k-th turn; ρ = Spearman of (turn index, turn PTE) — above 0: later steps cost more.",
        "",
    ]
    out.append(
        md_table(
            ["model", "task", "ρ(step, PTE)", "per-turn mean PTE (n)"],
            [
                [
                    g.model,
                    g.task,
                    fmt(g.step_rho),
                    " · ".join(f"{s.turn}: {fmt(s.mean_pte, 5)} ({s.n})" for s in g.per_step),
                ]
                for g in groups
            ],
        )
    )
    return "\n".join(out).rstrip() + "\n"
