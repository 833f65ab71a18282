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
from operator import attrgetter
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
    session_records_lost: Counter

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
        model = summary.get("model", "")
        # a value another writer of a shared store made unreadable (None) is not observed
        for histogram, key in (
            (self.session_turns, "turns"),
            (self.session_pte, "pte_served"),
            (self.session_eviction, "pte_eviction_tax"),
        ):
            if (x := summary.get(key)) is not None:
                histogram.labels(model).observe(x)
        # Summed with None as 0: a 0 means the session had none (no step hook, no price), so
        # it is not observed rather than counted as free.
        gpu_seconds, cost = summary.get("gpu_seconds") or 0.0, summary.get("cost_usd") or 0.0
        if gpu_seconds > 0:
            self.session_gpu_seconds.labels(model).observe(gpu_seconds)
        if cost > 0:
            self.session_cost_usd.labels(model).observe(cost)
        self.sessions_closed.labels(model, reason).inc()


class LedgerMetrics:
    """Publishes the session ledger's state: its drop counts when the pricer calls ``sync()``
    (a few integer comparisons, so it runs at every tick), and the live sessions as each of
    its commits reads them."""

    def __init__(self, metrics: PteMetrics, sessions: SessionLedger, pending: PendingTags) -> None:
        self.m = metrics
        self.sessions = sessions
        self.pending = pending
        self._seen = (0, 0, 0, 0)
        self._lock = threading.Lock()  # the pricer's thread, and whoever ticks by hand
        metrics.sessions_live.set(len(sessions))
        sessions.on_live = metrics.sessions_live.set

    def sync(self) -> None:
        with self._lock:
            self._sync()

    def _sync(self) -> None:
        st = self.sessions.stats
        now = (st.sessions_opened, st.turns_dropped, self.pending.dropped, st.records_lost)
        counters = (
            self.m.sessions_opened,
            self.m.turn_rows_dropped,
            self.m.tags_dropped,
            self.m.session_records_lost,
        )
        for counter, new, old in zip(counters, now, self._seen, strict=True):
            if new > old:
                counter.inc(new - old)
        self._seen = now


_metrics: weakref.WeakKeyDictionary[CollectorRegistry, PteMetrics] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def metrics_for(registry: CollectorRegistry = REGISTRY) -> PteMetrics:
    """One ``PteMetrics`` per registry: several loggers (one per engine) share it."""
    with _lock:
        if registry not in _metrics:
            _metrics[registry] = PteMetrics(registry)
        return _metrics[registry]


Labels = tuple[str, ...]
Read = Callable[[RequestRecord], float]


@dataclass(frozen=True)
class _Feed:
    """One label child a finished request feeds: its family (a ``PteMetrics`` attribute),
    what the record adds to it (a field's name, or a function of the record), and its label
    value after those of its group's key, where the family has one more."""

    family: str
    value: str | Read
    label: str | None = None

    @property
    def read(self) -> Read:
        return attrgetter(self.value) if isinstance(self.value, str) else self.value

    @property
    def labels(self) -> Labels:
        return () if self.label is None else (self.label,)


# What each finished request adds, by group: a group's children are bound together, on the
# group's first use, so that a series appears only once it has data.
# Per (model, engine, tenant, lora_name): who used what.
_USAGE = (
    _Feed("served", "pte_prefill", "prefill"),
    _Feed("served", "pte_decode", "decode"),
    _Feed("reference", "pte_reference_prefill", "prefill"),
    _Feed("reference", lambda r: r.pte_reference - r.pte_reference_prefill, "decode"),
    _Feed("prompt_tokens", "prompt_tokens"),
    _Feed("cached_tokens", "cached_tokens"),
    _Feed("output_tokens", "output_tokens"),
)
# Per (model, engine).
_REQUEST = (
    _Feed("ideal", "pte_ideal"),
    _Feed("recompute", "pte_recompute"),
    _Feed("eviction", "pte_eviction_tax"),
    _Feed("routing", "pte_routing_tax"),
    _Feed("request_pte", "pte_served"),
)
# Per (model, engine): the scheduler hook's exact accounting, and its seconds.
_ENGINE = (
    _Feed("engine_served", "engine_pte_served"),
    _Feed("engine_recompute", "engine_recompute_tokens"),
    _Feed("engine_roofline", "engine_pte_roofline"),
    _Feed("spec_drafts", "engine_spec_tokens"),
    _Feed("spec_rejected", "engine_rejected_tokens"),
    _Feed("wasted", "pte_wasted_rejected_drafts", "rejected_drafts"),
    _Feed("wasted", "pte_wasted_aborted", "aborted"),
    _Feed("wasted", "pte_wasted_past_end", "past_end"),
    _Feed("engine_gap", lambda r: r.engine_pte_served - r.pte_served),
)
_ENGINE_SECONDS = (
    _Feed("request_gpu_seconds", "gpu_seconds"),
    _Feed("interference", lambda r: max(0.0, r.interference_s or 0.0)),
    _Feed("routing_seconds", lambda r: r.gpu_seconds_routing_tax or 0.0),
)
# Per (model, engine, tenant, lora_name), with the scheduler hook: GPU seconds by term.
_SECONDS = (
    _Feed("gpu_seconds", "gpu_seconds_prefill", "prefill"),
    _Feed("gpu_seconds", "gpu_seconds_kv_read", "kv_read"),
    _Feed("gpu_seconds", "gpu_seconds_weights", "weights"),
    _Feed("gpu_seconds", "gpu_seconds_overhead", "overhead"),
)

