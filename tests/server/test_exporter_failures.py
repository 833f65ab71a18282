"""Exporters against collectors that misbehave, through real sockets: every record is either
delivered or counted lost, no export outlives its timeout, and closing the exporters at
exit is bounded however stuck the collector is."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from pte_instrument.server.exporters.otel import OtelExporter, OtelLogExporter
from tests.server.builders import request_record

ROOT = Path(__file__).resolve().parents[2]


class Collector:
    """A local TCP server that accepts OTLP/HTTP connections and answers as ``mode`` says:
    ``hang`` (reads nothing, answers nothing) or ``trickle`` (a status line, then one header
    line every 50 ms, never the end of the headers)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            if self.mode == "trickle":
                conn.recv(1 << 16)
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                while not self.stop.wait(0.05):
                    conn.sendall(b"X-Slow: 1\r\n")
            else:
                self.stop.wait()
        except OSError:
            pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def collector(request) -> Iterator[Collector]:
    c = Collector(request.param)
    yield c
    c.close()


def record(i: int, engine: int = 0):
    return request_record(
        request_id=f"cmpl-{i}",
        model="tiny",
        engine=engine,
        finish_reason="stop",
        e2e_s=0.5,
        finished_at=1.7e9,
    )


class Lost:
    """``on_failed``: the records of every batch not delivered, by (model, engine)."""

    def __init__(self) -> None:
        self.by: Counter[tuple[str, int]] = Counter()
        self.failed = threading.Event()

    def __call__(self, error: Exception, records: Counter[tuple[str, int]]) -> None:
        self.by.update(records)
        self.failed.set()


def wait_for(done, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.01)
    return done()


SIGNALS = [
    pytest.param(OtelExporter, "TRACES", "BSP", id="spans"),
    pytest.param(OtelLogExporter, "LOGS", "BLRP", id="logs"),
]


