"""Prometheus metrics: the families of ``families.FAMILIES`` (names, labels, help, buckets),
created per registry, and the exporter that feeds them from finished requests.

PTE (prefill token equivalents) is the unit of every ``pte_*_pte`` series.

Works unchanged in prometheus_client's multiprocess mode (vLLM with several API servers
sets ``PROMETHEUS_MULTIPROC_DIR`` and serves the merge of every process's files): counters
and histograms sum across processes, every gauge declares how it merges, and the session
ledger's state is published as ordinary metrics rather than read by a scrape-time
collector, which the multiprocess ``/metrics`` would not call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Generic, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from pte_instrument.cost.model import CostModel
from pte_instrument.failpoints import failpoint
from pte_instrument.server.exporters.families import FAMILIES, FamilySpec
from pte_instrument.server.records import RequestRecord
from pte_instrument.server.request_tags import PendingTags
from pte_instrument.server.sessions import SessionLedger
from pte_instrument.wire import EngineCalibration

_KINDS: dict[str, type[MetricWrapperBase]] = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


def create(spec: FamilySpec, registry: CollectorRegistry) -> MetricWrapperBase:
    """The Prometheus family a table row describes, registered in ``registry``."""
    options: dict[str, Any] = {}
    if spec.kind == "histogram":
        options["buckets"] = spec.buckets
    if spec.kind == "gauge":
        options["multiprocess_mode"] = spec.multiprocess_mode
    return _KINDS[spec.kind](spec.name, spec.help, spec.labels, registry=registry, **options)


class PteMetrics:
    """The plugin's metric families, created once per registry from ``FAMILIES``.

    The annotations only type the attributes the table creates (tests check both agree)."""

    requests: Counter
    served: Counter
    reference: Counter
    ideal: Counter
    recompute: Counter
    eviction: Counter
    routing: Counter
    prompt_tokens: Counter
    cached_tokens: Counter
    output_tokens: Counter
    request_pte: Histogram
    gamma: Gauge
    hoi: Gauge
    n_active: Gauge
    kv_bytes: Gauge
    engine_served: Counter
    engine_recompute: Counter
    engine_roofline: Counter
    spec_drafts: Counter
    spec_rejected: Counter
    wasted: Counter
    gpu_seconds: Counter
    request_gpu_seconds: Histogram
    interference: Counter
    routing_seconds: Counter
    cost_usd: Counter
    engine_busy: Gauge
    busy_gap: Gauge
    step_model: Gauge
    gamma_measured: Gauge
    step_model_r2: Gauge
    step_model_mape: Gauge
    step_model_speed: Gauge
    engine_gap: Gauge
    eval_requests: Counter
    eval_truncated: Counter
    eval_output_tokens: Counter
    eval_labeled: Counter
    eval_labeled_truncated: Counter
    eval_labeled_output_tokens: Counter
    correct_answers: Counter
    session_turns: Histogram
    session_pte: Histogram
    session_eviction: Histogram
    session_gpu_seconds: Histogram
    session_cost_usd: Histogram
    tool_pause: Histogram
    sessions_closed: Counter
    session_ids_rejected: Counter
    faults: Counter
    exporter_enabled: Gauge
    exporter_records_lost: Counter
    sessions_live: Gauge
    sessions_opened: Counter
    turn_rows_dropped: Counter
    tags_dropped: Counter

    LEDGER = tuple(spec.attr for spec in FAMILIES if spec.source == "ledger")

    def __init__(self, registry: CollectorRegistry) -> None:
        for spec in FAMILIES:
            setattr(self, spec.attr, create(spec, registry))

    def evaluated(self, model: str, benchmark: str, output_tokens: int, truncated: bool) -> None:
        for labeled in (
            self.eval_labeled,
            self.eval_labeled_truncated,
            self.eval_labeled_output_tokens,
            self.correct_answers,
            self.eval_truncated,
        ):
            labeled.labels(model, benchmark)  # exist at 0 before the first label, so rate() sees it
        self.eval_requests.labels(model, benchmark).inc()
        self.eval_output_tokens.labels(model, benchmark).inc(output_tokens)
        if truncated:
            self.eval_truncated.labels(model, benchmark).inc()

    def feedback(self, outcome: dict) -> None:
        lab = (outcome["model"], outcome["benchmark"])
        self.eval_labeled.labels(*lab).inc()
        self.eval_labeled_output_tokens.labels(*lab).inc(outcome["output_tokens"])
        self.eval_labeled_truncated.labels(*lab).inc(int(outcome["truncated"]))
        self.correct_answers.labels(*lab).inc(int(outcome["correct"]))

    def session_closed(self, summary: dict, reason: str) -> None:
        model = summary["model"]
        self.session_turns.labels(model).observe(summary["turns"])
        self.session_pte.labels(model).observe(summary["pte_served"])
        self.session_eviction.labels(model).observe(summary["pte_eviction_tax"])
        # Summed with None as 0: a 0 means the session had none (no step hook, no price), so
        # it is not observed rather than counted as free.
        gpu_seconds, cost = summary.get("gpu_seconds") or 0.0, summary.get("cost_usd") or 0.0
        if gpu_seconds > 0:
            self.session_gpu_seconds.labels(model).observe(gpu_seconds)
        if cost > 0:
            self.session_cost_usd.labels(model).observe(cost)
        self.sessions_closed.labels(model, reason).inc()


class LedgerMetrics:
    """Publishes the session ledger's state (live sessions, drop counts) when the pricer
    calls ``sync()``: a few integer comparisons, so it runs at every tick."""

    def __init__(self, metrics: PteMetrics, sessions: SessionLedger, pending: PendingTags) -> None:
        self.m = metrics
        self.sessions = sessions
        self.pending = pending
        self._seen = (0, 0, 0)
        self._lock = threading.Lock()  # the pricer's thread, and whoever ticks by hand

    def sync(self) -> None:
        with self._lock:
            self._sync()

    def _sync(self) -> None:
        st = self.sessions.stats
        now = (st.sessions_opened, st.turns_dropped, self.pending.dropped)
        counters = (self.m.sessions_opened, self.m.turn_rows_dropped, self.m.tags_dropped)
        for counter, new, old in zip(counters, now, self._seen, strict=True):
            if new > old:
                counter.inc(new - old)
        self._seen = now
        self.m.sessions_live.set(len(self.sessions))


_metrics: weakref.WeakKeyDictionary[CollectorRegistry, PteMetrics] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def metrics_for(registry: CollectorRegistry = REGISTRY) -> PteMetrics:
    """One ``PteMetrics`` per registry: several loggers (one per engine) share it."""
    with _lock:
        if registry not in _metrics:
            _metrics[registry] = PteMetrics(registry)
        return _metrics[registry]


Labels = tuple[str, ...]


@dataclass(frozen=True)
class _RequestSeries:
    """The children every finished request of one (model, engine) feeds."""

    ideal: Counter
    recompute: Counter
    eviction: Counter
    routing: Counter
    request_pte: Histogram

    @classmethod
    def bind(cls, m: PteMetrics, lab: Labels) -> _RequestSeries:
        return cls(
            m.ideal.labels(*lab),
            m.recompute.labels(*lab),
            m.eviction.labels(*lab),
            m.routing.labels(*lab),
            m.request_pte.labels(*lab),
        )


@dataclass(frozen=True)
class _UsageSeries:
    """The children of one (model, engine, tenant, lora_name): who used what."""

    served_prefill: Counter
    served_decode: Counter
    reference_prefill: Counter
    reference_decode: Counter
    prompt_tokens: Counter
    cached_tokens: Counter
    output_tokens: Counter

    @classmethod
    def bind(cls, m: PteMetrics, lab: Labels) -> _UsageSeries:
        return cls(
            m.served.labels(*lab, "prefill"),
            m.served.labels(*lab, "decode"),
            m.reference.labels(*lab, "prefill"),
            m.reference.labels(*lab, "decode"),
            m.prompt_tokens.labels(*lab),
            m.cached_tokens.labels(*lab),
            m.output_tokens.labels(*lab),
        )


@dataclass(frozen=True)
class _EngineSeries:
    """The children fed by the scheduler hook's exact accounting."""

    served: Counter
    recompute: Counter
    roofline: Counter
    spec_drafts: Counter
    spec_rejected: Counter
    wasted_drafts: Counter
    wasted_aborted: Counter
    gap: Gauge
    request_gpu_seconds: Histogram
    interference: Counter
    routing_seconds: Counter

    @classmethod
    def bind(cls, m: PteMetrics, lab: Labels) -> _EngineSeries:
        return cls(
            m.engine_served.labels(*lab),
            m.engine_recompute.labels(*lab),
            m.engine_roofline.labels(*lab),
            m.spec_drafts.labels(*lab),
            m.spec_rejected.labels(*lab),
            m.wasted.labels(*lab, "rejected_drafts"),
            m.wasted.labels(*lab, "aborted"),
            m.engine_gap.labels(*lab),
            m.request_gpu_seconds.labels(*lab),
            m.interference.labels(*lab),
            m.routing_seconds.labels(*lab),
        )


