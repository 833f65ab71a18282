"""The metric table is what a scrape shows: the families ``PteMetrics`` registers, read
back from prometheus_client's text exposition, match the table and the hand-written
names, types and labels below (the contract dashboards and queries depend on). The
exporter binds its label children once and still exposes a series only once it has data."""

from __future__ import annotations

import os
import subprocess
import sys
import typing

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from pte_instrument.server.exporters.families import FAMILIES, FamilySpec
from pte_instrument.server.exporters.prometheus import PrometheusExporter, PteMetrics
from tests import exposition
from tests.server.builders import gpu_split, request_record

M, E = ("model_name", "engine"), ("model_name", "benchmark")
A = (*M, "tenant", "lora_name")  # who used what: a tenant, a LoRA adapter
# (type, label names) -> the exposed names (a counter's with _total) of that type and those
# labels, written out by hand.
# fmt: off
BY_TYPE_AND_LABELS: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {
    ("counter", (*A, "finish_reason")): ("pte_requests_total",),
    ("counter", (*A, "phase")): ("pte_served_pte_total", "pte_reference_pte_total", "pte_gpu_seconds_total"),
    ("counter", A): (
        "pte_prompt_tokens_total", "pte_cached_tokens_total", "pte_output_tokens_total", "pte_cost_usd_total",
    ),
    ("counter", (*M, "reason")): ("pte_wasted_pte_total",),
    ("counter", M): (
        "pte_ideal_pte_total", "pte_recompute_tax_pte_total", "pte_eviction_tax_pte_total",
        "pte_routing_tax_pte_total", "pte_routing_tax_gpu_seconds_total",
        "pte_engine_served_pte_total", "pte_engine_recompute_tax_pte_total", "pte_engine_roofline_pte_total",
        "pte_spec_draft_tokens_total", "pte_spec_rejected_tokens_total", "pte_interference_seconds_total",
    ),
    ("histogram", M): ("pte_request_served_pte", "pte_request_gpu_seconds"),
    ("gauge", (*M, "device")): ("pte_gamma", "pte_hardware_operational_intensity_flops_per_byte"),
    ("gauge", (*M, "term", "source")): ("pte_step_model_coefficient",),
    ("gauge", (*M, "stage")): ("pte_exporter_enabled",),
    ("counter", (*M, "stage")): ("pte_exporter_records_lost_total",),
    ("gauge", M): (
        "pte_active_parameters", "pte_kv_cache_bytes_per_token", "pte_engine_busy_seconds",
        "pte_gpu_seconds_unattributed", "pte_gamma_measured", "pte_step_model_r2",
        "pte_step_model_mape_ratio", "pte_step_model_speed_ratio", "pte_engine_estimate_gap_pte",
    ),
    ("counter", E): (
        "pte_eval_requests_total", "pte_eval_truncated_total", "pte_eval_output_tokens_total",
        "pte_eval_labeled_total", "pte_eval_labeled_truncated_total", "pte_eval_labeled_output_tokens_total",
        "pte_correct_answers_total",
    ),
    ("histogram", ("model_name",)): (
        "pte_session_turns", "pte_session_served_pte", "pte_session_eviction_tax_pte",
        "pte_session_gpu_seconds", "pte_session_cost_usd", "pte_tool_pause_seconds",
    ),
    ("counter", ("model_name", "reason")): ("pte_sessions_closed_total",),
    ("counter", ("reason",)): ("pte_session_ids_rejected_total",),
    ("counter", ("stage",)): ("pte_plugin_faults_total",),
    ("gauge", ()): ("pte_sessions_live",),
    ("counter", ()): (
        "pte_sessions_opened_total", "pte_session_turn_rows_dropped_total", "pte_session_tags_dropped_total",
        "pte_session_records_lost_total",
    ),
}
# How each gauge merges across API-server processes.
GAUGE_MODES = {
    **dict.fromkeys(
        ("pte_gamma", "pte_hardware_operational_intensity_flops_per_byte", "pte_active_parameters",
         "pte_kv_cache_bytes_per_token", "pte_gpu_seconds_unattributed",
         "pte_step_model_coefficient", "pte_gamma_measured", "pte_step_model_r2",
         "pte_step_model_mape_ratio", "pte_step_model_speed_ratio"),
        "mostrecent",
    ),
    "pte_engine_busy_seconds": "max",  # only grows: the engine's latest report
    "pte_engine_estimate_gap_pte": "sum",  # a running sum that may go negative
    "pte_sessions_live": "mostrecent",  # every API server reads the host's one store
    "pte_exporter_enabled": "min",  # 0 when any API server has suspended the exporter
}
# fmt: on
# Exposed name -> (type, label names).
EXPECTED = {name: kind_labels for kind_labels, names in BY_TYPE_AND_LABELS.items() for name in names}
LEDGER = {"sessions_live", "sessions_opened", "turn_rows_dropped", "tags_dropped", "session_records_lost"}


