"""Reasoning-efficiency decomposition (docs/efficiency-model.md) and agent inefficiency
patterns (docs/cost-model.md §7): offline analysis over evaluation records and trajectory logs,
run by the ``pte`` command and the benches, never inside vLLM.

The statistics (:mod:`.decomposition` on top of :mod:`.statistics`) are plain numpy; records,
reports, plots and the CLI hooks sit beside them, one concern per module.
"""

from pte_instrument.offline.decomposition import (
    AnalysisError,
    BenchmarkResult,
    Estimate,
    EvalTable,
    analyze,
    compression_ratio,
    loop_audit,
)
from pte_instrument.offline.statistics import pearson, spearman

__all__ = [
    "AnalysisError",
    "BenchmarkResult",
    "Estimate",
    "EvalTable",
    "analyze",
    "compression_ratio",
    "loop_audit",
    "pearson",
    "spearman",
]
