"""The plugin's metric families as a scrape shows them: name, type, labels, help and the
sample names. Read from the table ``PteMetrics`` is created from
(``families.FAMILIES``), so the metrics reference, the dashboard checks and the
Prometheus test cannot drift from the code."""

from __future__ import annotations

from dataclasses import dataclass

from pte_instrument.server.exporters.families import FAMILIES, FamilySpec

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


def family(spec: FamilySpec) -> Family:
    """A table row as a scrape shows it: buckets as floats with ``+Inf`` appended."""
    return Family(spec.name, spec.kind, spec.labels, spec.help, spec.source, spec.upper_bounds)


def families() -> list[Family]:
    """Every ``pte_*`` family, sorted by name."""
    return sorted((family(spec) for spec in FAMILIES), key=lambda f: f.name)
