"""PNG plots (matplotlib, Agg backend): accuracy vs E0, stacked Δlog bars, V̄O vs κ, and
per-step PTE of trajectories. matplotlib is imported only here, and only when plotting."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pte_instrument.offline.decomposition import BenchmarkResult
from pte_instrument.offline.patterns import GroupReport
from pte_instrument.offline.render import TERM_LABELS


class PlotError(RuntimeError):
    pass


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotError("--plots needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    return plt


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "benchmark"


def save_figure(fig: Any, path: Path, dpi: int = 120) -> Path:
    """Write ``fig`` to ``path`` and close it (pyplot keeps every open figure alive)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def efficiency_plots(results: Sequence[BenchmarkResult], out_dir: str | Path) -> list[Path]:
    """Three PNGs per benchmark: accuracy vs E0 (marker area ∝ E[T]), stacked Δlog terms of
    the richest view per model (black tick: Δlog E0), and V̄O vs κ when W exists."""
    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in results:
        slug = _slug(r.benchmark)
        q = r.views["outcome"].quantities
        models = list(r.models)
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        et = [q[m]["mean_tokens"].value for m in models]
        top = max((x for x in et if math.isfinite(x)), default=1.0) or 1.0
        ax.scatter(
            [q[m]["e0"].value for m in models],
            [q[m]["accuracy"].value for m in models],
            s=[30 + 400 * x / top for x in et],
            alpha=0.6,
        )
        for m in models:
            ax.annotate(m, (q[m]["e0"].value, q[m]["accuracy"].value), fontsize=7)
        ax.set_xlabel("E0 (correct answers per 1k output tokens)")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{r.benchmark}: accuracy vs E0 (marker size: E[T])")
        paths.append(save_figure(fig, out / f"{slug}-accuracy-e0.png"))

        view = r.views.get("trace") or r.views.get("workload") or r.views["outcome"]
        others = [m for m in models if m != r.reference]
        fig, ax = plt.subplots(figsize=(max(6.4, 0.5 * len(others) + 2), 4.8))
        pos = [0.0] * len(others)
        neg = [0.0] * len(others)
        for t in view.terms:
            vals = [view.decomposition[m].terms[t].value for m in others]
            vals = [v if math.isfinite(v) else 0.0 for v in vals]
            bottoms = [p if v >= 0 else n for v, p, n in zip(vals, pos, neg, strict=True)]
            ax.bar(range(len(others)), vals, bottom=bottoms, label=TERM_LABELS[t])
            pos = [p + max(v, 0) for p, v in zip(pos, vals, strict=True)]
            neg = [n + min(v, 0) for n, v in zip(neg, vals, strict=True)]
        ax.scatter(
            range(len(others)),
            [view.decomposition[m].dlog_e0.value for m in others],
            marker="_",
            s=300,
            color="black",
            label="Δlog E0",
            zorder=3,
        )
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(others)), others, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel(f"Δlog vs {r.reference}")
        ax.set_title(f"{r.benchmark}: Δlog E0 decomposition ({view.name} view)")
        ax.legend(fontsize=7)
        paths.append(save_figure(fig, out / f"{slug}-dlog.png"))

        if "workload" in r.views:
            wq = r.views["workload"].quantities
            fig, ax = plt.subplots(figsize=(6.4, 4.8))
            ax.scatter([wq[m]["vo"].value for m in models], [wq[m]["kappa"].value for m in models])
            for m in models:
                ax.annotate(m, (wq[m]["vo"].value, wq[m]["kappa"].value), fontsize=7)
            ax.axhline(1, color="grey", lw=0.8)
            ax.set_xlabel("V̄O (mean tokens per unit workload)")
            ax.set_ylabel("κ (coupling)")
            ax.set_title(f"{r.benchmark}: overhead vs coupling ({r.workload_source} workload)")
            paths.append(save_figure(fig, out / f"{slug}-vo-kappa.png"))
    return paths


def trajectory_plots(groups: Sequence[GroupReport], out_dir: str | Path) -> list[Path]:
    """Per-step mean PTE (does cost escalate?) and average PTE per model × task."""
    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for g in groups:
        ax.plot(
            [s.turn for s in g.per_step],
            [s.mean_pte for s in g.per_step],
            marker="o",
            label=f"{g.model} / {g.task}",
        )
    ax.set_xlabel("turn")
    ax.set_ylabel("mean PTE of the turn")
    ax.set_title("PTE per step")
    ax.legend(fontsize=7)
    paths = [save_figure(fig, out / "pte-per-step.png")]

    fig, ax = plt.subplots(figsize=(max(6.4, 0.6 * len(groups) + 2), 4.8))
    labels = [f"{g.model}\n{g.task}" for g in groups]
    c = [g.correct_vs_incorrect.mean_correct.value for g in groups]
    i = [g.correct_vs_incorrect.mean_incorrect.value for g in groups]
    x = range(len(groups))
    ax.bar([k - 0.2 for k in x], c, width=0.4, label="correct")
    ax.bar([k + 0.2 for k in x], i, width=0.4, label="incorrect")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("mean PTE per trajectory")
    ax.set_title("PTE of correct vs incorrect trajectories")
    ax.legend(fontsize=7)
    paths.append(save_figure(fig, out / "pte-correct-incorrect.png"))
    return paths