@dataclass(frozen=True)
class _SecondsSeries:
    """GPU seconds of one (model, engine, tenant, lora_name), with the scheduler hook."""

    gpu_prefill: Counter
    gpu_kv_read: Counter
    gpu_weights: Counter
    gpu_overhead: Counter

    @classmethod
    def bind(cls, m: PteMetrics, lab: Labels) -> _SecondsSeries:
        return cls(
            m.gpu_seconds.labels(*lab, "prefill"),
            m.gpu_seconds.labels(*lab, "kv_read"),
            m.gpu_seconds.labels(*lab, "weights"),
            m.gpu_seconds.labels(*lab, "overhead"),
        )


T = TypeVar("T")
MAX_BOUND = 4096  # label-value combinations one exporter caches children for


class _Bound(Generic[T]):
    """Label children bound once per key, for at most ``capacity`` keys: past it the cache
    starts over (binding again finds the same children; the label values themselves are
    bounded by the allow-lists, this only bounds the cache whatever happens)."""

    def __init__(self, bind: Callable[[Labels], T], capacity: int = MAX_BOUND) -> None:
        self._bind = bind
        self.capacity = capacity
        self._map: dict[Labels, T] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._map)

    def __getitem__(self, key: Labels) -> T:
        child = self._map.get(key)
        if child is None:
            with self._lock:  # the stat logger's thread and the pricing timer both export
                if len(self._map) >= self.capacity:
                    self._map = {}
                child = self._map[key] = self._bind(key)
        return child