_HISTOGRAMS = frozenset(spec.attr for spec in FAMILIES if spec.kind == "histogram")


class _Series:
    """One group's children for one key, looked up once: a request then costs one call per
    child. A histogram observes with the request's trace as exemplar; the others add."""

    __slots__ = ("_adds", "_observes")

    def __init__(self, m: PteMetrics, lab: Labels, feeds: tuple[_Feed, ...]) -> None:
        children = [(getattr(m, f.family).labels(*lab, *f.labels), f) for f in feeds]
        self._adds = tuple((c.inc, f.read) for c, f in children if f.family not in _HISTOGRAMS)
        self._observes = tuple((c.observe, f.read) for c, f in children if f.family in _HISTOGRAMS)

    def feed(self, r: RequestRecord) -> None:
        for add, read in self._adds:
            add(read(r))
        for observe, read in self._observes:
            observe(read(r), exemplar=_exemplar(r))


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
        self._usage = _Bound(lambda key: _Series(self.m, (*self.labels, *key), _USAGE))
        self._seconds = _Bound(lambda key: _Series(self.m, (*self.labels, *key), _SECONDS))
        # bound apart from the seconds: without a price there is no cost series, not one at $0
        self._cost = _Bound(lambda key: self.m.cost_usd.labels(*self.labels, *key))

    @cached_property
    def _request(self) -> _Series:
        return _Series(self.m, self.labels, _REQUEST)

    @cached_property
    def _engine(self) -> tuple[_Series, _Series]:
        """The hook's series and its seconds', bound together on the first use of either."""
        return _Series(self.m, self.labels, _ENGINE), _Series(self.m, self.labels, _ENGINE_SECONDS)

    @cached_property
    def _tool_pause(self) -> Histogram:
        return self.m.tool_pause.labels(self.labels[0])  # by model only

    def publish_engine_time(self, busy_s: float, attributed_s: float) -> None:
        """The engine's busy time and what of it the engine has charged to finished requests,
        as it reported them with its latest totals (to whichever API server)."""
        lab = self.labels
        self.m.engine_busy.labels(*lab).set(busy_s)
        # The gap merges across API server processes as "mostrecent", by the time each one
        # last set it; the engine's newest report is the one with the most busy time, so that
        # is its time (prometheus_client's Gauge.set would stamp the wall clock; a stamp of 0
        # never wins the merge).
        self.m.busy_gap.labels(*lab)._value.set(busy_s - attributed_s, timestamp=max(busy_s, 1e-9))

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
        # empty: tenants off, the base model (no label in Prometheus)
        by = (r.tenant or "", r.lora_name or "")
        self._requests[(*by, r.finish_reason)].inc()
        self._usage[by].feed(r)
        self._request.feed(r)
        if r.pause_s is not None:
            self._tool_pause.observe(r.pause_s)
        if r.engine_pte_served is not None:
            self._engine[0].feed(r)  # the hook's accounting
        if r.gpu_seconds is not None:
            self._seconds[by].feed(r)
            self._engine[1].feed(r)  # and its seconds
            if r.cost_usd is not None:
                self._cost[by].inc(r.cost_usd)
