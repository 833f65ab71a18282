"""Process-wide plugin state shared by the stat logger and the HTTP routes, which vLLM
loads separately into the same API-server process. With several API servers
(``--api-server-count``) each process has its own, and they share what must be host-wide:
the session store (one SQLite file, ``PTE_SESSION_STORE``) and the metrics (merged through
prometheus_client's multiprocess files)."""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from functools import partial, wraps
from typing import Any, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry

from pte_instrument.cost.model import CostModel
from pte_instrument.faults import FaultTracker, install_log_handler, log, say_configuration
from pte_instrument.server.engine_join import HOOK_STAGES, EngineInbox, RequestJoin
from pte_instrument.server.exporters.efficiency import EfficiencyExporter
from pte_instrument.server.exporters.prometheus import LedgerMetrics, PrometheusExporter, metrics_for
from pte_instrument.server.exporters.request_log import RequestLogWriter
from pte_instrument.server.live_efficiency import LiveEfficiency
from pte_instrument.server.lora import LoraNames
from pte_instrument.server.records import FinishedRequest
from pte_instrument.server.redis_store import open_ledger
from pte_instrument.server.request_tags import PendingTags, RequestTag
from pte_instrument.server.sessions import SessionLedger, StoreError
from pte_instrument.server.tenants import TenantPolicy
from pte_instrument.settings import Settings, is_redis_url
from pte_instrument.transport import Receiver, address_for
from pte_instrument.wire import EngineCalibration

STAGES = (
    "setup",
    "adapter",
    "accounting",
    "sessions",
    "prometheus",
    "request_log",
    "otel",
    "otel_logs",
    "otel_metrics",
    "summary",
    "middleware",
    "routes",
    "transport",
    "engine_join",
    "efficiency",
    *HOOK_STAGES,  # reported by the engine hook (another process) with its results
)
# What closing the OpenTelemetry exporters may take at exit, all together: a collector that
# does not answer must not hold the server's shutdown (the SDK's own hook waits 30 s per provider).
CLOSE_TIMEOUT_S = 5.0


