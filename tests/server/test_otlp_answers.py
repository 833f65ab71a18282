"""The OTLP/HTTP exporters against every answer a collector can give, through a real HTTP
receiver and the SDK's own exporters: a partial success, a redirect, error statuses, a
Retry-After, a body that is no OTLP answer, gzip, a bad certificate path, headers the client
cannot send. Each record not delivered is counted lost, each fault line is one line, and
queueing a record never waits on the collector."""

from __future__ import annotations

import gzip
import http.server
import ipaddress
import logging
import re
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsPartialSuccess,
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client import CollectorRegistry

from pte_instrument.faults import FaultTracker
from pte_instrument.server.exporters.otel import MAX_PARTS, OtelExporter, OtelLogExporter, OtelMetricsExporter
from tests.server.builders import request_record

# An answer: status, headers, body.
Answer = tuple[int, dict[str, str], bytes]
PROTOBUF = {"Content-Type": "application/x-protobuf"}


class Collector:
    """An OTLP/HTTP receiver in this process: ``answer(n)`` gives its answer to the n-th
    request (from 0); it decodes what each request carried (gzip included)."""

    def __init__(self, answer: Callable[[int], Answer], tls: tuple[Path, Path] | None = None) -> None:
        self.items: list[int] = []  # spans or log records of each request, in order
        self.encodings: list[str | None] = []
        self.indices: list[set[int]] = []  # of each request: the records ``cmpl-<i>`` it carried
        lock = threading.Lock()
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                encoding = self.headers.get("Content-Encoding")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                texts: list[str] = []  # each item's words that name its request
                if self.path.endswith("/v1/logs"):
                    request = ExportLogsServiceRequest.FromString(body)
                    logs = [x for r in request.resource_logs for s in r.scope_logs for x in s.log_records]
                    n, texts = len(logs), [x.body.string_value for x in logs]
                elif self.path.endswith("/v1/metrics"):
                    n = 0
                else:
                    request = ExportTraceServiceRequest.FromString(body)
                    spans = [x for r in request.resource_spans for s in r.scope_spans for x in s.spans]
                    n = len(spans)
                    texts = [
                        a.value.string_value
                        for x in spans
                        for a in x.attributes
                        if a.key == "gen_ai.response.id"
                    ]
                with lock:
                    index = len(collector.items)
                    collector.items.append(n)
                    collector.indices.append({int(i) for t in texts for i in re.findall(r"cmpl-(\d+)", t)})
                    collector.encodings.append(encoding)
                status, headers, answer = collector.answer(index)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.answer = answer
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        scheme = "http" if tls is None else "https"
        self.url = f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def collector(request) -> Iterator[Collector]:
    c = Collector(request.param)
    yield c
    c.close()


class Lost:
    """``on_failed``: each error, and the records of every batch not delivered, by (model, engine)."""

    def __init__(self) -> None:
        self.by: Counter[tuple[str, int]] = Counter()
        self.errors: list[Exception] = []

    def __call__(self, error: Exception, records: Counter[tuple[str, int]]) -> None:
        self.by.update(records)
        self.errors.append(error)

    @property
    def total(self) -> int:
        return sum(self.by.values())


def record(i: int, model: str = "tiny", engine: int = 0):
    return request_record(
        request_id=f"cmpl-{i}", model=model, engine=engine, finish_reason="stop", e2e_s=0.5, finished_at=1.7e9
    )


SIGNALS = [
    pytest.param(OtelExporter, "TRACES", "/v1/traces", id="spans"),
    pytest.param(OtelLogExporter, "LOGS", "/v1/logs", id="logs"),
]


def partial(path: str, rejected: int, message: str) -> bytes:
    if path == "/v1/logs":
        return ExportLogsServiceResponse(
            partial_success=ExportLogsPartialSuccess(rejected_log_records=rejected, error_message=message)
        ).SerializeToString()
    return ExportTraceServiceResponse(
        partial_success=ExportTracePartialSuccess(rejected_spans=rejected, error_message=message)
    ).SerializeToString()


