"""``GET /pte/metrics`` in OpenMetrics keeps vLLM's metric names as ``/metrics`` has them.

vLLM names its series ``vllm:…``; a colon is part of the metric-name character set of the
Prometheus text format and of OpenMetrics. A scraper that asks for OpenMetrics without an
``escaping`` parameter (Prometheus 2.x) must get ``vllm:prompt_tokens_total``, not
``vllm_prompt_tokens_total``: the dashboards and rules query vLLM's names."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from pte_instrument.server.exporters.exposition import exposition

# What Prometheus 2.x sends (scrape.go's default), and Prometheus 3.x's allow-utf-8 form.
PROMETHEUS_2_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
PROMETHEUS_3_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


def vllm_like_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("vllm:prompt_tokens", "Prompt tokens.", ["model_name", "engine"], registry=registry).labels(
        "tiny", "0"
    ).inc(382)
    Gauge("vllm:num_requests_running", "Running.", ["model_name", "engine"], registry=registry).labels(
        "tiny", "0"
    ).set(1)
    Histogram("vllm:e2e_request_latency_seconds", "E2E.", ["model_name"], registry=registry).labels(
        "tiny"
    ).observe(0.2)
    Counter("pte_requests", "Requests priced.", ["model_name"], registry=registry).labels("tiny").inc(3)
    return registry


def sample_names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.parametrize(
    "accept",
    [
        "application/openmetrics-text; version=1.0.0",
        "application/openmetrics-text",
        PROMETHEUS_2_ACCEPT,
        PROMETHEUS_3_ACCEPT,
    ],
    ids=["version-1.0.0", "no-version", "prometheus-2", "prometheus-3"],
)
def test_openmetrics_keeps_the_colon_of_vllm_names(accept: str) -> None:
    body, content_type = exposition(accept, vllm_like_registry())
    assert content_type.startswith("application/openmetrics-text")
    names = sample_names(body.decode())  # parses: every sample belongs to its family
    assert {
        "vllm:prompt_tokens_total",
        "vllm:num_requests_running",
        "vllm:e2e_request_latency_seconds_count",
        "pte_requests_total",
    } <= names
    assert not any(n.startswith("vllm_") for n in names)


def test_the_text_format_is_untouched() -> None:
    body, content_type = exposition(None, vllm_like_registry())
    assert content_type.startswith("text/plain")
    assert "\nvllm:prompt_tokens_total{" in body.decode()
