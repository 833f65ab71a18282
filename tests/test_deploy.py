"""The Kubernetes manifests and the OpenTelemetry Collector configuration under ``deploy/``:
they parse, say what they are, carry the rule file's groups and the committed dashboard,
validate against the Prometheus Operator's and Kubernetes' schemas (pydantic models
generated from them, when installed), and the Collector's pipelines name only components it
defines; docs/deployment.md shows the same Collector configuration."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from deploy import manifests
from deploy.generate import (
    DASHBOARD_CONFIG_MAP,
    KUBERNETES,
    OTEL_COLLECTOR,
    PROMETHEUS_RULE,
    RULE_FILE,
    SERVICE_MONITOR,
)
from tests.conftest import ROOT

DOC = ROOT / "docs" / "deployment.md"
YAML_BLOCK = re.compile(r"```yaml\n(.*?)```", re.DOTALL)
# Kubernetes keeps a client-side `kubectl apply`'s whole object in one annotation, at most 256 KiB.
LAST_APPLIED_LIMIT = 262_144
PIPELINE_TYPES = ("traces", "metrics", "logs")
COMPONENT_ID = re.compile(r"^[a-z][a-z0-9_]*(/[^/\s]+)?$")


def load(path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def doc_yaml_blocks() -> list[Any]:
    return [yaml.safe_load(block) for block in YAML_BLOCK.findall(DOC.read_text(encoding="utf-8"))]


def test_kubernetes_holds_the_three_manifests():
    assert sorted(p.name for p in KUBERNETES.iterdir()) == sorted(
        p.name for p in (SERVICE_MONITOR, PROMETHEUS_RULE, DASHBOARD_CONFIG_MAP)
    )
    for path in (SERVICE_MONITOR, PROMETHEUS_RULE, DASHBOARD_CONFIG_MAP):
        doc = load(path)
        assert set(doc) >= {"apiVersion", "kind", "metadata"}, path
        assert re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", doc["metadata"]["name"]), path  # a DNS label
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pte-instrument", path


def test_the_prometheus_rule_carries_the_rule_files_groups():
    rule = load(PROMETHEUS_RULE)
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == load(RULE_FILE)["groups"]
    assert rule["spec"]["groups"]  # not two empty lists
    assert rule["metadata"]["labels"]["release"] == load(SERVICE_MONITOR)["metadata"]["labels"]["release"]


def test_the_service_monitor_scrapes_the_documented_vllm_service():
    monitor = load(SERVICE_MONITOR)
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    services = [d for d in doc_yaml_blocks() if isinstance(d, dict) and d.get("kind") == "Service"]
    assert len(services) == 1, "docs/deployment.md shows one vLLM Service"
    service = services[0]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]


def test_the_dashboard_config_map_holds_the_committed_dashboard():
    config_map = load(DASHBOARD_CONFIG_MAP)
    assert (config_map["apiVersion"], config_map["kind"]) == ("v1", "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # a string, as the sidecar matches it
    dashboard = manifests.DASHBOARD.read_text(encoding="utf-8")
    assert config_map["data"] == {"pte-instrument.json": dashboard}
    assert json.loads(config_map["data"]["pte-instrument.json"])["uid"] == "pte-instrument"
    assert len(DASHBOARD_CONFIG_MAP.read_bytes()) < LAST_APPLIED_LIMIT


@pytest.fixture(scope="module")
def schemas() -> dict[str, Any]:
    """Pydantic models generated from the Prometheus Operator's CRDs and Kubernetes' OpenAPI."""
    operator = pytest.importorskip(
        "cloudcoil.models.prometheus_operator.v1", reason="pip install cloudcoil-models-prometheus-operator"
    )
    core = pytest.importorskip(
        "cloudcoil.models.kubernetes.core.v1", reason="pip install cloudcoil-models-kubernetes"
    )
    return {
        "ServiceMonitor": operator.ServiceMonitor,
        "PrometheusRule": operator.PrometheusRule,
        "ConfigMap": core.ConfigMap,
    }


def validated(schemas: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    """The document as its schema reads it back: a field the schema does not know is dropped."""
    model = schemas[doc["kind"]].model_validate(doc)
    return model.model_dump(by_alias=True, exclude_none=True, mode="json")


@pytest.mark.parametrize(
    "path", [SERVICE_MONITOR, PROMETHEUS_RULE, DASHBOARD_CONFIG_MAP], ids=lambda p: p.name
)
def test_each_manifest_validates_against_its_schema_with_no_field_unknown(schemas, path):
    doc = load(path)
    assert validated(schemas, doc) == doc


def test_the_schema_check_catches_a_misspelt_field_and_a_bad_duration(schemas):
    from pydantic import ValidationError

    monitor = load(SERVICE_MONITOR)
    monitor["spec"]["endpoints"][0]["intervall"] = monitor["spec"]["endpoints"][0].pop("interval")
    assert validated(schemas, monitor) != monitor
    rule = load(PROMETHEUS_RULE)
    rule["spec"]["groups"][1]["rules"][0]["for"] = "5 minutes"
    with pytest.raises(ValidationError, match="for"):
        validated(schemas, rule)


def test_the_collector_pipelines_name_only_components_it_defines():
    config = load(OTEL_COLLECTOR)
    assert set(config) <= {"receivers", "processors", "exporters", "connectors", "extensions", "service"}
    pipelines = config["service"]["pipelines"]
    assert {name.split("/")[0] for name in pipelines} == set(PIPELINE_TYPES)
    used: dict[str, set[str]] = {"receivers": set(), "processors": set(), "exporters": set()}
    for name, pipeline in pipelines.items():
        assert set(pipeline) <= set(used), name
        assert pipeline["receivers"] and pipeline["exporters"], name
        for section, ids in pipeline.items():
            assert len(ids) == len(set(ids)), f"{name}: {section} listed twice"
            missing = set(ids) - set(config.get(section) or {})
            assert not missing, f"pipeline {name} names undefined {section}: {sorted(missing)}"
            used[section] |= set(ids)
        assert pipeline["processors"][0] == "memory_limiter", name  # first, as the Collector advises
    for section, ids in used.items():
        assert set(config[section]) == ids, f"{section} defined but in no pipeline"
        assert all(COMPONENT_ID.match(i) for i in config[section]), section


def test_the_collector_receives_what_the_plugin_sends():
    config = load(OTEL_COLLECTOR)
    http = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert http.endswith(f":{manifests.OTLP_HTTP_PORT}")
    pipelines = config["service"]["pipelines"]
    assert "otlp" in pipelines["traces"]["receivers"] and "otlp" in pipelines["logs"]["receivers"]
    # The container environment the docs show points the plugin's exporter at this port.
    env = [d for d in doc_yaml_blocks() if isinstance(d, dict) and "env" in d]
    assert env, "docs/deployment.md shows the container environment"
    endpoints = {e["value"] for e in env[0]["env"] if e["name"] == "OTEL_EXPORTER_OTLP_ENDPOINT"}
    assert len(endpoints) == 1 and endpoints.pop().endswith(f":{manifests.OTLP_HTTP_PORT}")


def test_the_deployment_doc_shows_the_committed_collector_config():
    text = OTEL_COLLECTOR.read_text(encoding="utf-8")
    assert "#" not in text  # comment-free: pasted as it is
    assert text in [block for block in YAML_BLOCK.findall(DOC.read_text(encoding="utf-8"))]