def send(
    monkeypatch,
    collector: Collector,
    exporter_class,
    signal: str,
    path: str,
    n: int = 5,
    model: str = "tiny",
    **env: str,
) -> tuple[Lost, float]:
    """``n`` records of ``model`` exported as one batch to ``collector`` (the export timeout
    1 s): what the exporter reported lost, and the longest that queueing one record took."""
    monkeypatch.setenv(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT", env.pop("endpoint", collector.url + path))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    lost = Lost()
    exporter = exporter_class(on_failed=lost)
    slowest = 0.0
    try:
        for i in range(n):
            start = time.monotonic()
            exporter.export(record(i, model, engine=i % 2))
            slowest = max(slowest, time.monotonic() - start)
        assert exporter.provider.force_flush(10_000)
    finally:
        exporter.shutdown(timeout_s=2.0)
    return lost, slowest


def one_line(error: Exception) -> str:
    """The line the fault tracker logs for ``error``, asserted to be one line."""
    logger = logging.getLogger("pte_instrument")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, r: logging.LogRecord) -> None:
            records.append(r)

    handler = Keep()
    logger.addHandler(handler)
    try:
        FaultTracker().record("otel", error)
    finally:
        logger.removeHandler(handler)
    [logged] = records
    text = logging.Formatter().format(logged)
    assert "\n" not in text and "Traceback" not in text, text
    return text


@pytest.mark.parametrize(
    "collector", [lambda n: (200, PROTOBUF, partial("/v1/traces", 2, "2 spans had no name"))], indirect=True
)
def test_the_spans_a_partial_success_rejects_are_counted_lost(collector, monkeypatch):
    lost, _ = send(monkeypatch, collector, OtelExporter, "TRACES", "/v1/traces")
    assert collector.items == [5]  # one batch, sent once: OTLP says not to retry it
    assert lost.total == 2
    assert "rejected 2 of an OTLP spans batch of 5: 2 spans had no name" in one_line(lost.errors[0])


@pytest.mark.parametrize(
    "collector", [lambda n: (200, PROTOBUF, partial("/v1/logs", 3, "too old"))], indirect=True
)
def test_the_log_records_a_partial_success_rejects_are_counted_lost(collector, monkeypatch):
    lost, _ = send(monkeypatch, collector, OtelLogExporter, "LOGS", "/v1/logs")
    assert collector.items == [5]
    assert lost.total == 3
    assert "rejected 3 of an OTLP logs batch of 5: too old" in str(lost.errors[0])


@pytest.mark.parametrize(
    "collector",
    [
        lambda n: (
            200,
            {"Content-Type": "application/json"},
            b'{"partialSuccess": {"rejectedSpans": "4", "errorMessage": "quota"}}',
        )
    ],
    indirect=True,
)
def test_a_partial_success_answered_in_json_is_read_too(collector, monkeypatch):
    lost, _ = send(monkeypatch, collector, OtelExporter, "TRACES", "/v1/traces")
    assert lost.total == 4
    assert "quota" in str(lost.errors[0])


@pytest.mark.parametrize(
    "collector", [lambda n: (200, PROTOBUF, partial("/v1/traces", 10**6, "everything"))], indirect=True
)
def test_a_partial_success_that_rejects_more_than_the_batch_counts_the_batch(collector, monkeypatch):
    lost, _ = send(monkeypatch, collector, OtelExporter, "TRACES", "/v1/traces")
    assert lost.total == 5


@pytest.mark.parametrize(
    "collector", [lambda n: (200, PROTOBUF, partial("/v1/traces", 0, "use the new endpoint"))], indirect=True
)
def test_a_partial_success_that_rejects_nothing_loses_nothing(collector, monkeypatch):
    lost, _ = send(monkeypatch, collector, OtelExporter, "TRACES", "/v1/traces")
    assert (lost.total, lost.errors) == (0, [])


@pytest.mark.parametrize(
    "collector",
    [
        lambda n: (
            200,
            PROTOBUF,
            ExportMetricsServiceResponse(
                partial_success=ExportMetricsPartialSuccess(rejected_data_points=3, error_message="bad unit")
            ).SerializeToString(),
        )
    ],
    indirect=True,
)
def test_the_metric_points_a_partial_success_rejects_are_a_fault_that_says_how_many(collector, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", collector.url + "/v1/metrics")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")
    lost = Lost()
    exporter = OtelMetricsExporter(on_failed=lost)
    try:
        exporter.export(record(0))
        assert exporter.provider.force_flush(10_000)
        assert len(collector.items) == 1
        assert len(lost.errors) == 1
        assert "rejected 3 metric data points of an OTLP metrics batch: bad unit" in str(lost.errors[0])
    finally:
        exporter.shutdown(timeout_s=2.0)


