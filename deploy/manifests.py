"""What a Kubernetes cluster with the Prometheus Operator, Grafana's dashboard sidecar and an
OpenTelemetry Collector installs for pte-instrument, as plain data: a ``ServiceMonitor`` for
vLLM's ``/metrics``, a ``PrometheusRule`` with the rules of ``prometheus/rules.py``, a
``ConfigMap`` holding the Grafana dashboard, and the Collector's configuration.

``python -m deploy.generate`` writes them; docs/deployment.md says how to install them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus.rules import rule_groups

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "grafana" / "dashboards" / "pte-instrument.json"

# The labels a kube-prometheus-stack Prometheus selects ServiceMonitors and PrometheusRules by
# (serviceMonitorSelector, ruleSelector: the Helm release's name); change them to match yours.
OPERATOR_SELECTOR = {"release": "prometheus"}
PART_OF = {"app.kubernetes.io/part-of": "pte-instrument"}
# The vLLM Service the ServiceMonitor selects, and the name of its HTTP port.
VLLM_SERVICE_LABELS = {"app.kubernetes.io/name": "vllm"}
VLLM_PORT_NAME = "http"
SCRAPE_INTERVAL = "15s"
# Grafana's dashboard sidecar loads ConfigMaps with this label (its default `label` and
# `labelValue`); the folder annotation is read where the sidecar sets folderAnnotation to it.
GRAFANA_DASHBOARD_LABEL = {"grafana_dashboard": "1"}
GRAFANA_FOLDER = {"grafana_folder": "vLLM"}
# OTLP/HTTP, what the plugin speaks; gRPC for vLLM's own tracing, which defaults to it.
OTLP_HTTP_PORT = 4318
OTLP_GRPC_PORT = 4317
PIPELINE_PROCESSORS = ("memory_limiter", "batch")  # the memory limiter first, as the Collector advises


def service_monitor() -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "vllm-pte", "labels": {**PART_OF, **OPERATOR_SELECTOR}},
        "spec": {
            "selector": {"matchLabels": dict(VLLM_SERVICE_LABELS)},
            "endpoints": [
                {
                    "port": VLLM_PORT_NAME,
                    "path": "/metrics",
                    "interval": SCRAPE_INTERVAL,
                    "scrapeTimeout": "10s",
                }
            ],
        },
    }


def prometheus_rule() -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "pte-instrument", "labels": {**PART_OF, **OPERATOR_SELECTOR}},
        "spec": {"groups": rule_groups()},
    }


def dashboard_config_map(dashboard_json: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "pte-instrument-dashboard",
            "labels": {**PART_OF, **GRAFANA_DASHBOARD_LABEL},
            "annotations": dict(GRAFANA_FOLDER),
        },
        "data": {DASHBOARD.name: dashboard_json},
    }


def otel_collector_config() -> dict[str, Any]:
    """Spans and priced-request log records from the plugin (OTLP) to tracing and log backends,
    and vLLM's /metrics (scraped by the Collector) remote-written to Prometheus. The
    prometheus receiver and the prometheusremotewrite exporter are in the contrib and k8s
    distributions of the Collector."""
    return {
        "receivers": {
            "otlp": {
                "protocols": {
                    "grpc": {"endpoint": f"0.0.0.0:{OTLP_GRPC_PORT}"},
                    "http": {"endpoint": f"0.0.0.0:{OTLP_HTTP_PORT}"},
                }
            },
            "prometheus": {
                "config": {
                    "scrape_configs": [
                        {
                            "job_name": "vllm",
                            "scrape_interval": SCRAPE_INTERVAL,
                            "metrics_path": "/metrics",
                            "static_configs": [{"targets": ["vllm.default.svc:8000"]}],
                        }
                    ]
                }
            },
        },
        "processors": {
            "memory_limiter": {"check_interval": "1s", "limit_percentage": 80, "spike_limit_percentage": 25},
            "batch": {},
        },
        "exporters": {
            "otlphttp/traces": {"endpoint": "http://tempo.observability:4318"},
            "otlphttp/logs": {"endpoint": "http://loki.observability:3100/otlp"},
            "prometheusremotewrite": {"endpoint": "http://prometheus.observability:9090/api/v1/write"},
        },
        "service": {
            "pipelines": {
                "traces": {
                    "receivers": ["otlp"],
                    "processors": list(PIPELINE_PROCESSORS),
                    "exporters": ["otlphttp/traces"],
                },
                "logs": {
                    "receivers": ["otlp"],
                    "processors": list(PIPELINE_PROCESSORS),
                    "exporters": ["otlphttp/logs"],
                },
                "metrics": {
                    "receivers": ["otlp", "prometheus"],
                    "processors": list(PIPELINE_PROCESSORS),
                    "exporters": ["prometheusremotewrite"],
                },
            }
        },
    }