def exposed_name(spec: FamilySpec) -> str:
    return spec.name + "_total" if spec.kind == "counter" else spec.name


@pytest.fixture(scope="module")
def scraped() -> dict[str, tuple[str, str, list]]:
    registry = CollectorRegistry()
    metrics = PteMetrics(registry)
    for spec in FAMILIES:
        if spec.labels:  # a labelled family shows no sample before its first child
            getattr(metrics, spec.attr).labels(*("v" for _ in spec.labels))
    return exposition.families(generate_latest(registry).decode("utf-8"))


def test_the_table_is_the_hand_written_contract():
    assert {exposed_name(s): (s.kind, s.labels) for s in FAMILIES} == EXPECTED
    assert {s.name: s.multiprocess_mode for s in FAMILIES if s.kind == "gauge"} == GAUGE_MODES
    assert {s.attr for s in FAMILIES if s.source == "ledger"} == LEDGER == set(PteMetrics.LEDGER)
    assert len({s.attr for s in FAMILIES}) == len({s.name for s in FAMILIES}) == len(FAMILIES)


def test_the_registry_exposes_exactly_the_table(scraped):
    table = {s.name: s for s in FAMILIES}  # the parser names a counter's family without _total
    created = {s.name + "_created" for s in FAMILIES if s.kind != "gauge"}
    assert {n for n in scraped if n not in created} == table.keys()
    for name, spec in table.items():
        kind, help_text, samples = scraped[name]
        assert (kind, help_text) == (spec.kind, spec.help), name
        labels = {tuple(sorted(k for k in s.labels if k != "le")) for s in samples}
        assert labels == {tuple(sorted(spec.labels))}, name  # the exposition sorts them
        assert [float(s.labels["le"]) for s in samples if "le" in s.labels] == list(spec.upper_bounds), name


def test_histogram_bounds_end_in_inf_as_prometheus_client_adds_it():
    pause = next(s for s in FAMILIES if s.name == "pte_tool_pause_seconds")
    assert pause.buckets[-1] == 3600 and pause.upper_bounds[-2:] == (3600.0, float("inf"))
    assert all(type(b) is float for b in pause.upper_bounds)


def test_pte_metrics_attributes_are_typed_as_the_table_says():
    hints = typing.get_type_hints(PteMetrics)
    assert {a: h.__name__.lower() for a, h in hints.items()} == {s.attr: s.kind for s in FAMILIES}
    metrics = PteMetrics(CollectorRegistry())
    for spec in FAMILIES:
        assert isinstance(getattr(metrics, spec.attr), hints[spec.attr]), spec.attr


@pytest.mark.parametrize(
    "row",
    [
        dict(name="requests", kind="counter"),  # no pte_ prefix
        dict(name="pte_requests_total", kind="counter"),  # prometheus_client adds _total
        dict(name="pte_x", kind="gauge"),  # a gauge must say how it merges
        dict(name="pte_x", kind="counter", multiprocess_mode="sum"),
        dict(name="pte_x", kind="histogram"),  # no buckets
        dict(name="pte_x", kind="histogram", buckets=(2.0, 1.0)),
        dict(name="pte_x", kind="counter", buckets=(1.0,)),
        dict(name="pte_x", kind="counter", labels=("model",), source="ledger"),
        dict(name="pte_x", kind="counter", help=""),
    ],
)
def test_a_bad_row_is_refused(row):
    with pytest.raises(ValueError, match="metric family"):
        FamilySpec(**{"attr": "x", "help": "Something.", **row})