@pytest.mark.parametrize(
    "collector",
    [
        pytest.param(lambda n, s=s: (s, {"Location": "http://elsewhere:4318/v1/x"}, b""), id=str(s))
        for s in (301, 302, 307, 308)
    ],
    indirect=True,
)
@pytest.mark.parametrize(("exporter_class", "signal", "path"), SIGNALS)
def test_a_redirect_is_no_delivery_and_its_batch_is_counted_lost(
    collector, monkeypatch, exporter_class, signal, path
):
    lost, _ = send(monkeypatch, collector, exporter_class, signal, path)
    assert collector.items == [5]  # the SDK does not follow it
    assert lost.by == {("tiny", 0): 3, ("tiny", 1): 2}
    line = one_line(lost.errors[0])
    assert "redirect" in line and "http://elsewhere:4318/v1/x" in line


@pytest.mark.parametrize(
    "collector",
    [pytest.param(lambda n, s=s: (s, {}, b"no"), id=str(s)) for s in (400, 404, 500)],
    indirect=True,
)
@pytest.mark.parametrize(("exporter_class", "signal", "path"), SIGNALS)
def test_an_error_status_loses_the_batch_counted_with_one_line_that_names_the_status(
    collector, monkeypatch, exporter_class, signal, path
):
    lost, _ = send(monkeypatch, collector, exporter_class, signal, path)
    status = collector.answer(0)[0]
    assert collector.items == [5]  # not retried
    assert lost.by == {("tiny", 0): 3, ("tiny", 1): 2}
    line = one_line(lost.errors[0])
    assert f"the collector answered {status}" in line


@pytest.mark.parametrize(("exporter_class", "signal", "path"), SIGNALS)
def test_a_batch_over_the_collectors_request_size_is_delivered_in_halves(
    monkeypatch, caplog, exporter_class, signal, path
):
    """A collector that takes at most 2 items a request (its body size limit) answers 413 to
    the SDK's batch of 5: the batch goes again as halves until each fits, and all 5 arrive,
    none counted lost; one line says which setting avoids the refusal."""
    caplog.set_level(logging.WARNING, logger="pte_instrument")
    collector = Collector(
        lambda n: (413, {}, b"too large") if collector.items[n] > 2 else (200, PROTOBUF, b"")
    )
    try:
        lost, _ = send(monkeypatch, collector, exporter_class, signal, path)
    finally:
        collector.close()
    assert collector.items == [5, 2, 3, 1, 2]
    assert lost.total == 0 and lost.errors == []
    advice = [r.getMessage() for r in caplog.records if "too large" in r.getMessage()]
    assert len(advice) == 1 and "MAX_EXPORT_BATCH_SIZE" in advice[0], advice


@pytest.mark.parametrize("value_limit", [None, "8"], ids=["whole", "attribute-values-cut"])
@pytest.mark.parametrize(("exporter_class", "signal", "path"), SIGNALS)
def test_an_item_over_the_collectors_request_size_alone_is_lost_the_rest_delivered(
    monkeypatch, exporter_class, signal, path, value_limit
):
    """A collector that refuses as too large every request that holds the third record (of
    engine 0): the halves that hold only others are delivered, that record alone is counted
    lost, in one line that says a single item is over the collector's limit — also where the
    SDK cut the model name the items carry (``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``), so that
    the halves cannot be told apart by it (the model's name cut to 8 characters, the records'
    ids whole)."""

    def answer(n: int) -> Answer:
        return (413, {}, b"too large") if 2 in collector.indices[n] else (200, PROTOBUF, b"")

    collector = Collector(answer)
    env = {"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": value_limit} if value_limit else {}
    try:
        lost, _ = send(monkeypatch, collector, exporter_class, signal, path, model="a-served-model", **env)
    finally:
        collector.close()
    # 5 refused; the half with it refused, the other delivered; and so on down to it alone
    refused = [n for n, records in zip(collector.items, collector.indices, strict=True) if 2 in records]
    delivered = [n for n, records in zip(collector.items, collector.indices, strict=True) if 2 not in records]
    assert refused in ([5, 2, 1], [5, 3, 1]) and sorted(delivered) == sorted([5 - refused[1], refused[1] - 1])
    assert lost.by == {("a-served-model", 0): 1} and len(lost.errors) == 1
    line = one_line(lost.errors[0])
    assert "the collector answered 413" in line and "to a batch of one" in line