def _exemplar(r: RequestRecord) -> dict[str, str] | None:
    """The request's trace, on the bucket it fell in (OpenMetrics only; prometheus_client
    keeps none in multiprocess mode)."""
    return None if r.trace_id is None else {"trace_id": r.trace_id}


class PrometheusExporter:
    """Feeds one (model, engine)'s records to the families.

    Label children are looked up once, not per request: per (model, engine), and per tenant
    and adapter for the families that attribute usage. Each group is bound on first use
    rather than here, so a series still appears only once it has data, as before: no zero
    ``pte_engine_*`` series without the scheduler hook, no pause histogram for a model
    without sessions."""

    def __init__(self, model: str, engine: int, metrics: PteMetrics) -> None:
        self.m = metrics
        self.labels = (model, str(engine))
        # finish reasons are few (stop, length, abort…); tenants and adapters are bounded upstream
        self._requests = _Bound(lambda key: self.m.requests.labels(*self.labels, *key))
        self._usage = _Bound(lambda key: _UsageSeries.bind(self.m, (*self.labels, *key)))
        self._seconds = _Bound(lambda key: _SecondsSeries.bind(self.m, (*self.labels, *key)))
        # bound apart from the seconds: without a price there is no cost series, not one at $0
        self._cost = _Bound(lambda key: self.m.cost_usd.labels(*self.labels, *key))

    @cached_property
    def _request(self) -> _RequestSeries:
        return _RequestSeries.bind(self.m, self.labels)

    @cached_property
    def _engine(self) -> _EngineSeries:
        return _EngineSeries.bind(self.m, self.labels)

    @cached_property
    def _tool_pause(self) -> Histogram:
        return self.m.tool_pause.labels(self.labels[0])  # by model only

    def publish_engine_time(self, busy_s: float, attributed_s: float) -> None:
        """The engine's busy time and what of it the engine has charged to finished requests,
        as it reported them with its latest totals (to whichever API server)."""
        lab = self.labels
        self.m.engine_busy.labels(*lab).set(busy_s)
        self.m.busy_gap.labels(*lab).set(busy_s - attributed_s)

    def publish_calibration(self, c: EngineCalibration) -> None:
        m, lab = self.m, self.labels
        for term in ("a", "b", "w", "o"):
            m.step_model.labels(*lab, term, c.source).set(getattr(c, term))
        m.gamma_measured.labels(*lab).set(c.b / c.a if c.a > 0 else float("nan"))
        if c.r2 is not None:
            m.step_model_r2.labels(*lab).set(c.r2)
        if c.mape is not None:
            m.step_model_mape.labels(*lab).set(c.mape)
        m.step_model_speed.labels(*lab).set(c.speed)

    def publish_cost_model(self, cost: CostModel) -> None:
        # Once per engine at start-up: nothing to cache.
        m, lab = self.m, self.labels
        m.gamma.labels(*lab, cost.device.name).set(cost.gamma)
        m.hoi.labels(*lab, cost.device.name).set(cost.device.hoi)
        m.n_active.labels(*lab).set(cost.shape.n_active)
        m.kv_bytes.labels(*lab).set(cost.shape.kv_bytes_per_token)

    def export(self, r: RequestRecord) -> None:
        failpoint("prometheus")
        by = (
            r.tenant or "",
            r.lora_name or "",
        )  # empty: tenants off, the base model (no label in Prometheus)
        self._requests[(*by, r.finish_reason)].inc()
        u = self._usage[by]
        u.served_prefill.inc(r.pte_prefill)
        u.served_decode.inc(r.pte_decode)
        u.reference_prefill.inc(r.pte_reference_prefill)
        u.reference_decode.inc(r.pte_reference - r.pte_reference_prefill)
        u.prompt_tokens.inc(r.prompt_tokens)
        u.cached_tokens.inc(r.cached_tokens)
        u.output_tokens.inc(r.output_tokens)
        s = self._request
        s.ideal.inc(r.pte_ideal)
        s.recompute.inc(r.pte_recompute)
        s.eviction.inc(r.pte_eviction_tax)
        s.routing.inc(r.pte_routing_tax)
        s.request_pte.observe(r.pte_served, exemplar=_exemplar(r))
        if r.pause_s is not None:
            self._tool_pause.observe(r.pause_s)
        if r.engine_pte_served is not None:
            e = self._engine
            e.served.inc(r.engine_pte_served)
            e.recompute.inc(r.engine_recompute_tokens)
            e.roofline.inc(r.engine_pte_roofline)
            e.spec_drafts.inc(r.engine_spec_tokens)
            e.spec_rejected.inc(r.engine_rejected_tokens)
            e.wasted_drafts.inc(r.pte_wasted_rejected_drafts)
            e.wasted_aborted.inc(r.pte_wasted_aborted)
            e.gap.inc(r.engine_pte_served - r.pte_served)
        if r.gpu_seconds is not None:
            e, t = self._engine, self._seconds[by]
            t.gpu_prefill.inc(r.gpu_seconds_prefill)
            t.gpu_kv_read.inc(r.gpu_seconds_kv_read)
            t.gpu_weights.inc(r.gpu_seconds_weights)
            t.gpu_overhead.inc(r.gpu_seconds_overhead)
            e.request_gpu_seconds.observe(r.gpu_seconds, exemplar=_exemplar(r))
            e.interference.inc(max(0.0, r.interference_s or 0.0))
            e.routing_seconds.inc(r.gpu_seconds_routing_tax or 0.0)
            if r.cost_usd is not None:
                self._cost[by].inc(r.cost_usd)