def test_the_exporter_binds_once_and_exposes_series_only_with_data():
    registry = CollectorRegistry()
    exporter = PrometheusExporter("m", 0, PteMetrics(registry))
    lab = {"model_name": "m", "engine": "0"}
    attributed = {"pte_requests_total", "pte_served_pte_total", "pte_reference_pte_total"}

    def value(name: str, **labels: str) -> float | None:
        by = {"tenant": "", "lora_name": ""} if name in attributed else {}  # tenants off, the base model
        return registry.get_sample_value(name, {**lab, **by, **labels})

    assert value("pte_served_pte_total", phase="prefill") is None  # nothing before the first request
    exporter.export(request_record())
    exporter.export(request_record(finish_reason="length"))
    exporter.export(request_record())
    assert value("pte_requests_total", finish_reason="stop") == 2
    assert value("pte_requests_total", finish_reason="length") == 1
    assert value("pte_served_pte_total", phase="prefill") == 270
    assert value("pte_reference_pte_total", phase="prefill") == 300
    assert value("pte_reference_pte_total", phase="decode") == 60
    assert value("pte_request_served_pte_count") == 3
    # No scheduler hook and no session: those series stay absent, not at 0.
    assert value("pte_engine_served_pte_total") is None
    assert registry.get_sample_value("pte_tool_pause_seconds_count", {"model_name": "m"}) is None

    exporter.export(
        request_record(
            pause_s=2.0,
            engine_pte_served=95.0,
            engine_pte_roofline=80.0,
            engine_recompute_tokens=4,
            engine_spec_tokens=6,
            engine_rejected_tokens=2,
        )
    )
    assert value("pte_engine_served_pte_total") == 95
    assert value("pte_engine_estimate_gap_pte") == 2
    assert value("pte_spec_rejected_tokens_total") == 2
    assert registry.get_sample_value("pte_tool_pause_seconds_count", {"model_name": "m"}) == 1


def test_closed_sessions_feed_the_seconds_and_money_histograms_only_when_they_have_them():
    registry = CollectorRegistry()
    metrics = PteMetrics(registry)
    base = {"model": "m", "turns": 3, "pte_served": 500.0, "pte_eviction_tax": 20.0}

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m"})

    # the step hook and a price: 2.5 GPU seconds, $0.004 (3 turns summed by the ledger)
    metrics.session_closed({**base, "gpu_seconds": 2.5, "cost_usd": 0.004}, "idle")
    # the step hook without a price: seconds, no money
    metrics.session_closed({**base, "gpu_seconds": 0.5, "cost_usd": 0.0}, "idle")
    # neither (the ledger sums None as 0): no observation, not a free session
    metrics.session_closed({**base, "gpu_seconds": 0.0, "cost_usd": 0.0}, "evicted")
    assert value("pte_session_served_pte_count") == 3
    assert value("pte_session_gpu_seconds_count") == 2
    assert value("pte_session_gpu_seconds_sum") == pytest.approx(3.0)
    assert registry.get_sample_value("pte_session_gpu_seconds_bucket", {"model_name": "m", "le": "1.0"}) == 1
    assert registry.get_sample_value("pte_session_gpu_seconds_bucket", {"model_name": "m", "le": "3.0"}) == 2
    assert value("pte_session_cost_usd_count") == 1
    assert value("pte_session_cost_usd_sum") == pytest.approx(0.004)
    assert registry.get_sample_value("pte_session_cost_usd_bucket", {"model_name": "m", "le": "0.003"}) == 0
    assert registry.get_sample_value("pte_session_cost_usd_bucket", {"model_name": "m", "le": "0.01"}) == 1


def test_a_closed_session_with_a_value_a_shared_store_could_not_read_is_counted_closed():
    """A session store shared with another writer can hand back a closed session whose turn
    count or PTE was unreadable (None): it is counted closed, the readable values observed."""
    registry = CollectorRegistry()
    PteMetrics(registry).session_closed(
        {"model": "m", "turns": None, "pte_served": None, "pte_eviction_tax": 20.0}, "idle"
    )
    assert registry.get_sample_value("pte_sessions_closed_total", {"model_name": "m", "reason": "idle"}) == 1
    assert not registry.get_sample_value("pte_session_turns_count", {"model_name": "m"})  # none observed
    assert registry.get_sample_value("pte_session_eviction_tax_pte_sum", {"model_name": "m"}) == 20.0


