"""The one reader of Prometheus text expositions in the tests (prometheus_client's parser)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

Key = tuple[str, tuple[tuple[str, str], ...]]


def families(text: str, prefix: str = "pte_") -> dict[str, tuple[str, str, list[Sample]]]:
    """Family name (a counter's without ``_total``, as the parser names it) → (type, help,
    samples), for the families whose name starts with ``prefix``."""
    return {
        fam.name: (fam.type, fam.documentation, list(fam.samples))
        for fam in text_string_to_metric_families(text)
        if fam.name.startswith(prefix)
    }


def samples(text: str, prefix: str = "pte_") -> dict[Key, float]:
    """Every sample of the matching families: (sample name, sorted labels) → value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for _, _, fam_samples in families(text, prefix).values()
        for s in fam_samples
    }


def only(text: str, prefix: str = "pte_") -> str:
    """The lines of an exposition that belong to the matching families (for promtool)."""
    keep = (prefix, f"# HELP {prefix}", f"# TYPE {prefix}")
    return "\n".join(line for line in text.splitlines() if line.startswith(keep)) + "\n"


def metric_sum(metrics: dict[Key, float], name: str, **labels: str) -> float:
    return sum(
        v
        for (n, labs), v in metrics.items()
        if n == name and all(dict(labs).get(k) == val for k, val in labels.items())
    )
