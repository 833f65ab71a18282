"""The Grafana dashboard: the committed JSON is what the generator makes, and every query
reads metrics (and labels) the plugin really exports. ``test_prometheus_e2e.py`` then has
a real Prometheus evaluate the same queries."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from grafana.panels import PANELS, QUERIES, ROWS, VARIABLES, VLLM_SERIES, Query
from pte_instrument.server.exporters.catalog import Family, families
from tests.conftest import ROOT

DASHBOARD = ROOT / "grafana" / "dashboards" / "pte-instrument.json"
METRIC = re.compile(r"\bpte_[a-z0-9_]+\b")
SELECTOR = re.compile(r"\b(pte_[a-z0-9_]+)\{([^}]*)\}")
MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
VLLM_METRIC = re.compile(r"\bvllm:[a-z0-9_:]+")
# Labels Prometheus attaches to every scraped series (the scrape target's).
TARGET_LABELS = {"job", "instance"}


def by_sample() -> dict[str, Family]:
    return {s: f for f in families() for s in f.samples}


def metric_names(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


def selector_labels(expr: str) -> list[tuple[str, set[str]]]:
    return [(m, set(MATCHER_LABEL.findall(body))) for m, body in SELECTOR.findall(expr)]


def test_committed_dashboard_is_what_the_generator_makes():
    pytest.importorskip("grafana_foundation_sdk", reason="pip install grafana-foundation-sdk")
    from grafana.generate import render

    assert DASHBOARD.read_text(encoding="utf-8") == render(), (
        "grafana/dashboards/pte-instrument.json is stale: run python -m grafana.generate"
    )
    assert render() == render()  # deterministic within a run too


# Metrics that are exported but have no data on the end-to-end test server (the step hook
# on, no PTE_GPU_HOURLY_PRICE, too few steps for the online fit), by the reason a query gives.
EMPTY_ON_TEST_SERVER = {
    "unpriced": {
        "pte_cost_usd_total",
        "pte_session_cost_usd_bucket",
        "pte_session_cost_usd_sum",
        "pte_session_cost_usd_count",
    },
    "unfitted": {"pte_step_model_r2", "pte_step_model_mape_ratio"},
}


def check_catalogued(title: str, expr: str, known: dict[str, Family]) -> None:
    """Every metric of ``expr`` is exported, and every label it matches on exists."""
    missing = metric_names(expr) - known.keys()
    assert not missing, f"{title}: unknown metrics {sorted(missing)} in {expr!r}"
    for metric, labels in selector_labels(expr):
        fam = known[metric]
        allowed = set(fam.labels) | TARGET_LABELS | ({"le"} if metric.endswith("_bucket") else set())
        assert labels <= allowed, f"{title}: {metric} has no label(s) {sorted(labels - allowed)}"


def test_every_required_query_reads_exported_metrics_and_labels():
    known = by_sample()
    maybe_empty = set().union(*EMPTY_ON_TEST_SERVER.values())
    for p in PANELS:
        for q in p.queries:
            title, expr = p.title, q.expr
            names = metric_names(expr)
            assert names or VLLM_METRIC.search(expr), f"{title}: no pte_* or vllm:* metric in {expr!r}"
            if q.empty_on_test_server is not None:
                # optional because the test server has no data for it: still catalogued metrics
                # and labels, and it does read a metric that is empty there for that reason.
                assert q.optional, f"{title}: {expr!r} may be empty on the test server but is required"
                check_catalogued(title, expr, known)
                reason = EMPTY_ON_TEST_SERVER[q.empty_on_test_server]
                assert names & reason, (
                    f"{title}: {expr!r} reads no {q.empty_on_test_server} metric {sorted(reason)}"
                )
                continue
            if q.optional:
                # An optional query whose metrics now exist should become a required one.
                assert names - known.keys(), (
                    f"{title}: {expr!r} is marked optional but every metric exists now"
                )
                continue
            check_catalogued(title, expr, known)
            # a required query must not read what the test server leaves empty
            assert not names & maybe_empty, f"{title}: {expr!r} reads {sorted(names & maybe_empty)}: mark it"


def test_queries_list_what_the_panels_hold():
    """QUERIES (what the end-to-end test evaluates) is every panel query, with its optional flag."""
    assert [(p.title, q.expr, q.optional) for p in PANELS for q in p.queries] == QUERIES
    flagged = [q for p in PANELS for q in p.queries if q.empty_on_test_server is not None]
    assert flagged and all(q.optional for q in flagged)


def test_empty_on_test_server_needs_optional():
    with pytest.raises(ValueError, match="needs optional=True"):
        Query("pte_cost_usd_total", "x", empty_on_test_server="unpriced")


def test_template_variables_read_exported_series():
    known = by_sample()
    for v in VARIABLES:
        assert v.metric in known, v
        assert v.label_name in {*known[v.metric].labels, *TARGET_LABELS}, v
        assert v.query.startswith(f"label_values({v.metric}") and v.query.endswith(f", {v.label_name})")


def test_dashboard_json_has_every_panel_query_and_variable():
    d = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert d["uid"] == "pte-instrument"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "instance", "model_name", "engine"]
    assert variables["model_name"]["allValue"] == ".*" and variables["model_name"]["multi"] is True
    panels = [p for p in d["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert [p["title"] for p in panels] == [p.title for p in PANELS]
    exprs = [(p["title"], t["expr"]) for p in panels for t in p["targets"]]
    assert exprs == [(title, expr) for title, expr, _ in QUERIES]
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["gridPos"]["w"] > 0 and p["gridPos"]["h"] > 0


def test_the_promised_panels_are_there():
    """The panels the dashboard promises, by what they query."""
    required = {
        "pte_served_pte_total",
        "pte_request_served_pte_bucket",
        "pte_reference_pte_total",
        "pte_ideal_pte_total",
        "pte_eviction_tax_pte_total",
        "pte_recompute_tax_pte_total",
        "pte_gamma",
        "pte_hardware_operational_intensity_flops_per_byte",
        "pte_session_served_pte_bucket",
        "pte_session_turns_bucket",
        "pte_tool_pause_seconds_bucket",
        "pte_sessions_live",
        "pte_sessions_closed_total",
        "pte_requests_total",
        "pte_plugin_faults_total",
    }
    queried = set().union(*(metric_names(e) for _, e, opt in QUERIES if not opt))
    assert required <= queried, sorted(required - queried)
    assert any('finish_reason="length"' in e for _, e, _ in QUERIES)
    assert any("pte_gamma_measured" in e and not opt for _, e, opt in QUERIES)  # exported by the step hook


def test_the_seconds_and_money_row_is_there():
    """Where the GPU time goes, money, sessions, interference and calibration, by what they query."""
    row = next(r for r in ROWS if r.title == "Seconds and money")
    queries = [q for p in row.panels for q in p.queries]
    required = set().union(*(metric_names(q.expr) for q in queries if not q.optional))
    assert {
        "pte_gpu_seconds_total",
        "pte_session_gpu_seconds_bucket",
        "pte_interference_seconds_total",
        "pte_gamma_measured",
        "pte_gamma",
    } <= required
    unpriced = set().union(*(metric_names(q.expr) for q in queries if q.empty_on_test_server == "unpriced"))
    assert {"pte_cost_usd_total", "pte_session_cost_usd_bucket"} <= unpriced
    unfitted = set().union(*(metric_names(q.expr) for q in queries if q.empty_on_test_server == "unfitted"))
    assert unfitted == {"pte_step_model_r2", "pte_step_model_mape_ratio"}
    gpu = next(p for p in row.panels if "pte_gpu_seconds_total" in p.queries[0].expr)
    assert gpu.stacked and "phase" in gpu.queries[0].expr
    assert any("3600 *" in q.expr and "pte_cost_usd_total" in q.expr for q in queries)  # per hour


def test_vllm_series_the_dashboard_reads_are_vllms_own():
    """Every vllm:* series a query reads is one of VLLM_SERIES (with a sample suffix), and
    the installed vLLM defines each, with the model_name and engine labels the joins use."""
    suffixes = ("", "_total", "_sum", "_count", "_bucket")
    allowed = {f"{s}{x}" for s in VLLM_SERIES for x in suffixes}
    read = {m for _, expr, _ in QUERIES for m in VLLM_METRIC.findall(expr)}
    assert read and read <= allowed, sorted(read - allowed)
    assert {s for s in VLLM_SERIES if any(m.startswith(s) for m in read)} == set(VLLM_SERIES)
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    loggers = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text(encoding="utf-8")
    assert 'labelnames = ["model_name", "engine"]' in loggers
    for series in VLLM_SERIES:
        assert f'name="{series}"' in loggers, f"vLLM no longer exports {series}"