class Runtime:
    def __init__(self, settings: Settings, registry: CollectorRegistry = REGISTRY) -> None:
        self.settings = settings
        self.metrics = metrics_for(registry)
        self.faults = FaultTracker(on_fault=lambda stage: self.metrics.faults.labels(stage).inc())
        for stage in STAGES:  # expose every stage's fault counter at 0
            self.metrics.faults.labels(stage)
        self.pending = PendingTags()
        self.tenants = TenantPolicy.from_settings(settings)
        self.lora_names = LoraNames(settings.max_lora_names)
        self.sessions = self._open_sessions(settings)
        self.ledger_metrics = LedgerMetrics(self.metrics, self.sessions, self.pending)
        self.efficiency = LiveEfficiency(store=self.sessions)
        self.cost_models: dict[tuple[str, int], CostModel] = {}
        self.api_keys: list[str] = []
        self.records_lost: Counter[str] = Counter()  # by exporter stage, this process's pricers
        self.request_log = RequestLogWriter(settings.request_log) if settings.request_log else None
        if self.request_log is not None and settings.enabled:
            self._check_request_log(self.request_log)
        self.inbox = EngineInbox(
            self.faults, lambda stage, n: self.metrics.faults.labels(stage).inc(n), self._calibration
        )
        self.prometheus: dict[tuple[str, int], PrometheusExporter] = {}  # by (model, engine)
        self.joins: list[RequestJoin] = []  # the stat logger's: finished requests waiting for totals
        self.receiver: Receiver | None = None
        self.receiver_address: str | None = None
        self.api_server = 0  # this process's index among the API servers
        self.otel = self._otel("otel", "OtelExporter") if settings.otel else None
        self.otel_logs = self._otel("otel_logs", "OtelLogExporter") if settings.otel_logs else None
        self.otel_metrics = (
            self._otel("otel_metrics", "OtelMetricsExporter") if settings.otel_metrics else None
        )

    @property
    def takes_traces(self) -> bool:
        """Whether OpenTelemetry reads each request's route and trace context (spans or metrics)."""
        return self.otel is not None or self.otel_metrics is not None

    @property
    def new_trace_id(self) -> Callable[[], str] | None:
        """With spans on: where a request that brings no trace gets the id of its own."""
        return None if self.otel is None else self.otel.new_trace_id

    def _otel(self, stage: str, exporter: str) -> Any:
        try:
            from pte_instrument.server.exporters import otel

            return getattr(otel, exporter)(on_failed=partial(self._otel_batch_failed, stage))
        except Exception as e:  # missing package, bad OTEL_* values
            self.faults.record(stage, e)
            return None

    @staticmethod
    def _check_request_log(writer: RequestLogWriter) -> None:
        """One clear line at start-up rather than a fault at the first request; the writer
        stays, so the log starts once the path works."""
        error = writer.check()
        if error is not None:
            log.error(
                "pte-instrument: request log PTE_REQUEST_LOG=%r is not writable (%s); serving continues, "
                "every entry that cannot be written is lost and counted in "
                'pte_exporter_records_lost_total{stage="request_log"}, and the path is tried again, '
                "with a back-off once it failed 100 times in a row",
                str(writer.path),
                error,
            )

    def listen(self, api_server: int, address: str | None) -> None:
        """Receive the engine hooks' totals for the requests this API server sends (once), on
        the transport base ``address`` (None: no engine hook can reach this process)."""
        self.api_server = api_server
        if self.receiver is not None or not address:
            return
        try:
            self.receiver_address = address_for(address, api_server)
            self.receiver = Receiver(
                self.receiver_address,
                self.inbox.on_messages,
                on_error=lambda e: self.faults.record("transport", e),
            )
        except Exception as e:
            self.faults.record("transport", e)

    def _calibration(self, c: EngineCalibration) -> None:
        """An engine's step-time model changed: publish it for every model it serves."""
        try:
            for (_, engine), exporter in list(self.prometheus.items()):
                if engine == c.engine:
                    exporter.publish_calibration(c)
        except Exception as e:
            self.faults.record("prometheus", e)

    def _open_sessions(self, settings: Settings) -> SessionLedger:
        """The host's session store (``PTE_SESSION_STORE``; unset in ``settings``: a private one);
        if it cannot be opened, a private one, so that sessions are still accounted in this
        process (one error line says which file and why)."""
        kwargs: dict[str, Any] = dict(
            max_sessions=settings.max_sessions,
            idle_ttl_s=settings.session_idle_ttl_s,
            max_turns=settings.max_turns,
            feedback_window=settings.feedback_window,
            on_close=self._session_closed,
            on_error=lambda e: self.faults.record("sessions", e),
            server_id=settings.engine_transport,  # one per vllm serve, shared by its API servers
        )
        try:
            ledger = open_ledger(settings.session_store, settings.session_store_timeout_s, **kwargs)
        except StoreError as e:
            self.faults.record("sessions", e, logged=True)  # the one line below says it all
            log.error(
                "pte-instrument: %s; sessions are kept in a private store of this process instead "
                "(not shared with other API servers, lost at restart)",
                e,
            )
            return SessionLedger(None, **kwargs)
        self._say_if_shared(ledger)
        return ledger

    @staticmethod
    def _say_if_shared(ledger: SessionLedger) -> None:
        """One line when another server on the host writes to the same SQLite store: their
        sessions and totals merge (what ``PTE_SESSION_STORE`` given to both asks for). A Redis
        store is shared by a fleet's replicas by design: nothing to say."""
        if is_redis_url(str(ledger.path)):
            return
        try:
            others = ledger.other_servers()
        except Exception:  # the store's first write will say what is wrong with it
            return
        if others:
            log.warning(
                "pte-instrument: the session store %s is shared with %d other running server(s): their "
                "sessions, turn numbers and totals merge with this server's; give each server its own "
                "PTE_SESSION_STORE unless that is what you want",
                ledger.path,
                len(others),
            )

    def _session_closed(self, summary: dict[str, Any], reason: str) -> None:
        try:
            self.metrics.session_closed(summary, reason)
        except Exception as e:
            self.faults.record("prometheus", e)

    def tagged(self, request: FinishedRequest, tag: RequestTag | None) -> FinishedRequest:
        """A finished request with what its tag says: session, benchmark label, tenant, the
        LoRA adapter it was served by (bounded), the route's operation and the caller's trace. Untagged (the middleware never saw it): no
        session, and the catch-all tenant when tenants are on."""
        if tag is None:
            tenant = self.tenants.untagged
            return request if tenant is None else replace(request, tenant=tenant)
        return replace(
            request,
            session_id=tag.session_id,
            benchmark=tag.benchmark,
            tenant=tag.tenant,
            lora_name=self.lora_names.account(tag.model),
            operation=tag.operation,
            traceparent=tag.traceparent,
            prompt_digest=_digest_of(tag.prompt_digests, request.prompt_index),
        )

    def exporters_for(self, model: str, engine: int, cost_model: CostModel) -> list[tuple[str, Any]]:
        """The exporters a stat logger of (model, engine) fans records out to."""
        prometheus = self.prometheus[(model, engine)] = PrometheusExporter(model, engine, self.metrics)
        prometheus.publish_cost_model(cost_model)
        if engine in self.inbox.calibration:  # the engine's step-time model came first
            prometheus.publish_calibration(self.inbox.calibration[engine])
        self.cost_models[(model, engine)] = cost_model
        exporters: list[tuple[str, Any]] = [
            ("prometheus", prometheus),
            ("efficiency", EfficiencyExporter(self.efficiency, self.metrics)),
        ]
        if self.request_log is not None:
            exporters.append(("request_log", self.request_log))
        if self.otel is not None:
            exporters.append(("otel", self.otel))
        if self.otel_logs is not None:
            exporters.append(("otel_logs", self.otel_logs))
        if self.otel_metrics is not None:
            exporters.append(("otel_metrics", self.otel_metrics))
        for stage, _ in exporters:  # at 1 and 0 from the start, so an alert sees the change
            self.metrics.exporter_enabled.labels(model, str(engine), stage).set(1)
            self.metrics.exporter_records_lost.labels(model, str(engine), stage)
        return exporters

    def exporter_state(self, model: str, engine: int, stage: str, on: bool) -> None:
        """An pricer of (model, engine) suspended (``on`` False) or resumed its exporter ``stage``."""
        try:
            self.metrics.exporter_enabled.labels(model, str(engine), stage).set(int(on))
        except Exception as e:
            self.faults.record("prometheus", e)

    def exporter_lost(self, model: str, engine: int, stage: str, n: int = 1) -> None:
        """``n`` priced records of (model, engine) that the exporter ``stage`` did not deliver."""
        self.records_lost[stage] += n
        try:
            self.metrics.exporter_records_lost.labels(model, str(engine), stage).inc(n)
        except Exception as e:
            self.faults.record("prometheus", e)

    def close_exporters(self, timeout_s: float | None = None) -> None:
        """Close the OpenTelemetry exporters at exit, together, within ``timeout_s``: what they
        cannot deliver by then is counted lost."""
        timeout_s = CLOSE_TIMEOUT_S if timeout_s is None else timeout_s
        closing = []
        for stage, exporter in (
            ("otel", self.otel),
            ("otel_logs", self.otel_logs),
            ("otel_metrics", self.otel_metrics),
        ):
            if exporter is not None:
                thread = threading.Thread(
                    target=self._close,
                    args=(stage, exporter, timeout_s),
                    name=f"pte-close-{stage}",
                    daemon=True,
                )
                thread.start()
                closing.append(thread)
        end = time.monotonic() + timeout_s + 1.0  # each closes by itself in time: this is a backstop
        for thread in closing:
            thread.join(max(0.0, end - time.monotonic()))

    def _close(self, stage: str, exporter: Any, timeout_s: float) -> None:
        try:
            exporter.shutdown(timeout_s)
        except Exception as e:
            self.faults.record(stage, e)

    def _otel_batch_failed(self, stage: str, error: Exception, records: Counter[tuple[str, int]]) -> None:
        """An OTLP batch not delivered: a fault of its stage, and its records lost."""
        self.faults.record(stage, error)
        for (model, engine), n in records.items():
            self.exporter_lost(model, engine, stage, n)

    def summary(self) -> dict[str, Any]:
        s = self.sessions
        return {
            "api_server": {"index": self.api_server, "pid": os.getpid()},
            "models": self._host("models", self.sessions.model_totals, {}),
            "tenants": self._host("tenants", self.sessions.tenant_totals, {}),
            "lora_adapters": self._host("lora_adapters", self.sessions.lora_totals, {}),
            "cost_models": [
                {"model": model, "engine": engine, **cm.describe()}
                for (model, engine), cm in self.cost_models.items()
            ],
            "sessions": {
                **self._host("sessions", self._host_sessions, {"live": None}),
                "store": str(s.path),
                "max_sessions": s.max_sessions,
                "idle_ttl_s": s.idle_ttl_s,
                "max_turns": s.max_turns,
                "pending_requests": len(self.pending),
                "pending_dropped": self.pending.dropped,
                "records_lost": s.stats.records_lost,
            },
            "engine_hook": {
                **self.inbox.summary(),
                "requests_waiting": sum(len(j) for j in self.joins),
            },
            "request_log": None
            if self.request_log is None
            else {**self.request_log.stats(), "lost": self.records_lost["request_log"]},
            "records_lost": dict(self.records_lost),
            "efficiency": self._host("efficiency", self.efficiency.snapshot, None),
            "faults": dict(self.faults.counts),
        }

    def _host_sessions(self) -> dict[str, Any]:
        st = self.sessions.host_stats()
        return {
            "live": st["live"],
            "opened": st["sessions_opened"],
            "expired": st["sessions_expired"],
            "evicted": st["sessions_evicted"],
            "turn_rows_dropped": st["turns_dropped"],
        }

    def _host(self, what: str, read: Any, unknown: Any) -> Any:
        """A section of the summary read from the host's store; ``unknown`` if it cannot be."""
        try:
            return read()
        except Exception as e:
            self.faults.record("sessions", e)
            return unknown


T = TypeVar("T")


def once(build: Callable[[], T]) -> Callable[[], T]:
    """A process-wide object: ``build`` runs at the first call only, under a lock (the stat
    logger and the routes may ask from different threads); every call returns its result."""
    built: list[T] = []
    lock = threading.Lock()

    @wraps(build)
    def get() -> T:
        with lock:
            if not built:
                built.append(build())
            return built[0]

    return get


@once
def get_runtime() -> Runtime:
    install_log_handler()
    settings = Settings.from_env()
    say_configuration(settings.errors)
    runtime = Runtime(settings)
    atexit.register(runtime.sessions.close)  # commit the queued turns at shutdown
    atexit.register(runtime.close_exporters)  # bounded, in place of the SDK providers' own exit hooks
    return runtime


def _digest_of(digests: tuple[str, ...], index: int | None) -> str | None:
    """The digest of the prompt a request served, of those its HTTP request carried."""
    if len(digests) == 1:
        return digests[0]
    return digests[index] if index is not None and 0 <= index < len(digests) else None
