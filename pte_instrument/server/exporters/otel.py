"""OpenTelemetry: one span per finished request (an agent turn), with the GenAI semantic
conventions where they apply and ``pte.*`` attributes for the rest; and one log record per
priced request with the request log's fields, so that a collector gathers every replica's
ledger. Configured by the standard ``OTEL_*`` variables (endpoint, headers, service name,
batch delays)."""

from __future__ import annotations

from typing import Any

from pte_instrument.server.ledger import RequestRecord

LOG_EVENT = "pte.request"  # the event name of a priced-request log record


def _resource() -> Any:
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create()  # reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "vllm"}))
    return resource


def build_tracer_provider() -> Any:
    """A provider of our own (vLLM's tracing, when on, keeps its own) exporting OTLP/HTTP."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=_resource())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def build_logger_provider() -> Any:
    """A log provider of our own exporting OTLP/HTTP (``OTEL_EXPORTER_OTLP[_LOGS]_ENDPOINT``)."""
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

    provider = LoggerProvider(resource=_resource())
    provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter()))
    return provider


def span_attributes(r: RequestRecord) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": r.model,
        "gen_ai.response.id": r.request_id,
        "gen_ai.response.finish_reasons": [r.finish_reason],
        "gen_ai.usage.input_tokens": r.prompt_tokens,
        "gen_ai.usage.output_tokens": r.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": r.cached_tokens,
        "pte.served": r.pte_served,
        "pte.reference": r.pte_reference,
        "pte.ideal": r.pte_ideal,
        "pte.prefill": r.pte_prefill,
        "pte.decode": r.pte_decode,
        "pte.recompute_tax": r.pte_recompute,
        "pte.eviction_tax": r.pte_eviction_tax,
        "pte.gamma": r.gamma,
        "pte.device": r.device,
        "pte.computed_prefill_tokens": r.computed_prefill_tokens,
        "pte.recomputed_tokens": r.recomputed_tokens,
        "pte.engine": r.engine,
    }
    if r.session_id is not None:
        attrs["gen_ai.conversation.id"] = r.session_id
        attrs["pte.turn"] = r.turn
    if r.pause_s is not None:
        attrs["pte.tool_pause_s"] = r.pause_s
    if r.tenant is not None:
        attrs["pte.tenant"] = r.tenant
    if r.lora_name is not None:  # gen_ai.request.model stays the base model the adapter is priced as
        attrs["pte.lora_name"] = r.lora_name
    for key, value in (("pte.gpu_seconds", r.gpu_seconds), ("pte.predicted_seconds", r.predicted_seconds),
                       ("pte.latency_explained_s", r.latency_explained_s), ("pte.interference_s", r.interference_s),
                       ("pte.cost_usd", r.cost_usd)):  # fmt: skip
        if value is not None:
            attrs[key] = value
    return attrs


class OtelExporter:
    def __init__(self, provider: Any | None = None) -> None:
        self.provider = provider or build_tracer_provider()
        self.tracer = self.provider.get_tracer("pte_instrument")

    def export(self, r: RequestRecord) -> None:
        end_ns = int(r.finished_at * 1e9)
        start_ns = end_ns - int(r.e2e_s * 1e9)
        span = self.tracer.start_span(f"chat {r.model}", start_time=start_ns, attributes=span_attributes(r))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        self.provider.shutdown()


def log_attributes(r: RequestRecord) -> dict[str, Any]:
    """The request log's fields (``docs/request-log.md``) as attributes, under the same names;
    an unknown value (None) is left out, as OpenTelemetry has no null."""
    return {k: v for k, v in r.to_dict().items() if v is not None}


class OtelLogExporter:
    """One OTLP log record per priced request: the request log, for a collector."""

    def __init__(self, provider: Any | None = None) -> None:
        self.provider = provider or build_logger_provider()
        self.logger = self.provider.get_logger("pte_instrument")

    def export(self, r: RequestRecord) -> None:
        from opentelemetry._logs import SeverityNumber

        self.logger.emit(
            timestamp=int(r.finished_at * 1e9),
            severity_number=SeverityNumber.INFO,
            severity_text="INFO",
            event_name=LOG_EVENT,
            body=f"{r.model} request {r.request_id} priced: {r.pte_served:.6g} PTE served",
            attributes=log_attributes(r),
        )

    def shutdown(self) -> None:
        self.provider.shutdown()
