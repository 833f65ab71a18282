"""The process's Prometheus registry as a scrape answer, in the format the scraper asks for:
OpenMetrics (which alone carries exemplars) or the Prometheus text format.

vLLM's ``/metrics`` always answers the text format, so the per-request exemplars the
exporter attaches (the request's trace id) show only here (``GET /pte/metrics``). Exemplars
exist in single-process mode only: prometheus_client's multiprocess files (vLLM with
``--api-server-count`` > 1 sets ``PROMETHEUS_MULTIPROC_DIR``) keep none."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from functools import partial

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
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


# The metric-name character set of the Prometheus text format and of OpenMetrics, colon included.
_LEGACY_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")


class _Collected:
    """A registry's metrics collected once, for an encoder to walk."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)


def exposition(accept: str | None, registry: CollectorRegistry | None = None) -> tuple[bytes, str]:
    """``(body, content type)`` of a scrape whose ``Accept`` header is ``accept``; raises
    ``AcceptError`` for a malformed one."""
    _check_accept(accept or "")
    encode, content_type = choose_encoder(accept or "")
    source = registry if registry is not None else scrape_registry()
    # prometheus_client's OpenMetrics encoder, escaping to underscores (what it picks unless the
    # scraper asks for allow-utf-8, as Prometheus 2 never does), writes a sample's name with the
    # label-name character set: vLLM's `vllm:prompt_tokens_total` would reach Prometheus as
    # `vllm_prompt_tokens_total`, under a `# TYPE vllm:prompt_tokens` of another name. Names that
    # are all in the metric-name set need no escaping: they are written as they are.
    if isinstance(encode, partial) and encode.keywords.get("escaping") == "underscores":
        metrics = list(source.collect())
        if all(_LEGACY_NAME.match(s.name) for m in metrics for s in m.samples):
            encode = partial(encode, escaping="allow-utf-8")
        return encode(_Collected(metrics)), content_type
    return encode(source), content_type
