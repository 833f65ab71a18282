"""OpenTelemetry: one span per finished request (an agent turn), with the GenAI semantic
conventions where they apply and ``pte.*`` attributes for the rest; one log record per
priced request with the request log's fields, so that a collector gathers every replica's
ledger; and the GenAI model-server metrics with ``pte.*`` counters beside them. Configured
by the standard ``OTEL_*`` variables (endpoint, headers, service name, batch delays,
export interval)."""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv._incubating.attributes.session_attributes import SESSION_ID
from opentelemetry.semconv._incubating.metrics import gen_ai_metrics
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.semconv.attributes.service_attributes import SERVICE_NAME

from pte_instrument.faults import log
from pte_instrument.server.pricer import RecordRefused
from pte_instrument.server.records import GPU_SECONDS_TERMS, RequestRecord

LOG_EVENT = "pte.request"  # the event name of a priced-request log record
PROVIDER = "vllm"  # gen_ai.provider.name: vLLM is not one of the conventions' listed values
# A request whose route is unknown (the session middleware is not installed, or the
# request's tag was dropped): vLLM's chat API, its main route.
DEFAULT_OPERATION = gen_ai.GenAiOperationNameValues.CHAT.value
# Finish reasons of a request that did not complete: its error.type (the finish reason
# itself, a low-cardinality identifier, as the conventions ask), its span status ERROR.
FAILED = ("error", "abort")

# The conventions' explicit bucket advice for the GenAI model-server histograms (seconds).
REQUEST_DURATION_BUCKETS = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ExportFailed(RuntimeError):
    """A batch the OTLP exporter reported as not delivered (collector away, refused, timed out),
    or the part of one the collector rejected."""

    says_it_all = True  # a fault line shows the message, without a traceback


# Told of each batch not delivered: why, and how many records it held by (model, engine)
# (none for a metrics batch, which holds aggregates rather than records).
OnFailedBatch = Callable[[Exception, Counter[tuple[str, int]]], None]

DEFAULT_QUEUE_SIZE = 2048  # the SDK's batch processors' default
DEFAULT_TIMEOUT_S = 10.0  # the OTLP exporters' default (OTEL_EXPORTER_OTLP_TIMEOUT)
MAX_TIMEOUT_S = 3600.0  # longer is no timeout an export is waited for
TIMEOUT_GRACE_S = 1.0  # past the exporter's own timeout before an export is given up
CLOSE_TIMEOUT_S = 5.0  # what closing an exporter may take, its last batches' delivery included


def _env(variable: str) -> str | None:
    return os.environ.get(variable) or None


def queue_size(processor: str) -> int:
    """The batch processor's queue size, ``OTEL_{BSP,BLRP}_MAX_QUEUE_SIZE`` as the SDK reads it:
    a whole number above 0, else its default (the size is handed to the processor, which then
    reads no variable of its own)."""
    try:
        size = int(_env(f"OTEL_{processor}_MAX_QUEUE_SIZE") or DEFAULT_QUEUE_SIZE)
    except ValueError:
        return DEFAULT_QUEUE_SIZE
    return size if size > 0 else DEFAULT_QUEUE_SIZE


def export_timeout_s(signal: str) -> float:
    """The OTLP/HTTP exporter's timeout for ``signal`` (``TRACES``, ``LOGS``, ``METRICS``), in
    seconds as the Python SDK reads it (the per-signal variable, else the general one), bounded
    to what a deadline can wait: a number that is not one, or not in (0, MAX_TIMEOUT_S], is the
    default."""
    raw = _env(f"OTEL_EXPORTER_OTLP_{signal}_TIMEOUT") or _env("OTEL_EXPORTER_OTLP_TIMEOUT")
    try:
        timeout = float(raw or DEFAULT_TIMEOUT_S)
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return timeout if 0 < timeout <= MAX_TIMEOUT_S else DEFAULT_TIMEOUT_S


