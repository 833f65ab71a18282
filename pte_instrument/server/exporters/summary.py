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
# Seconds (docs/cost-model.md §5b): None without the step hook. Summed with None as 0, beside
# the count of requests that had them, so a total is never read as covering every request.
TIMED = ("gpu_seconds", "gpu_seconds_prefill", "gpu_seconds_kv_read", "gpu_seconds_weights",
         "gpu_seconds_overhead", "predicted_seconds", "latency_explained_s", "interference_s")  # fmt: skip
# Money: None also without PTE_GPU_HOURLY_PRICE.
PRICED = ("cost_usd",)
# Count of the requests behind each group: those with gpu_seconds, those with cost_usd.
TIMED_COUNT, PRICED_COUNT = "requests_timed", "requests_priced"
FIELDS = ("requests", *SUMMED, TIMED_COUNT, *TIMED, PRICED_COUNT, *PRICED)


class ModelTotals:
    """Per-model running sums of finished requests, for ``/pte/summary``."""

    def __init__(self) -> None:
        self._totals: defaultdict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
        self._lock = threading.Lock()

    def export(self, r: RequestRecord) -> None:
        with self._lock:
            t = self._totals[r.model]
            t["requests"] += 1
            for k in SUMMED:
                t[k] += getattr(r, k)
            if r.gpu_seconds is not None:
                t[TIMED_COUNT] += 1
            for k in TIMED:
                t[k] += getattr(r, k) or 0.0
            if r.cost_usd is not None:
                t[PRICED_COUNT] += 1
            for k in PRICED:
                t[k] += getattr(r, k) or 0.0

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