@pytest.mark.parametrize("collector", ["hang"], indirect=True)
@pytest.mark.parametrize(("exporter_class", "signal", "processor"), SIGNALS)
def test_records_the_batch_queue_has_no_room_for_are_refused_and_counted(
    collector, monkeypatch, exporter_class, signal, processor
):
    monkeypatch.setenv(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT", collector.url + "/v1/x")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.3")
    monkeypatch.setenv(f"OTEL_{processor}_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv(f"OTEL_{processor}_MAX_EXPORT_BATCH_SIZE", "2")
    lost = Lost()
    exporter = exporter_class(on_failed=lost)
    refused = 0
    for i in range(20):  # far more than the queue holds while the collector hangs
        try:
            exporter.export(record(i))
        except Exception:
            refused += 1  # the pricer counts it lost
    exporter.shutdown(timeout_s=3.0)
    assert refused > 0
    assert refused + sum(lost.by.values()) == 20  # nothing delivered, nothing dropped unseen


@pytest.mark.parametrize("collector", ["trickle"], indirect=True)
def test_a_collector_that_trickles_its_answer_fails_the_batch_within_the_export_timeout(
    collector, monkeypatch
):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", collector.url + "/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.3")
    lost = Lost()
    exporter = OtelExporter(on_failed=lost)
    exporter.export(record(0, engine=1))
    threading.Thread(target=exporter.provider.force_flush, daemon=True).start()
    try:
        assert lost.failed.wait(10.0), "the export outlived its timeout (1.3 s; without a deadline, for ever)"
        assert lost.by == {("tiny", 1): 1}
    finally:
        collector.close()  # the trickle ends, and with it the stuck request
        exporter.shutdown(timeout_s=1.0)


@pytest.mark.parametrize("collector", ["hang"], indirect=True)
@pytest.mark.parametrize(("exporter_class", "signal", "processor"), SIGNALS)
def test_shutdown_with_a_hung_collector_is_bounded_and_counts_what_it_drops(
    collector, monkeypatch, exporter_class, signal, processor
):
    monkeypatch.setenv(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT", collector.url + "/v1/x")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TIMEOUT", raising=False)  # the SDK's 10 s
    monkeypatch.setenv(f"OTEL_{processor}_SCHEDULE_DELAY", "10")  # export at once: stuck in the collector
    lost = Lost()
    exporter = exporter_class(on_failed=lost)
    exporter.export(record(0))
    time.sleep(0.05)  # the worker has taken the first batch (the result holds either way)
    for i in range(1, 6):
        exporter.export(record(i))
    done = threading.Event()
    threading.Thread(target=lambda: (exporter.shutdown(timeout_s=1.0), done.set()), daemon=True).start()
    assert done.wait(10.0), "closing waited on the stuck collector (1 s allowed; the SDK's own wait is 30 s)"
    assert wait_for(lambda: sum(lost.by.values()) == 6, 1.0), lost.by


@pytest.mark.parametrize("collector", ["hang"], indirect=True)
def test_the_server_exits_promptly_while_the_collector_hangs(collector, tmp_path):
    script = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        os.environ.update(
            OTEL_EXPORTER_OTLP_ENDPOINT={collector.url!r},
            OTEL_BSP_SCHEDULE_DELAY="10",
            OTEL_BLRP_SCHEDULE_DELAY="10",
            PTE_OTEL_LOGS="1",
            PTE_OTEL_METRICS="1",
        )
        from pte_instrument.server import runtime
        runtime.CLOSE_TIMEOUT_S = 1.0
        from tests.server.builders import request_record
        rt = runtime.get_runtime()
        assert rt.otel and rt.otel_logs and rt.otel_metrics
        for exporter in (rt.otel, rt.otel_logs, rt.otel_metrics):
            exporter.export(request_record(request_id="r", model="tiny", e2e_s=0.5, finished_at=1.7e9))
        time.sleep(0.1)
        print("exiting", flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        said: list[bytes] = []
        reader = threading.Thread(target=lambda: said.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)  # start-up, imports included
        assert said == [b"exiting\n"], said
        start = time.monotonic()
        proc.wait(timeout=25.0)
        assert time.monotonic() - start < 10.0  # 1 s allowed; the SDK's exit hooks wait 30 s per provider
    finally:
        proc.kill()
        proc.wait()


def test_an_export_runs_in_the_context_that_suppresses_instrumentation():
    """The SDK's worker marks its exports so that HTTP instrumentation does not trace them;
    the export's own thread (the deadline's) keeps that mark."""
    from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, attach, detach, get_value, set_value

    from pte_instrument.server.exporters.otel import Deadline

    token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
    try:
        assert Deadline(5.0).run(lambda: get_value(_SUPPRESS_INSTRUMENTATION_KEY)) is True
    finally:
        detach(token)


def test_a_span_the_sampler_records_but_does_not_sample_takes_no_room_in_the_queue(monkeypatch):
    """Only sampled spans reach the batch processor's queue: a record-only sampler's spans
    must not fill the backlog (every later record would be refused)."""
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

    class RecordOnly(Sampler):
        def should_sample(self, *args, **kwargs):
            return SamplingResult(Decision.RECORD_ONLY)

        def get_description(self) -> str:
            return "record only"

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2")
    exporter = OtelExporter(span_exporter=InMemorySpanExporter())
    exporter.tracer.sampler = RecordOnly()
    for i in range(10):
        exporter.export(record(i))  # none refused
    assert len(exporter.delivery.backlog) == 0
    exporter.shutdown(timeout_s=1.0)


@pytest.mark.parametrize(
    ("value", "size"), [("inf", 2048), ("1e9", 2048), ("1e300", 2048), ("abc", 2048), ("16", 16)]
)
def test_the_queue_size_is_read_as_the_sdk_reads_it(monkeypatch, value, size):
    from pte_instrument.server.exporters.otel import queue_size

    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", value)
    assert queue_size("BSP") == size


@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "-1", "0"])
def test_an_export_timeout_past_any_sane_value_is_bounded(monkeypatch, value):
    from pte_instrument.server.exporters.otel import export_timeout_s

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", value)
    assert 0 < export_timeout_s("TRACES") <= 3600


def test_a_record_that_fails_to_queue_gives_its_room_back():
    """The pricer counts such a record lost; the backlog must not hold it too (it would be
    counted lost again at close, and take room from the records after it)."""
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter

    exporter = OtelLogExporter(log_exporter=InMemoryLogRecordExporter())

    def broken(*args, **kwargs):
        raise RuntimeError("the SDK could not take the record")

    exporter.logger.emit = broken
    with pytest.raises(RuntimeError):
        exporter.export(record(0))
    assert len(exporter.delivery.backlog) == 0
    exporter.shutdown(timeout_s=1.0)