class Backlog:
    """The records handed to an SDK batch processor and not yet taken from its queue by an
    export, by (model, engine). Bounded by the queue's size: the SDK drops what its full queue
    has no room for with a log line only, so a record that would not fit is refused here
    instead (the pricer counts it lost), and what is still queued when the exporter closes
    is reported lost with the failed batches."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: Counter[tuple[str, int]] = Counter()
        self._n = 0
        self._closed = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._n

    def admit(self, key: tuple[str, int]) -> None:
        with self._lock:
            if self._closed:
                raise ExportFailed("the OTLP exporter is shut down")
            if self._n >= self.capacity:
                raise RecordRefused(
                    f"the OTLP batch queue is full ({self.capacity} records wait for the collector)"
                )
            self._held[key] += 1
            self._n += 1

    def release(self, key: tuple[str, int]) -> None:
        """A record admitted that never reached the queue."""
        with self._lock:
            if self._held[key] > 0:
                self._held[key] -= 1
                self._n -= 1

    def taken(self, records: Counter[tuple[str, int]], n: int) -> Counter[tuple[str, int]]:
        """``n`` records left the queue for an export, ``records`` by key: those of them the
        backlog held (none once closed: they were reported then)."""
        with self._lock:
            out = _share(self._held, records, min(n, self._n))
            self._held -= out
            self._n -= sum(out.values())
        return out

    def close(self) -> Counter[tuple[str, int]]:
        """Refuse every record from now on; returns those still queued."""
        with self._lock:
            self._closed = True
            left, self._held, self._n = +self._held, Counter(), 0
        return left


class Deadline:
    """Runs each export on a thread of its own and waits for it at most ``limit_s``, or until
    ``close_by`` once the exporter is closing: the HTTP client's timeout bounds each read of the
    collector's answer, not the whole answer, so a collector that trickles it would hold the
    SDK's worker, and every batch behind it, for ever. One export at a time: while a given-up
    export is still stuck, the next batch fails at once rather than starting another thread."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._close_by: float | None = None  # time.monotonic()
        self._stuck: threading.Thread | None = None
        self._cond = threading.Condition()

    def close_by(self, when: float) -> None:
        with self._cond:
            self._close_by = when
            self._cond.notify_all()

    def _end(self, start: float) -> float:
        return start + self.limit_s if self._close_by is None else min(start + self.limit_s, self._close_by)

    def run(self, export: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        if self._stuck is not None and self._stuck.is_alive():
            raise ExportFailed("the previous OTLP export is still waiting for the collector")
        if self._end(start) <= start:
            raise ExportFailed("the OTLP exporter closed before this batch could be sent")
        out: list[tuple[bool, Any]] = []

        def call() -> None:
            try:
                result = (True, export(*args, **kwargs))
            except BaseException as e:  # handed to the caller's thread
                result = (False, e)
            with self._cond:
                out.append(result)
                self._cond.notify_all()

        # in the caller's context: the SDK's worker marks it so that HTTP instrumentation
        # does not trace the export itself
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(call,), name="pte-otlp-export", daemon=True)
        thread.start()
        with self._cond:
            while not out and (left := self._end(start) - time.monotonic()) > 0:
                self._cond.wait(left)
            if not out:
                self._stuck = thread
                raise ExportFailed(
                    f"an OTLP export got no whole answer from the collector in {time.monotonic() - start:.3g} s"
                )
        ok, value = out[0]
        if not ok:
            raise value
        return value


