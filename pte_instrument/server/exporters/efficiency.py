"""Live efficiency, for ``GET /pte/summary`` and Prometheus (the per-model totals are the
session store's: ``SessionLedger.model_totals``)."""

from __future__ import annotations

from pte_instrument.server.exporters.prometheus import PteMetrics
from pte_instrument.server.live_efficiency import LiveEfficiency
from pte_instrument.server.records import RequestRecord


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
