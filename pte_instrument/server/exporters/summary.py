"""Per-model running totals and live efficiency, for ``GET /pte/summary`` and Prometheus."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from pte_instrument.server.exporters.prometheus import PteMetrics
from pte_instrument.server.ledger import RequestRecord
from pte_instrument.server.live_efficiency import LiveEfficiency

SUMMED = ("prompt_tokens", "cached_tokens", "computed_prefill_tokens", "recomputed_tokens", "output_tokens",
          "pte_reference", "pte_served", "pte_ideal", "pte_prefill", "pte_decode", "pte_recompute",
          "pte_eviction_tax")  # fmt: skip


class ModelTotals:
    def __init__(self) -> None:
        self._totals: defaultdict[str, dict[str, float]] = defaultdict(
            lambda: dict.fromkeys(("requests", *SUMMED), 0)
        )
        self._lock = threading.Lock()

    def export(self, r: RequestRecord) -> None:
        with self._lock:
            t = self._totals[r.model]
            t["requests"] += 1
            for k in SUMMED:
                t[k] += getattr(r, k)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {model: dict(t) for model, t in self._totals.items()}


class EfficiencyExporter:
    """Feeds every finished request to the live efficiency counters."""

    def __init__(self, efficiency: LiveEfficiency, metrics: PteMetrics) -> None:
        self.efficiency = efficiency
        self.metrics = metrics

    def export(self, r: RequestRecord) -> None:
        self.efficiency.observe(
            r.request_id, r.session_id, r.model, r.benchmark, r.output_tokens, r.finish_reason
        )
        self.metrics.evaluated(r.model, r.benchmark, r.output_tokens, r.finish_reason == "length")
