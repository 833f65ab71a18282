"""Reasoning-efficiency decomposition (SPEC-EFFICIENCY) and agent inefficiency patterns
(SPEC-PTE §7): offline analysis over evaluation records and trajectory logs.

The statistics (:mod:`.stats`) are plain numpy; records, reports, plots and the CLI hooks
sit beside them, one concern per module.
"""

from pte_instrument.offline.decomposition import (
    AnalysisError,
    BenchmarkResult,
    Estimate,
    EvalTable,
    analyze,
    compression_ratio,
    loop_audit,
    spearman,
)

__all__ = [
    "AnalysisError",
    "BenchmarkResult",
    "Estimate",
    "EvalTable",
    "analyze",
    "compression_ratio",
    "loop_audit",
    "spearman",
]