def test_usage_is_attributed_to_tenant_and_adapter_and_the_cache_stays_bounded():
    registry = CollectorRegistry()
    exporter = PrometheusExporter("m", 0, PteMetrics(registry))
    timed = dict(**gpu_split(0.5, 0.5, 0.5, 0.5), interference_s=0.0, cost_usd=0.25)
    exporter.export(request_record(tenant="team-a", lora_name="ad", **timed))
    exporter.export(request_record(tenant="team-a", **timed))
    exporter.export(request_record(tenant="other", lora_name="ad"))

    def value(name: str, tenant: str, lora: str, **labels: str) -> float | None:
        return registry.get_sample_value(
            name, {"model_name": "m", "engine": "0", "tenant": tenant, "lora_name": lora, **labels}
        )

    assert value("pte_requests_total", "team-a", "ad", finish_reason="stop") == 1
    assert value("pte_requests_total", "team-a", "", finish_reason="stop") == 1
    assert value("pte_served_pte_total", "other", "ad", phase="prefill") == 90
    assert value("pte_cost_usd_total", "team-a", "ad") == 0.25
    assert value("pte_gpu_seconds_total", "team-a", "", phase="kv_read") == 0.5
    assert value("pte_cost_usd_total", "other", "ad") is None  # no step hook: no seconds, no money
    # families that do not attribute keep one series per (model, engine)
    assert registry.get_sample_value("pte_ideal_pte_total", {"model_name": "m", "engine": "0"}) == 3.0

    bound = exporter._usage
    bound.capacity = 2
    for i in range(10):  # past its capacity the cache starts over; the series are the same
        exporter.export(request_record(tenant=f"t{i % 3}"))
        assert len(bound) <= 2
    assert value("pte_served_pte_total", "t0", "", phase="prefill") == 4 * 90


def test_cost_appears_only_once_a_request_is_priced():
    """Without PTE_GPU_HOURLY_PRICE there is no cost series, not one at $0: a dashboard or rule
    then shows "no data" rather than a free GPU."""
    registry = CollectorRegistry()
    exporter = PrometheusExporter("m", 0, PteMetrics(registry))
    seconds = dict(**gpu_split(0.2, 0.1, 0.1, 0.1), interference_s=0.0)
    exporter.export(request_record(**seconds, cost_usd=None))
    text = generate_latest(registry).decode()
    assert "pte_gpu_seconds_total{" in text
    assert not [line for line in text.splitlines() if line.startswith("pte_cost_usd_total")]
    exporter.export(request_record(**seconds, cost_usd=0.002))
    priced = [
        line
        for line in generate_latest(registry).decode().splitlines()
        if line.startswith("pte_cost_usd_total")
    ]
    assert len(priced) == 1 and float(priced[0].rsplit(" ", 1)[1]) == pytest.approx(0.002)


# One API-server process: publishes one engine report (busy s, attributed s) into the
# multiprocess directory its environment names, as every API server of a vLLM with several does.
_PUBLISH_ONE_REPORT = """
import sys
from prometheus_client import CollectorRegistry
from pte_instrument.server.exporters.prometheus import PrometheusExporter, PteMetrics
PrometheusExporter("m", 0, PteMetrics(CollectorRegistry())).publish_engine_time(
    float(sys.argv[1]), float(sys.argv[2])
)
"""


@pytest.fixture
def newer_report_published_first(tmp_path) -> CollectorRegistry:
    """Two API server processes in one ``PROMETHEUS_MULTIPROC_DIR``: the first publishes the
    engine's newer report (busy 2.0 s, 1.5 s of it attributed), the second an older one (1.0,
    0.8) after it; the merge of their files, as ``/metrics`` serves it."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for busy, attributed in ((2.0, 1.5), (1.0, 0.8)):
        subprocess.run(
            [sys.executable, "-c", _PUBLISH_ONE_REPORT, str(busy), str(attributed)], env=env, check=True
        )
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    return registry


def test_engine_busy_time_never_goes_back_when_an_older_report_is_published_last(
    newer_report_published_first,
):
    """The engine sends its busy time with each request's totals to the API server that owns
    the request; a server that publishes an older report after another published a newer one
    must not take the gauge back (a busy time that drops reads as a reset to ``rate()``)."""
    labels = {"model_name": "m", "engine": "0"}
    assert newer_report_published_first.get_sample_value("pte_engine_busy_seconds", labels) == 2.0


def test_unattributed_time_is_the_newest_reports_when_an_older_one_is_published_last(
    newer_report_published_first,
):
    """Busy minus attributed time is not monotone, so it cannot merge as the largest: with
    several API servers it must be the newest engine report's (the one with the most busy
    time), not that of whichever server published last."""
    labels = {"model_name": "m", "engine": "0"}
    assert newer_report_published_first.get_sample_value("pte_gpu_seconds_unattributed", labels) == 0.5
