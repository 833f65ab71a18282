"""The process's Prometheus registry as a scrape answer, in the format the scraper asks for:
OpenMetrics (which alone carries exemplars) or the Prometheus text format.

vLLM's ``/metrics`` always answers the text format, so the per-request exemplars the
exporter attaches (the request's trace id) show only here (``GET /pte/metrics``). Exemplars
exist in single-process mode only: prometheus_client's multiprocess files (vLLM with
``--api-server-count`` > 1 sets ``PROMETHEUS_MULTIPROC_DIR``) keep none."""

from __future__ import annotations

import os

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector


def scrape_registry() -> CollectorRegistry:
    """What ``/metrics`` serves: the merge of every process's files in multiprocess mode
    (prometheus_client's own switch, the directory variable), else this process's registry."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return registry
    return REGISTRY


def exposition(accept: str | None, registry: CollectorRegistry | None = None) -> tuple[bytes, str]:
    """``(body, content type)`` of a scrape whose ``Accept`` header is ``accept``."""
    encode, content_type = choose_encoder(accept or "")
    return encode(registry if registry is not None else scrape_registry()), content_type