# The HTTP answers to the export running on this thread (None: no export is watched here).
_answers = threading.local()
# What the collector answers a batch it took part of: the response message of each signal,
# and its field that counts the items rejected.
PARTIAL_SUCCESS = {
    "spans": ("trace.v1.trace_service_pb2", "ExportTraceServiceResponse", "rejected_spans"),
    "logs": ("logs.v1.logs_service_pb2", "ExportLogsServiceResponse", "rejected_log_records"),
    "metrics": ("metrics.v1.metrics_service_pb2", "ExportMetricsServiceResponse", "rejected_data_points"),
}
# What a span or log batch is made of: such a batch over a collector's request size is sent
# again in halves (a metrics batch is one message).
ITEM = {"spans": "span", "logs": "log record"}
BATCH_SIZE_VARIABLE = {"spans": "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "logs": "OTEL_BLRP_MAX_EXPORT_BATCH_SIZE"}
MAX_REASON_CHARS = 300  # of a collector's or client's words quoted in a fault line
MAX_PARTS = 64  # requests one batch may take once a collector refuses it as too large


def _watch_answers(exporter: Any) -> None:
    """Keep each HTTP answer an OTLP/HTTP exporter gets, for the export it belongs to: the SDK
    reads only the status, so that a redirect (which it does not follow) and a partial success
    (whose rejected items it does not read) are both a success to it. An exporter that is not
    the SDK's (no such transport) is left as it is."""
    transport = getattr(getattr(exporter, "_client", None), "_transport", None)
    request = getattr(transport, "request", None)
    if request is None:
        return
    _keep_certificate(getattr(transport, "_session", None))

    def watched(*args: Any, **kwargs: Any) -> Any:
        answer = request(*args, **kwargs)
        answers = getattr(_answers, "list", None)
        if answers is not None:
            answers.append(answer)
        return answer

    transport.request = watched


def _keep_certificate(session: Any) -> None:
    """Make the exporter's CA bundle (``OTEL_EXPORTER_OTLP[_…]_CERTIFICATE``, the session's
    ``verify``) hold for its requests: requests lets ``REQUESTS_CA_BUNDLE`` or ``CURL_CA_BUNDLE``
    replace a session's own, and wherever an image sets either, the collector's CA would go
    unused and every batch fail its certificate check."""
    merge = getattr(session, "merge_environment_settings", None)
    if merge is None or getattr(session, "verify", True) is True:  # no CA bundle of the exporter's
        return

    def merged(*args: Any, **kwargs: Any) -> Any:
        settings = merge(*args, **kwargs)
        settings["verify"] = session.verify
        return settings

    session.merge_environment_settings = merged


def _one_line(text: object) -> str:
    words = " ".join(str(text).split())
    return words if len(words) <= MAX_REASON_CHARS else words[: MAX_REASON_CHARS - 1] + "…"


def _status(answer: Any) -> int | None:
    status = getattr(answer, "status_code", None)
    return status if isinstance(status, int) else None


def _why(answers: list[Any], kind: str, size: int) -> str:
    """Why a batch of ``size`` was not delivered, from the last answer to it (none: the SDK's
    log says)."""
    if not answers:
        return ""
    answer = answers[-1]
    status = _status(answer)
    if status is None:
        error = getattr(answer, "error", None)
        if isinstance(error, UnicodeEncodeError):  # http.client sends header values in Latin-1 only
            return f": a header value HTTP cannot carry (OTEL_EXPORTER_OTLP_HEADERS?): {_one_line(error)}"
        return "" if error is None else f": {_one_line(error)}"
    why = f": the collector answered {status} {_one_line(getattr(answer, 'reason', '') or '')}".rstrip()
    if status == 413 and kind in ITEM:
        why += (
            f" to a batch of one: a single {ITEM[kind]} over its request size limit"
            if size == 1
            else f" to parts of {size} after {MAX_PARTS} requests (a smaller {BATCH_SIZE_VARIABLE[kind]} sends "
            "smaller batches)"
        )
    return why


def _redirect(answers: list[Any]) -> str | None:
    """What a redirect answer said, if the batch got one: the SDK does not follow it, so the
    batch went nowhere, though the SDK counts any status below 400 a success."""
    for answer in answers:
        status = _status(answer)
        if status is not None and 300 <= status < 400:
            try:
                location = answer.headers().get("location")
            except Exception:
                location = None
            to = f" to {_one_line(location)}" if location else ""
            return (
                f"the collector answered {status} {_one_line(getattr(answer, 'reason', '') or '')}{to}, a "
                "redirect, which OTLP exporters do not follow: set the endpoint to the address it names"
            )
    return None


def _rejected(answers: list[Any], kind: str) -> tuple[int, str]:
    """How many items the collector's successful answers say it rejected (an OTLP partial
    success), and its words about why."""
    module, response_class, field = PARTIAL_SUCCESS[kind]
    rejected, why = 0, ""
    for answer in answers:
        status = _status(answer)
        if status is None or not 200 <= status < 300:
            continue
        try:
            body = answer.content()
            if not body:
                continue
            content_type = answer.headers().get("content-type", "").partition(";")[0].strip().lower()
            response = getattr(
                importlib.import_module(f"opentelemetry.proto.collector.{module}"), response_class
            )()
            if content_type.endswith("json"):  # the OTLP/JSON answer, if a collector sends one
                from google.protobuf import json_format

                json_format.Parse(body, response, ignore_unknown_fields=True)
            elif content_type in ("", "application/x-protobuf", "application/protobuf"):
                response.ParseFromString(body)
            else:
                continue
        except Exception:  # no OTLP answer (a proxy's page): the status says the batch was taken
            continue
        n = max(0, int(getattr(response.partial_success, field)))
        rejected += n
        if n and response.partial_success.error_message:
            why = _one_line(response.partial_success.error_message)
    return rejected, why


def _share(
    held: Counter[tuple[str, int]], read: Counter[tuple[str, int]], n: int
) -> Counter[tuple[str, int]]:
    """Which ``n`` of the records ``held`` some items are, ``read`` (by the key read back from
    them) first: the rest of ``held`` makes up the items whose key was not read or no longer
    matches (the SDK cuts attribute values over ``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``)."""
    out = Counter({k: min(c, held[k]) for k, c in read.items() if held[k] > 0})
    rest = n - sum(out.values())
    for k in list(held):
        if rest <= 0:
            break
        extra = min(rest, held[k] - out[k])
        if extra > 0:
            out[k] += extra
            rest -= extra
    return out


def _some(records: Counter[tuple[str, int]], n: int) -> Counter[tuple[str, int]]:
    """``n`` of ``records``: the collector does not say which items it rejected, so they are
    charged to the batch's (model, engine) in the batch's order."""
    out: Counter[tuple[str, int]] = Counter()
    for key, count in records.items():
        if n <= 0:
            break
        out[key] = min(count, n)
        n -= out[key]
    return out


def _failure(kind: str) -> Any:
    """The SDK's FAILURE result for an exporter of ``kind``."""
    if kind == "spans":
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.FAILURE
    if kind == "logs":
        from opentelemetry.sdk._logs.export import LogRecordExportResult

        return LogRecordExportResult.FAILURE
    from opentelemetry.sdk.metrics.export import MetricExportResult

    return MetricExportResult.FAILURE


def count_failures(
    exporter: Any,
    on_failed: OnFailedBatch | None,
    kind: str,
    backlog: Backlog | None = None,
    deadline: Deadline | None = None,
) -> Any:
    """``exporter`` with its ``export`` reporting every failed batch to ``on_failed``: the
    SDK's processors and readers only log what they drop. With ``backlog``, each batch leaves
    it as the SDK hands it over; with ``deadline``, no export outlives it (a FAILURE)."""
    if on_failed is None and backlog is None and deadline is None:
        return exporter
    _watch_answers(exporter)
    export = exporter.export

    def answered(batch: Any, *args: Any, **kwargs: Any) -> tuple[Any, list[Any]]:
        """The export's result, and the collector's answers to it (on the thread it runs on)."""
        _answers.list = answers = []
        try:
            return export(batch, *args, **kwargs), answers
        finally:
            _answers.list = None

    advised: list[bool] = []  # the batch size advice is logged once

    def counted(batch: Any, *args: Any, **kwargs: Any) -> Any:
        records = _records_of(batch, kind)
        if backlog is not None:
            records = backlog.taken(records, len(batch))
        return delivered(batch, records, [MAX_PARTS], *args, **kwargs)

    def halves(
        batch: Any, records: Counter[tuple[str, int]], parts: list[int], *args: Any, **kwargs: Any
    ) -> Any:
        """A batch over the collector's request size, sent again as two: each half reports
        what it loses, so a half that fails leaves the other delivered. ``parts``: the
        requests the original batch may still take."""
        if not advised:
            advised.append(True)
            log.warning(
                "pte-instrument: the OTLP collector refused a %s batch of %d as too large (413); it is "
                "sent again in parts, and a smaller %s avoids the refusal",
                kind,
                len(batch),
                BATCH_SIZE_VARIABLE[kind],
            )
        parts[0] -= 2
        batch, half = list(batch), len(batch) // 2
        first = _share(records, _records_of(batch[:half], kind), half)
        results = []
        for part, part_records in ((batch[:half], first), (batch[half:], records - first)):
            try:
                results.append(delivered(part, part_records, parts, *args, **kwargs))
            except Exception:  # counted lost by the half that raised
                results.append(_failure(kind))
        return next((r for r in results if getattr(r, "name", "SUCCESS") != "SUCCESS"), results[0])

    def delivered(
        batch: Any, records: Counter[tuple[str, int]], parts: list[int], *args: Any, **kwargs: Any
    ) -> Any:
        try:
            result, answers = (
                answered(batch, *args, **kwargs)
                if deadline is None
                else deadline.run(answered, batch, *args, **kwargs)
            )
        except Exception as e:
            if on_failed is not None:
                on_failed(e, records)
            if isinstance(e, ExportFailed):  # given up by the deadline: a failed batch, as the SDK sees it
                return _failure(kind)
            raise
        n = len(batch) if kind in ITEM else 0  # a metrics batch is one message
        size = f" of {n}" if n else ""
        if getattr(result, "name", "SUCCESS") != "SUCCESS":
            if n > 1 and parts[0] >= 2 and answers and _status(answers[-1]) == 413:
                return halves(batch, records, parts, *args, **kwargs)
            if on_failed is not None:
                on_failed(
                    ExportFailed(f"an OTLP {kind} batch{size} was not delivered{_why(answers, kind, n)}"),
                    records,
                )
            return result
        redirect = _redirect(answers)
        if redirect is not None:
            if on_failed is not None:
                on_failed(ExportFailed(f"an OTLP {kind} batch{size} was not delivered: {redirect}"), records)
            return _failure(kind)
        rejected, why = _rejected(answers, kind)
        if rejected and on_failed is not None:  # a success still: OTLP says not to send it again
            if kind == "metrics":
                what, lost = f"{rejected} metric data points of an OTLP metrics batch", Counter()
            else:
                rejected = min(rejected, n)
                what, lost = f"{rejected} of an OTLP {kind} batch{size}", _some(records, rejected)
            on_failed(ExportFailed(f"the collector rejected {what}{': ' + why if why else ''}"), lost)
        return result

    exporter.export = counted
    return exporter


def _records_of(batch: Any, kind: str) -> Counter[tuple[str, int]]:
    """The priced records in a span or log batch, by (model, engine)."""
    out: Counter[tuple[str, int]] = Counter()
    if kind == "metrics":
        return out
    with contextlib.suppress(Exception):  # counting must not fail on an item of another shape
        for item in batch:
            attrs = getattr(item, "attributes", None) or getattr(
                getattr(item, "log_record", None), "attributes", {}
            )
            model = attrs.get(gen_ai.GEN_AI_REQUEST_MODEL, attrs.get("model", ""))
            out[(str(model), int(attrs.get("pte.engine", attrs.get("engine", 0)) or 0))] += 1
    return out


def _resource() -> Any:
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create()  # reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "vllm"}))
    return resource


class Delivery:
    """One signal's way to the collector: our own SDK provider (vLLM's tracing, when on, keeps
    its own), the backlog of records queued in its batch processor (none for metrics, which
    are aggregates) and the deadline on each export. The SDK's exit hook is off: its shutdown
    waits up to 30 s per provider for a collector that does not answer; ``close`` is bounded."""

    def __init__(
        self,
        provider: Any,
        on_failed: OnFailedBatch | None,
        backlog: Backlog | None,
        deadline: Deadline | None,
    ) -> None:
        self.provider = provider
        self.on_failed = on_failed
        self.backlog = backlog
        self.deadline = deadline

    @contextlib.contextmanager
    def admitted(self, key: tuple[str, int]) -> Iterator[None]:
        """Around queueing a record: raises ``RecordRefused`` first if the queue has no room
        for it; a record that fails to queue (it is counted lost) gives its room back."""
        if self.backlog is None:
            yield
            return
        self.backlog.admit(key)
        try:
            yield
        except BaseException:
            self.backlog.release(key)
            raise

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Deliver what is queued within ``timeout_s``; what is not is reported lost."""
        if self.deadline is not None:  # every export from now on ends by then, or fails at once
            self.deadline.close_by(time.monotonic() + timeout_s)
        try:
            if self.backlog is None:
                self.provider.shutdown(timeout_millis=timeout_s * 1000)
            else:
                self.provider.shutdown()  # its worker's last exports are bounded by the deadline
        finally:
            left = None if self.backlog is None else self.backlog.close()
            if left and self.on_failed is not None:
                self.on_failed(
                    ExportFailed(
                        f"{sum(left.values())} OTLP records were still queued when the exporter closed"
                    ),
                    left,
                )


def _deadline(signal: str) -> Deadline:
    return Deadline(export_timeout_s(signal) + TIMEOUT_GRACE_S)


def _batched(
    processor_class: Any,
    exporter: Any,
    on_failed: OnFailedBatch | None,
    kind: str,
    processor: str,
    signal: str,
) -> tuple[Any, Backlog, Deadline]:
    """A batch processor of ``processor_class`` over ``exporter`` (``processor``: the prefix of
    its variables, ``signal``: the exporter's), with the backlog of its queue and the deadline
    on its exports."""
    backlog, deadline = Backlog(queue_size(processor)), _deadline(signal)
    exporting = count_failures(exporter, on_failed, kind, backlog, deadline)
    return processor_class(exporting, max_queue_size=backlog.capacity), backlog, deadline


def build_tracer_provider(
    id_generator: Any = None, span_exporter: Any = None, on_failed: OnFailedBatch | None = None
) -> Delivery:
    """Spans exported over OTLP/HTTP."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if span_exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter()
    batch, backlog, deadline = _batched(
        BatchSpanProcessor, span_exporter, on_failed, "spans", "BSP", "TRACES"
    )
    provider = TracerProvider(resource=_resource(), id_generator=id_generator, shutdown_on_exit=False)
    provider.add_span_processor(batch)
    return Delivery(provider, on_failed, backlog, deadline)


def build_logger_provider(log_exporter: Any = None, on_failed: OnFailedBatch | None = None) -> Delivery:
    """Log records exported over OTLP/HTTP (``OTEL_EXPORTER_OTLP[_LOGS]_ENDPOINT``)."""
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

    if log_exporter is None:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter

        log_exporter = OTLPLogExporter()
    batch, backlog, deadline = _batched(
        BatchLogRecordProcessor, log_exporter, on_failed, "logs", "BLRP", "LOGS"
    )
    provider = LoggerProvider(resource=_resource(), shutdown_on_exit=False)
    provider.add_log_record_processor(batch)
    return Delivery(provider, on_failed, backlog, deadline)


def build_meter_provider(reader: Any = None, on_failed: OnFailedBatch | None = None) -> Delivery:
    """Metrics exported over OTLP/HTTP every ``OTEL_METRIC_EXPORT_INTERVAL``
    (``OTEL_EXPORTER_OTLP[_METRICS]_ENDPOINT``; temporality from the exporter's variable)."""
    from opentelemetry.sdk.metrics import MeterProvider

    deadline = None
    if reader is None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        deadline = _deadline("METRICS")
        reader = PeriodicExportingMetricReader(
            count_failures(OTLPMetricExporter(), on_failed, "metrics", deadline=deadline)
        )
    provider = MeterProvider(metric_readers=[reader], resource=_resource(), shutdown_on_exit=False)
    return Delivery(provider, on_failed, None, deadline)


def operation(r: RequestRecord) -> str:
    return r.operation or DEFAULT_OPERATION


def error_type(r: RequestRecord) -> str | None:
    return r.finish_reason if r.finish_reason in FAILED else None


def genai_attributes(r: RequestRecord) -> dict[str, Any]:
    """What the conventions require or recommend on both the span and the server metrics."""
    attrs: dict[str, Any] = {
        gen_ai.GEN_AI_OPERATION_NAME: operation(r),
        gen_ai.GEN_AI_PROVIDER_NAME: PROVIDER,
        gen_ai.GEN_AI_REQUEST_MODEL: r.model,
        gen_ai.GEN_AI_RESPONSE_MODEL: r.model,  # vLLM answers under the served name it was asked for
    }
    error = error_type(r)
    if error is not None:
        attrs[ERROR_TYPE] = error
    return attrs


def span_attributes(r: RequestRecord) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        **genai_attributes(r),
        gen_ai.GEN_AI_RESPONSE_ID: r.request_id,
        gen_ai.GEN_AI_RESPONSE_FINISH_REASONS: [r.finish_reason],
        gen_ai.GEN_AI_USAGE_INPUT_TOKENS: r.prompt_tokens,
        gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: r.output_tokens,
        gen_ai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: r.cached_tokens,
        "pte.served": r.pte_served,
        "pte.reference": r.pte_reference,
        "pte.ideal": r.pte_ideal,
        "pte.prefill": r.pte_prefill,
        "pte.decode": r.pte_decode,
        "pte.recompute_tax": r.pte_recompute,
        "pte.eviction_tax": r.pte_eviction_tax,
        "pte.routing_tax": r.pte_routing_tax,
        "pte.gamma": r.gamma,
        "pte.device": r.device,
        "pte.computed_prefill_tokens": r.computed_prefill_tokens,
        "pte.recomputed_tokens": r.recomputed_tokens,
        "pte.engine": r.engine,
    }
    if r.session_id is not None:
        attrs[gen_ai.GEN_AI_CONVERSATION_ID] = r.session_id
        attrs[SESSION_ID] = r.session_id  # the name Langfuse and other trace UIs group by
    if r.turn is not None:  # None: the session store could not say it
        attrs["pte.turn"] = r.turn
    if r.pause_s is not None:
        attrs["pte.tool_pause_s"] = r.pause_s
    if r.tenant is not None:
        attrs["pte.tenant"] = r.tenant
    if r.lora_name is not None:  # gen_ai.request.model stays the base model the adapter is priced as
        attrs["pte.lora_name"] = r.lora_name
    if r.replica is not None:
        attrs["pte.replica"] = r.replica
    for key, value in (
        ("pte.gpu_seconds", r.gpu_seconds),
        ("pte.predicted_seconds", r.predicted_seconds),
        ("pte.latency_explained_s", r.latency_explained_s),
        ("pte.interference_s", r.interference_s),
        ("pte.cost_usd", r.cost_usd),
    ):
        if value is not None:
            attrs[key] = value
    return attrs


class RecordTraceIds:
    """The SDK's id generator, except that a root span takes the trace id its record already
    carries (``preset``, per thread), so that the request log and the Prometheus exemplar
    name the span's trace."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self._random = RandomIdGenerator()
        self._preset = threading.local()

    def preset(self, trace_id: int | None) -> None:
        self._preset.trace_id = trace_id

    def generate_span_id(self) -> int:
        return self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        preset = getattr(self._preset, "trace_id", None)
        return self._random.generate_trace_id() if preset is None else preset

    def new_trace_id(self) -> str:
        """A random trace id, 32 hex digits (as the request log shows it)."""
        return f"{self._random.generate_trace_id():032x}"

    def is_trace_id_random(self) -> bool:
        return True  # the preset ids come from ``new_trace_id`` (random) or the caller's trace


def parent_context(traceparent: str | None) -> Any:
    """The caller's span as the parent of ours (None: ours is a root)."""
    if traceparent is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


class OtelExporter:
    def __init__(self, span_exporter: Any = None, on_failed: OnFailedBatch | None = None) -> None:
        self.ids = RecordTraceIds()
        self.delivery = build_tracer_provider(self.ids, span_exporter, on_failed)
        self.provider = self.delivery.provider
        self.tracer = self.provider.get_tracer("pte_instrument")
        self.new_trace_id = self.ids.new_trace_id  # for a request that brings no trace of its own

    def export(self, r: RequestRecord) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        end_ns = int(r.finished_at * 1e9)
        start_ns = end_ns - int(r.e2e_s * 1e9)
        parent = parent_context(r.traceparent)
        self.ids.preset(int(r.trace_id, 16) if r.trace_id is not None and parent is None else None)
        try:
            span = self.tracer.start_span(
                f"{operation(r)} {r.model}",
                context=parent,
                kind=SpanKind.SERVER,  # the server side of the caller's request
                start_time=start_ns,
                attributes=span_attributes(r),
            )
        finally:
            self.ids.preset(None)
        if not span.get_span_context().trace_flags.sampled:  # the processor queues sampled spans only
            return
        with self.delivery.admitted((r.model, r.engine)):  # raises, the span never ended, if no room
            if error_type(r) is not None:
                span.set_status(Status(StatusCode.ERROR, f"finish reason {r.finish_reason}"))
            span.end(end_time=end_ns)

    def shutdown(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self.delivery.close(timeout_s)


def log_attributes(r: RequestRecord) -> dict[str, Any]:
    """The request log's fields (``docs/request-log.md``) as attributes, under the same names;
    an unknown value (None) is left out, as OpenTelemetry has no null."""
    return {k: v for k, v in r.to_dict().items() if v is not None}


class OtelLogExporter:
    """One OTLP log record per priced request: the request log, for a collector."""

    def __init__(self, log_exporter: Any = None, on_failed: OnFailedBatch | None = None) -> None:
        self.delivery = build_logger_provider(log_exporter, on_failed)
        self.provider = self.delivery.provider
        self.logger = self.provider.get_logger("pte_instrument")

    def export(self, r: RequestRecord) -> None:
        from opentelemetry._logs import SeverityNumber

        with self.delivery.admitted((r.model, r.engine)):  # raises if its queue has no room
            self.logger.emit(
                timestamp=int(r.finished_at * 1e9),
                severity_number=SeverityNumber.INFO,
                severity_text="INFO",
                event_name=LOG_EVENT,
                body=f"{r.model} request {r.request_id} priced: {r.pte_served:.6g} PTE served",
                attributes=log_attributes(r),
            )

    def shutdown(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self.delivery.close(timeout_s)


def _histogram(meter: Any, name: str, buckets: tuple[float, ...], description: str) -> Any:
    """A GenAI server histogram in seconds, with the conventions' bucket advice."""
    return meter.create_histogram(
        name, unit="s", description=description, explicit_bucket_boundaries_advisory=buckets
    )


class OtelMetricsExporter:
    """The GenAI semantic conventions' model-server metrics, and ``pte.*`` counters by model:
    served and reference PTE by phase, GPU time by term (with the step hook), cost (priced).
    TTFT and time per output token are of successful requests only, as the conventions say."""

    def __init__(self, reader: Any = None, on_failed: OnFailedBatch | None = None) -> None:
        self.delivery = build_meter_provider(reader, on_failed)
        self.provider = self.delivery.provider
        meter = self.provider.get_meter("pte_instrument")
        self.duration = _histogram(
            meter,
            gen_ai_metrics.GEN_AI_SERVER_REQUEST_DURATION,
            REQUEST_DURATION_BUCKETS,
            "Generative AI server request duration such as time-to-last byte or last output token.",
        )
        self.ttft = _histogram(
            meter,
            gen_ai_metrics.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN,
            TTFT_BUCKETS,
            "Time to generate first token for successful responses.",
        )
        self.tpot = _histogram(
            meter,
            gen_ai_metrics.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN,
            TPOT_BUCKETS,
            "Time per output token generated after the first token for successful responses.",
        )
        self.served = meter.create_counter(
            "pte.served", unit="{pte}", description="Served PTE of finished requests, by phase."
        )
        self.reference = meter.create_counter(
            "pte.reference", unit="{pte}", description="Reference PTE of finished requests, by phase."
        )
        self.gpu_time = meter.create_counter(
            "pte.gpu.time",
            unit="s",
            description="Engine busy time charged to finished requests, by term of the step-time model.",
        )
        self.cost = meter.create_counter(
            "pte.cost", unit="{USD}", description="Cost of finished requests in US dollars."
        )

    def export(self, r: RequestRecord) -> None:
        attrs = genai_attributes(r)
        self.duration.record(r.e2e_s, attrs)
        if error_type(r) is None:
            if r.ttft_s is not None:
                self.ttft.record(r.ttft_s, attrs)
            if r.tpot_s is not None:
                self.tpot.record(r.tpot_s, attrs)
        model = {gen_ai.GEN_AI_REQUEST_MODEL: r.model}
        for phase, served, reference in (
            ("prefill", r.pte_prefill, r.pte_reference_prefill),
            ("decode", r.pte_decode, r.pte_reference - r.pte_reference_prefill),
        ):
            self.served.add(served, {**model, "pte.phase": phase})
            self.reference.add(reference, {**model, "pte.phase": phase})
        if r.gpu_seconds is not None:
            for field in GPU_SECONDS_TERMS:
                phase = field.removeprefix("gpu_seconds_")
                self.gpu_time.add(getattr(r, field) or 0.0, {**model, "pte.phase": phase})
        if r.cost_usd is not None:
            self.cost.add(r.cost_usd, model)

    def shutdown(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self.delivery.close(timeout_s)