@pytest.mark.parametrize(
    "collector",
    [lambda n: (503, {"Retry-After": "30"}, b"")],
    indirect=True,
)
def test_a_retry_after_past_the_export_timeout_gives_the_batch_up_at_once_and_counts_it(
    collector, monkeypatch
):
    start = time.monotonic()
    lost, slowest = send(monkeypatch, collector, OtelExporter, "TRACES", "/v1/traces")
    assert time.monotonic() - start < 5.0  # not the 30 s asked for
    assert collector.items == [5]
    assert lost.total == 5
    assert "the collector answered 503" in one_line(lost.errors[0])
    assert slowest < 0.5  # queueing a record never waits on the collector (its export: 1 s)


@pytest.mark.parametrize(
    "collector",
    [lambda n: (429, {"Retry-After": "0"}, b"") if n < 2 else (200, PROTOBUF, b"")],
    indirect=True,
)
def test_a_batch_delivered_after_a_retry_after_is_not_counted_lost(collector, monkeypatch):
    lost, _ = send(monkeypatch, collector, OtelLogExporter, "LOGS", "/v1/logs")
    assert collector.items == [5, 5, 5]
    assert (lost.total, lost.errors) == (0, [])


@pytest.mark.parametrize(
    "collector",
    [lambda n: (429, {"Retry-After": "0"}, b"")],
    indirect=True,
)
def test_a_collector_that_always_answers_429_loses_the_batch_after_the_sdks_retries(collector, monkeypatch):
    lost, _ = send(monkeypatch, collector, OtelExporter, "TRACES", "/v1/traces")
    assert collector.items == [5] * 6  # the SDK's tries
    assert lost.total == 5


@pytest.mark.parametrize(
    "collector",
    [
        pytest.param(lambda n: (200, {"Content-Type": "text/html"}, b"<html>ok</html>"), id="html"),
        pytest.param(lambda n: (200, PROTOBUF, b"\xff\xfe not protobuf"), id="garbage"),
        pytest.param(lambda n: (200, {"Content-Type": "application/json"}, b"{not json"), id="bad-json"),
        pytest.param(lambda n: (200, {"Content-Type": "application/json"}, b"{}"), id="json"),
        pytest.param(lambda n: (204, {}, b""), id="no-content"),
    ],
    indirect=True,
)
def test_a_success_whose_body_is_no_otlp_answer_is_delivery(collector, monkeypatch):
    lost, _ = send(monkeypatch, collector, OtelExporter, "TRACES", "/v1/traces")
    assert collector.items == [5]
    assert (lost.total, lost.errors) == (0, [])


@pytest.mark.parametrize(
    "collector", [lambda n: (200, PROTOBUF, partial("/v1/logs", 1, "one too big"))], indirect=True
)
def test_gzip_batches_are_delivered_and_a_partial_success_still_counted(collector, monkeypatch):
    lost, _ = send(
        monkeypatch, collector, OtelLogExporter, "LOGS", "/v1/logs", OTEL_EXPORTER_OTLP_COMPRESSION="gzip"
    )
    assert collector.encodings == ["gzip"]
    assert collector.items == [5]
    assert lost.total == 1


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, signed by its own key: (certificate, key) files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / f"{name}.pem", directory / f"{name}.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_file, key_file


@pytest.fixture
def tls_collector(tmp_path) -> Iterator[tuple[Collector, Path, Path]]:
    """A collector over TLS with a certificate of its own: (collector, its certificate, another
    CA bundle that does not sign it)."""
    tls = self_signed(tmp_path, "collector")
    other, _ = self_signed(tmp_path, "other")
    c = Collector(lambda n: (200, PROTOBUF, b""), tls=tls)
    yield c, tls[0], other
    c.close()


@pytest.mark.parametrize("requests_ca_bundle", [False, True])
def test_a_certificate_path_that_names_no_file_loses_each_batch_with_one_line_naming_it(
    tls_collector, monkeypatch, tmp_path, requests_ca_bundle
):
    collector, _, other = tls_collector
    missing = tmp_path / "no-such-ca.pem"
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    if requests_ca_bundle:
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(other))
    else:
        monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    lost, slowest = send(
        monkeypatch,
        collector,
        OtelExporter,
        "TRACES",
        "/v1/traces",
        OTEL_EXPORTER_OTLP_CERTIFICATE=str(missing),
    )
    assert collector.items == []
    assert lost.total == 5
    assert str(missing) in one_line(lost.errors[0])
    assert slowest < 0.5


