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


MAX_VERSION_LEN = 32  # of an Accept header's version parameter: echoed in the answer's Content-Type
_NEGOTIATED = ("application/openmetrics-text", "text/plain")  # the media types choose_encoder reads


class AcceptError(ValueError):
    """An ``Accept`` header the encoder cannot read: the client's mistake (a 400)."""


def _check_accept(accept: str) -> None:
    """Raise ``AcceptError`` for a ``version`` parameter that ``choose_encoder`` would compare
    as text against numbers (a ``TypeError``), or echo however long it is."""
    for accepted in accept.split(","):
        media, *params = accepted.split(";")
        if media.strip() not in _NEGOTIATED:
            continue
        # the first version parameter, split as choose_encoder splits it ("" reads as none)
        version = next(
            (v for k, eq, v in (p.strip().partition("=") for p in params) if eq and k == "version"), ""
        )
        parts = version.split(".")
        if version and (
            len(version) > MAX_VERSION_LEN or not all(p.isascii() and p.isdigit() for p in parts)
        ):
            raise AcceptError("malformed Accept header: a version must be numbers joined by '.'")


def exposition(accept: str | None, registry: CollectorRegistry | None = None) -> tuple[bytes, str]:
    """``(body, content type)`` of a scrape whose ``Accept`` header is ``accept``; raises
    ``AcceptError`` for a malformed one."""
    _check_accept(accept or "")
    encode, content_type = choose_encoder(accept or "")
    return encode(registry if registry is not None else scrape_registry()), content_type
