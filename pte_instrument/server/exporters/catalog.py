"""The plugin's metric families as data: name, type, labels, help and the sample names a
scrape shows. Read from the live definitions (``PteMetrics``),
so the metrics reference, the dashboard checks and the Prometheus test cannot drift from
the code."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from pte_instrument.server.exporters.prometheus import PteMetrics

# Sample suffixes each type adds to its family name in the text exposition.
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "gauge": ("",),
}


@dataclass(frozen=True)
class Family:
    name: str  # family name as prometheus_client knows it (a counter's without `_total`)
    type: str  # counter, gauge, histogram
    labels: tuple[str, ...]
    help: str
    source: str  # "request" (per request, session, engine) or "ledger" (session-ledger state)
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds, +Inf included

    @property
    def samples(self) -> tuple[str, ...]:
        """Sample names a scrape exposes (``_created`` series left out: vLLM-dependent)."""
        return tuple(self.name + s for s in _SUFFIXES[self.type])

    @property
    def exposed(self) -> str:
        """The name users query: a counter's with ``_total``, a histogram's base name."""
        return self.name + "_total" if self.type == "counter" else self.name


def families() -> list[Family]:
    """Every ``pte_*`` family, sorted by name."""
    # PteMetrics directly, not metrics_for(): its per-registry cache would keep every
    # throwaway registry's metrics alive.
    metrics = PteMetrics(CollectorRegistry())
    out: list[Family] = []
    for attr, metric in vars(metrics).items():
        if isinstance(metric, MetricWrapperBase):
            # Label names and buckets are not part of an empty family's collect() output;
            # the wrapper keeps them in attributes stable across prometheus_client releases.
            out.append(
                Family(
                    metric._name,
                    metric._type,
                    tuple(metric._labelnames),
                    metric._documentation,
                    "ledger" if attr in PteMetrics.LEDGER else "request",
                    tuple(getattr(metric, "_upper_bounds", ())),
                )
            )
    return sorted(out, key=lambda f: f.name)
