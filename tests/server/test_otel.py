"""The OpenTelemetry exporters through the real SDK, exporting to its in-memory span exporter
and metric reader: span name, parentage, status and attributes; the GenAI server metrics
with the conventions' buckets; the pte.* counters; and the Prometheus exemplar that names
the span's trace."""

from __future__ import annotations

import dataclasses
import re

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from pte_instrument.faults import FaultTracker
from pte_instrument.server.exporters.exposition import exposition
from pte_instrument.server.exporters.otel import OtelExporter, OtelMetricsExporter
from pte_instrument.server.exporters.prometheus import PrometheusExporter, PteMetrics
from pte_instrument.server.pricer import RequestPricer
from pte_instrument.server.records import FinishedRequest, RequestRecord
from tests.server.builders import gpu_split, request_record
from tests.server.test_pricer import make

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def record(**kw: object) -> RequestRecord:
    """A chat request of model "tiny" that ran out of tokens, timed as vLLM times it."""
    timed = dict(e2e_s=0.5, finished_at=1_700_000_000.25, ttft_s=0.125, tpot_s=0.0625)
    return request_record(
        **{"request_id": "cmpl-r-0", "model": "tiny", "finish_reason": "length", **timed, **kw}
    )


@pytest.fixture
def spans():
    memory = InMemorySpanExporter()
    otel = OtelExporter(span_exporter=memory)

    def export(*records: RequestRecord):
        for r in records:
            otel.export(r)
        otel.provider.force_flush()
        return memory.get_finished_spans()

    yield export
    otel.shutdown()


def test_span_name_and_operation_follow_the_route(spans):
    chat, text, unknown = spans(record(operation="chat"), record(operation="text_completion"), record())
    assert (chat.name, chat.attributes["gen_ai.operation.name"]) == ("chat tiny", "chat")
    assert (text.name, text.attributes["gen_ai.operation.name"]) == (
        "text_completion tiny",
        "text_completion",
    )
    assert (unknown.name, unknown.attributes["gen_ai.operation.name"]) == ("chat tiny", "chat")  # the default
    for s in (chat, text, unknown):
        assert s.attributes["gen_ai.response.model"] == s.attributes["gen_ai.request.model"] == "tiny"
        assert s.attributes["gen_ai.provider.name"] == "vllm" and s.kind == SpanKind.SERVER


@pytest.mark.parametrize("reason", ["error", "abort"])
def test_a_request_that_did_not_complete_is_an_error_span(spans, reason):
    (span,) = spans(record(finish_reason=reason))
    assert span.status.status_code == StatusCode.ERROR and reason in span.status.description
    assert span.attributes["error.type"] == reason
    assert span.attributes["gen_ai.response.finish_reasons"] == (reason,)


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_a_finished_request_has_no_error(spans, reason):
    (span,) = spans(record(finish_reason=reason))
    assert span.status.status_code == StatusCode.UNSET and "error.type" not in span.attributes


def test_span_is_a_child_of_the_callers_trace_or_a_root_of_the_records(spans):
    child, root = spans(
        record(traceparent=f"00-{TRACE}-{PARENT}-01", trace_id=TRACE),
        record(trace_id="0123456789abcdef0123456789abcdef"),
    )
    assert f"{child.context.trace_id:032x}" == TRACE and f"{child.parent.span_id:016x}" == PARENT
    assert child.parent.is_remote
    assert root.parent is None and f"{root.context.trace_id:032x}" == "0123456789abcdef0123456789abcdef"
    assert child.context.span_id != root.context.span_id


def test_an_unsampled_caller_trace_is_respected(spans):
    """The default sampler follows the parent: a caller that did not sample gets no span."""
    assert spans(record(traceparent=f"00-{TRACE}-{PARENT}-00", trace_id=TRACE)) == ()


def test_span_spans_arrival_to_finish_and_names_the_session(spans):
    (span,) = spans(record(session_id="agent-7", turn=3))
    assert span.end_time == pytest.approx(1_700_000_000_250_000_000, abs=1000)  # ns; float seconds
    assert span.end_time - span.start_time == pytest.approx(500_000_000, abs=1000)
    assert span.attributes["session.id"] == span.attributes["gen_ai.conversation.id"] == "agent-7"
    loose = spans(record())[-1]  # the memory exporter keeps every span so far
    assert "session.id" not in loose.attributes and "gen_ai.conversation.id" not in loose.attributes


def test_a_session_request_whose_turn_is_unknown_has_no_turn_attribute(spans):
    """The session store could not say the turn (a fault of its own): the span names the
    session and carries no ``pte.turn`` rather than one of no value (OTLP has no null)."""
    (span,) = spans(record(session_id="agent-7", turn=None))
    assert span.attributes["session.id"] == "agent-7" and "pte.turn" not in span.attributes
    (numbered,) = spans(record(session_id="agent-7", turn=3))[-1:]
    assert numbered.attributes["pte.turn"] == 3