@pytest.mark.parametrize("variable", ["REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"])
def test_the_certificate_setting_is_used_where_requests_own_ca_bundle_variable_is_set(
    tls_collector, monkeypatch, variable
):
    collector, certificate, other = tls_collector
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    # an image's bundle, which does not sign the collector's certificate
    monkeypatch.setenv(variable, str(other))
    lost, _ = send(
        monkeypatch,
        collector,
        OtelLogExporter,
        "LOGS",
        "/v1/logs",
        OTEL_EXPORTER_OTLP_CERTIFICATE=str(certificate),
    )
    assert collector.items == [5]
    assert (lost.total, lost.errors) == (0, [])


@pytest.mark.parametrize("collector", [lambda n: (200, PROTOBUF, b"")], indirect=True)
@pytest.mark.parametrize(
    ("headers", "skipped"),
    [("abc", ["abc"]), ("x-key=v\u00e9lue", ["x-key=v\u00e9lue"]), ("=,,=x", ["=", "=x"])],
)
def test_header_settings_the_sdk_cannot_parse_are_skipped_each_with_a_line_and_the_batch_delivered(
    collector, monkeypatch, caplog, headers, skipped
):
    with caplog.at_level(logging.WARNING, logger="opentelemetry"):
        lost, _ = send(
            monkeypatch, collector, OtelExporter, "TRACES", "/v1/traces", OTEL_EXPORTER_OTLP_HEADERS=headers
        )
    said = [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry.util")]
    assert [line.rpartition(": ")[2] for line in said] == skipped
    assert all("\n" not in line for line in said)
    assert collector.items == [5]
    assert lost.total == 0


@pytest.mark.parametrize("collector", [lambda n: (200, PROTOBUF, b"")], indirect=True)
def test_a_header_value_http_cannot_carry_loses_each_batch_with_one_line_that_says_why(
    collector, monkeypatch
):
    lost, _ = send(
        monkeypatch,
        collector,
        OtelLogExporter,
        "LOGS",
        "/v1/logs",
        OTEL_EXPORTER_OTLP_HEADERS="x-key=%E2%82%AC",  # URL-encoded as the variable asks: the euro sign
    )
    assert collector.items == []  # never sent
    assert lost.total == 5
    assert "codec can't encode" in one_line(lost.errors[0])


@pytest.mark.parametrize(
    "collector", [lambda n: (200, PROTOBUF, partial("/v1/traces", 2, "2 spans had no name"))], indirect=True
)
def test_the_runtime_counts_rejected_spans_in_the_lost_records_and_the_faults(collector, monkeypatch):
    from pte_instrument.server.runtime import Runtime
    from pte_instrument.settings import Settings

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", collector.url + "/v1/traces")
    registry = CollectorRegistry()
    runtime = Runtime(Settings(otel=True, otel_logs=False, otel_metrics=False), registry)
    try:
        for i in range(5):
            runtime.otel.export(record(i, model="m", engine=1))
        assert runtime.otel.provider.force_flush(10_000)
    finally:
        runtime.close_exporters(2.0)
        runtime.sessions.close()
    lost = {"model_name": "m", "engine": "1", "stage": "otel"}
    assert registry.get_sample_value("pte_exporter_records_lost_total", lost) == 2
    assert registry.get_sample_value("pte_plugin_faults_total", {"stage": "otel"}) == 1
    assert runtime.records_lost["otel"] == 2


@pytest.mark.parametrize("collector", [lambda n: (413, {}, b"too large")], indirect=True)
def test_a_collector_that_refuses_every_request_as_too_large_gets_a_bounded_number_of_parts(
    collector, monkeypatch
):
    """A collector whose limit no single span fits: a batch of 100 is not sent as 199
    requests of ever smaller parts; it stops at the parts one batch may take, and every
    span is counted lost, in lines that name the batch size setting."""
    lost, _ = send(monkeypatch, collector, OtelExporter, "TRACES", "/v1/traces", n=100)
    assert 1 < len(collector.items) <= 1 + MAX_PARTS, len(collector.items)
    assert lost.total == 100
    assert any("OTEL_BSP_MAX_EXPORT_BATCH_SIZE" in one_line(e) for e in lost.errors), lost.errors[:2]