def test_new_trace_ids_are_random_hex():
    otel = OtelExporter(span_exporter=InMemorySpanExporter())
    ids = {otel.new_trace_id() for _ in range(100)}
    otel.shutdown()
    assert len(ids) == 100 and all(re.fullmatch("[0-9a-f]{32}", i) for i in ids)


def test_the_pricer_gives_each_request_its_trace(tmp_path):
    fresh = iter(["1" * 32, "2" * 32])
    acc, _, _ = make(tmp_path)
    acc.new_trace_id = lambda: next(fresh)
    req = FinishedRequest("r", "m", 100, 0, 10, "stop")
    assert acc.on_finished(req).trace_id == "1" * 32
    joined = acc.on_finished(dataclasses.replace(req, traceparent=f"00-{TRACE}-{PARENT}-01"))
    assert joined.trace_id == TRACE and joined.traceparent == f"00-{TRACE}-{PARENT}-01"
    assert acc.on_finished(req).trace_id == "2" * 32
    untraced = RequestPricer(acc.cost_model, [], FaultTracker())  # tracing off: no trace, even the caller's
    assert (
        untraced.on_finished(dataclasses.replace(req, traceparent=f"00-{TRACE}-{PARENT}-01")).trace_id is None
    )


# --- metrics ------------------------------------------------------------------------------

# semantic-conventions-genai, gen-ai-metrics.md: the explicit bucket advice, written out
DURATION = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def collect(*records: RequestRecord) -> dict[str, dict]:
    """metric name → {"unit", "points": [(attributes, point)]}."""
    reader = InMemoryMetricReader()
    exporter = OtelMetricsExporter(reader)
    for r in records:
        exporter.export(r)
    out: dict[str, dict] = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = {
                    "unit": m.unit,
                    "points": [(dict(p.attributes), p) for p in m.data.data_points],
                    "resource": dict(rm.resource.attributes),
                }
    exporter.shutdown()
    return out


def test_server_metrics_follow_the_genai_conventions():
    m = collect(
        record(operation="text_completion"),
        record(operation="text_completion", e2e_s=3.0, ttft_s=0.75),
        record(operation="chat", e2e_s=0.05, ttft_s=0.02, tpot_s=None),
    )
    want = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": "tiny",
        "gen_ai.response.model": "tiny",
    }
    for name, bounds, text_sum, chat_count in (
        ("gen_ai.server.request.duration", DURATION, 3.5, 1),
        ("gen_ai.server.time_to_first_token", TTFT, 0.875, 1),
        ("gen_ai.server.time_per_output_token", TPOT, 0.125, 0),
    ):
        assert m[name]["unit"] == "s"
        points = dict((attrs["gen_ai.operation.name"], (attrs, p)) for attrs, p in m[name]["points"])
        attrs, text = points["text_completion"]
        assert attrs == want and tuple(text.explicit_bounds) == bounds, name
        assert (text.count, text.sum) == (2, pytest.approx(text_sum, rel=1e-12)), name
        assert (points["chat"][1].count if "chat" in points else 0) == chat_count, name
    assert m["gen_ai.server.request.duration"]["resource"]["service.name"] == "vllm"


def test_a_failed_request_has_an_error_type_and_no_ttft_or_tpot():
    m = collect(record(finish_reason="abort"), record(finish_reason="error"), record(finish_reason="stop"))
    by_error = {attrs.get("error.type"): p for attrs, p in m["gen_ai.server.request.duration"]["points"]}
    assert {k: p.count for k, p in by_error.items()} == {"abort": 1, "error": 1, None: 1}
    for name in ("gen_ai.server.time_to_first_token", "gen_ai.server.time_per_output_token"):
        ((attrs, p),) = m[name]["points"]
        assert p.count == 1 and "error.type" not in attrs, name


def test_pte_counters_by_phase_seconds_by_term_and_money():
    m = collect(
        record(pte_prefill=90.0, pte_decode=3.0, pte_reference=120.0, prompt_tokens=100),
        record(
            pte_prefill=10.0,
            pte_decode=2.5,
            pte_reference=40.0,
            prompt_tokens=30,
            **gpu_split(0.5, 0.25, 0.125, 0.125),
            cost_usd=0.002,
        ),
    )

    def values(name: str) -> dict:
        return {attrs.get("pte.phase"): p.value for attrs, p in m[name]["points"]}

    assert m["pte.served"]["unit"] == "{pte}" and values("pte.served") == {"prefill": 100.0, "decode": 5.5}
    # reference: the whole prompt prefilled, the rest decode (100 + 20, 30 + 10)
    assert values("pte.reference") == {"prefill": 130.0, "decode": 30.0}
    assert m["pte.gpu.time"]["unit"] == "s"
    assert values("pte.gpu.time") == {"prefill": 0.5, "kv_read": 0.25, "weights": 0.125, "overhead": 0.125}
    assert values("pte.cost") == {None: pytest.approx(0.002)} and m["pte.cost"]["unit"] == "{USD}"
    assert all(attrs["gen_ai.request.model"] == "tiny" for attrs, _ in m["pte.served"]["points"])


def test_no_seconds_or_money_without_them():
    m = collect(record())
    assert "pte.gpu.time" not in m and "pte.cost" not in m


# --- the Prometheus exemplar ----------------------------------------------------------------


def exemplars(text: str, family: str) -> list[tuple[float, str, float]]:
    pattern = rf'^{family}_bucket\{{[^}}]*le="([^"]+)"[^}}]*\}} \S+ # \{{trace_id="([0-9a-f]+)"\}} (\S+)'
    return [(float(le), t, float(v)) for le, t, v in re.findall(pattern, text, re.M)]


def test_the_per_request_histograms_carry_the_trace_as_an_exemplar():
    registry = CollectorRegistry()
    exporter = PrometheusExporter("tiny", 0, PteMetrics(registry))
    exporter.export(record(trace_id=TRACE, pte_served=93.0, **gpu_split(0.02, 0.0, 0.0, 0.0)))
    exporter.export(record(trace_id=None, pte_served=5000.0))  # untraced: no exemplar
    body, content_type = exposition("application/openmetrics-text; version=1.0.0", registry)
    assert content_type.startswith("application/openmetrics-text")
    text = body.decode()
    assert exemplars(text, "pte_request_served_pte") == [(100.0, TRACE, 93.0)]  # on the bucket it fell in
    assert exemplars(text, "pte_request_gpu_seconds") == [(0.03, TRACE, 0.02)]
    plain, plain_type = exposition(None, registry)
    assert plain_type.startswith("text/plain") and b"trace_id" not in plain


# --- the switches ---------------------------------------------------------------------------


def test_otel_metrics_are_on_where_metrics_have_somewhere_to_go():
    from pte_instrument.settings import Settings

    assert not Settings.from_env({}).otel_metrics
    assert Settings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}).otel_metrics
    assert Settings.from_env({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/v1/metrics"}).otel_metrics
    assert not Settings.from_env(
        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}
    ).otel_metrics
    assert Settings.from_env({"PTE_OTEL_METRICS": "1"}).otel_metrics
    assert not Settings.from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "PTE_OTEL_METRICS": "0"}
    ).otel_metrics
    assert not Settings.from_env({"PTE_OTEL_METRICS": "1", "OTEL_SDK_DISABLED": "true"}).otel_metrics
    bad = Settings.from_env({"PTE_OTEL_METRICS": "sometimes"})
    assert not bad.otel_metrics and any("PTE_OTEL_METRICS='sometimes'" in e for e in bad.errors)


class Flaky:
    """An in-memory span or log exporter that reports its first ``down`` batches as failed."""

    def __init__(self, result: type, down: int) -> None:
        self.result, self.down, self.received = result, down, []

    def export(self, batch, *args, **kwargs):
        if self.down > 0:
            self.down -= 1
            return self.result.FAILURE
        self.received.extend(batch)
        return self.result.SUCCESS

    def shutdown(self) -> None: ...

    def force_flush(self, timeout_millis: int = 0) -> bool:
        return True


def test_failed_otlp_batches_are_faults_and_their_records_lost_until_the_collector_is_back():
    from opentelemetry.sdk._logs.export import LogRecordExportResult
    from opentelemetry.sdk.trace.export import SpanExportResult

    from pte_instrument.server.exporters.otel import OtelLogExporter

    for make_exporter, result in (
        (lambda e, cb: OtelExporter(span_exporter=e, on_failed=cb), SpanExportResult),
        (lambda e, cb: OtelLogExporter(log_exporter=e, on_failed=cb), LogRecordExportResult),
    ):
        flaky = Flaky(result, down=2)
        failures: list[tuple[Exception, dict]] = []
        exporter = make_exporter(flaky, lambda e, lost, failures=failures: failures.append((e, dict(lost))))
        priced = 0
        for batch in range(4):  # one flushed batch each: two lost, two delivered
            for i in range(batch + 1):
                exporter.export(record(request_id=f"cmpl-{batch}-{i}", model="tiny", engine=1))
                priced += 1
            exporter.provider.force_flush()
        exporter.shutdown()
        lost = sum(n for _, by in failures for n in by.values())
        assert len(failures) == 2 and all("not delivered" in str(e) for e, _ in failures)
        assert [by for _, by in failures] == [{("tiny", 1): 1}, {("tiny", 1): 2}]
        assert len(flaky.received) == 3 + 4
        assert len(flaky.received) + lost == priced


def test_an_otlp_exporter_that_raises_is_counted_and_the_sdk_still_sees_the_error():
    from opentelemetry.sdk.trace.export import SpanExportResult

    from pte_instrument.server.exporters.otel import count_failures

    class Raises(Flaky):
        def export(self, batch, *args, **kwargs):
            raise ConnectionError("collector away")

    failures: list[Exception] = []
    exporter = count_failures(Raises(SpanExportResult, 0), lambda e, lost: failures.append(e), "spans")
    with pytest.raises(ConnectionError):
        exporter.export([])
    assert [str(e) for e in failures] == ["collector away"]
