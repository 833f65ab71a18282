"""Prometheus metrics. Names follow the Prometheus conventions (``pte_`` prefix,
``_total`` counters, base units); labels are bounded: model, engine, phase,
finish_reason, stage, device. Never a request or session id.

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

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from pte_instrument.cost.model import CostModel
from pte_instrument.failpoints import failpoint
from pte_instrument.server.ledger import RequestRecord
from pte_instrument.server.request_tags import PendingTags
from pte_instrument.server.sessions import SessionLedger

# 1 PTE … 100M PTE, a factor ~3.16 apart: a short chat to a 100k-token agent turn.
PTE_BUCKETS = (*(float(f"{m}e{e}") for e in range(8) for m in (1, 3.16)), 1e8)


class PteMetrics:
    """The plugin's metric families, created once per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        req = ["model", "engine"]
        self.requests = Counter(
            "pte_requests",
            "Finished requests priced by pte-instrument.",
            [*req, "finish_reason"],
            registry=registry,
        )
        self.served = Counter(
            "pte_served_pte",
            "Served PTE: the work the server really did (prefix-cache hits free, recompute included), by phase.",
            [*req, "phase"],
            registry=registry,
        )
        self.reference = Counter(
            "pte_reference_pte",
            "Reference PTE: the published definition, full prompt re-prefilled every turn, by phase.",
            [*req, "phase"],
            registry=registry,
        )
        self.ideal = Counter(
            "pte_ideal_pte",
            "Ideal PTE: cost had the KV cache survived every tool pause.",
            req,
            registry=registry,
        )
        self.recompute = Counter(
            "pte_recompute_tax_pte",
            "PTE spent re-prefilling tokens already computed once (preemption, KV loss).",
            req,
            registry=registry,
        )
        self.eviction = Counter(
            "pte_eviction_tax_pte",
            "PTE spent re-prefilling context a session's previous turn had already paid for.",
            req,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "pte_prompt_tokens", "Prompt tokens of finished requests.", req, registry=registry
        )
        self.cached_tokens = Counter(
            "pte_cached_tokens", "Prompt tokens served from the prefix cache.", req, registry=registry
        )
        self.output_tokens = Counter(
            "pte_output_tokens", "Generated tokens of finished requests.", req, registry=registry
        )
        self.request_pte = Histogram(
            "pte_request_served_pte",
            "Served PTE per finished request.",
            req,
            buckets=PTE_BUCKETS,
            registry=registry,
        )
        self.gamma = Gauge(
            "pte_gamma",
            "Decode-vs-prefill price of one context token (gamma), from theory.",
            [*req, "device"],
            registry=registry,
            multiprocess_mode="mostrecent",  # equal in every process: one series, no pid label
        )
        self.hoi = Gauge(
            "pte_hardware_operational_intensity",
            "Peak FLOP/s divided by memory bandwidth (FLOP per byte) of the device profile.",
            [*req, "device"],
            registry=registry,
            multiprocess_mode="mostrecent",  # equal in every process: one series, no pid label
        )
        self.n_active = Gauge(
            "pte_active_parameters",
            "Matmul weights used per token (N_active).",
            req,
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self.kv_bytes = Gauge(
            "pte_kv_cache_bytes_per_token",
            "KV-cache bytes read per context token per decoded token.",
            req,
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        # --- exact engine-side accounting (scheduler hook) ---
        self.engine_served = Counter(
            "pte_engine_served_pte",
            "Served PTE priced step by step in the engine (exact).",
            req,
            registry=registry,
        )
        self.engine_recompute = Counter(
            "pte_engine_recompute_tax_pte",
            "PTE of tokens recomputed after preemption or KV loss, seen by the engine.",
            req,
            registry=registry,
        )
        self.engine_roofline = Counter(
            "pte_engine_roofline_pte",
            "Roofline-attributed cost (SPEC-PTE §5), in prefill-token units.",
            req,
            registry=registry,
        )
        self.spec_drafts = Counter(
            "pte_spec_draft_tokens", "Speculative draft tokens scheduled.", req, registry=registry
        )
        self.spec_rejected = Counter(
            "pte_spec_rejected_tokens",
            "Speculative draft tokens rejected: wasted work.",
            req,
            registry=registry,
        )
        self.engine_gap = Gauge(
            "pte_engine_estimate_gap_pte",
            "Σ (engine exact served PTE − stat-logger estimate) over finished requests.",
            req,
            registry=registry,
            multiprocess_mode="sum",  # a running sum that may go negative: not a counter
        )
        # --- live efficiency (SPEC-EFFICIENCY §1), by model and allow-listed benchmark label ---
        ev = ["model", "benchmark"]
        self.eval_requests = Counter(
            "pte_eval_requests", "Finished requests by benchmark label.", ev, registry=registry
        )
        self.eval_truncated = Counter(
            "pte_eval_truncated",
            "Requests that hit their output budget (finish_reason length).",
            ev,
            registry=registry,
        )
        self.eval_output_tokens = Counter(
            "pte_eval_output_tokens",
            "Generated tokens by benchmark label (E[T] = this / requests).",
            ev,
            registry=registry,
        )
        self.eval_labeled = Counter(
            "pte_eval_labeled",
            "Instances (requests or sessions) with a correctness label (POST /pte/feedback).",
            ev,
            registry=registry,
        )
        self.eval_labeled_truncated = Counter(
            "pte_eval_labeled_truncated", "Labeled instances that were truncated.", ev, registry=registry
        )
        self.eval_labeled_output_tokens = Counter(
            "pte_eval_labeled_output_tokens",
            "Generated tokens of labeled instances (E0's denominator).",
            ev,
            registry=registry,
        )
        self.correct_answers = Counter(
            "pte_correct_answers",
            "Labeled instances answered correctly (never a truncated one).",
            ev,
            registry=registry,
        )
        # --- sessions (observed when a session closes: idle TTL or the live-session cap) ---
        self.session_turns = Histogram(
            "pte_session_turns",
            "Turns per closed agent session.",
            ["model"],
            buckets=(1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233),
            registry=registry,
        )
        self.session_pte = Histogram(
            "pte_session_served_pte",
            "Served PTE per closed agent session.",
            ["model"],
            buckets=PTE_BUCKETS,
            registry=registry,
        )
        self.session_eviction = Histogram(
            "pte_session_eviction_tax_pte",
            "Eviction tax (PTE) per closed agent session.",
            ["model"],
            buckets=(0.0, *PTE_BUCKETS),
            registry=registry,
        )
        self.tool_pause = Histogram(
            "pte_tool_pause_seconds",
            "Pause between a session's turn ending and its next turn arriving.",
            ["model"],
            buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600),
            registry=registry,
        )
        self.sessions_closed = Counter(
            "pte_sessions_closed",
            "Agent sessions closed, by reason (idle: TTL; evicted: live-session cap).",
            ["model", "reason"],
            registry=registry,
        )
        self.session_ids_rejected = Counter(
            "pte_session_ids_rejected",
            "Requests whose session id was unusable (served, not tracked), by reason.",
            ["reason"],
            registry=registry,
        )
        self.faults = Counter(
            "pte_plugin_faults",
            "Faults inside pte-instrument, by stage; serving continued.",
            ["stage"],
            registry=registry,
        )
        # --- session-ledger state (process-wide, no labels), published by LedgerMetrics ---
        self.sessions_live = Gauge(
            "pte_sessions_live",
            "Agent sessions currently tracked.",
            registry=registry,
            multiprocess_mode="livesum",  # each API server's ledger, summed over live processes
        )
        self.sessions_opened = Counter("pte_sessions_opened", "Agent sessions opened.", registry=registry)
        self.turn_rows_dropped = Counter(
            "pte_session_turn_rows_dropped",
            "Turn rows not kept past the per-session cap (totals still count).",
            registry=registry,
        )
        self.tags_dropped = Counter(
            "pte_session_tags_dropped",
            "Session tags of requests that never finished, dropped past the cap.",
            registry=registry,
        )

    LEDGER = ("sessions_live", "sessions_opened", "turn_rows_dropped", "tags_dropped")

    def evaluated(self, model: str, benchmark: str, output_tokens: int, truncated: bool) -> None:
        for labeled in (self.eval_labeled, self.eval_labeled_truncated, self.eval_labeled_output_tokens,
                        self.correct_answers, self.eval_truncated):  # fmt: skip
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
        self.sessions_closed.labels(model, reason).inc()


class LedgerMetrics:
    """Publishes the session ledger's state (live sessions, drop counts) when the stat
    logger calls ``sync()``: a few integer comparisons, so it runs after every batch."""

    def __init__(self, metrics: PteMetrics, sessions: SessionLedger, pending: PendingTags) -> None:
        self.m = metrics
        self.sessions = sessions
        self.pending = pending
        self._seen = (0, 0, 0)

    def sync(self) -> None:
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


class PrometheusExporter:
    def __init__(self, model: str, engine: int, metrics: PteMetrics) -> None:
        self.m = metrics
        self.labels = (model, str(engine))

    def publish_cost_model(self, cost: CostModel) -> None:
        m, lab = self.m, self.labels
        m.gamma.labels(*lab, cost.device.name).set(cost.gamma)
        m.hoi.labels(*lab, cost.device.name).set(cost.device.hoi)
        m.n_active.labels(*lab).set(cost.shape.n_active)
        m.kv_bytes.labels(*lab).set(cost.shape.kv_bytes_per_token)

    def export(self, r: RequestRecord) -> None:
        failpoint("prometheus")
        m, lab = self.m, self.labels
        m.requests.labels(*lab, r.finish_reason).inc()
        m.served.labels(*lab, "prefill").inc(r.pte_prefill)
        m.served.labels(*lab, "decode").inc(r.pte_decode)
        m.reference.labels(*lab, "prefill").inc(r.prompt_tokens)  # reference re-prefills the whole prompt
        m.reference.labels(*lab, "decode").inc(r.pte_reference - r.prompt_tokens)
        m.ideal.labels(*lab).inc(r.pte_ideal)
        m.recompute.labels(*lab).inc(r.pte_recompute)
        m.eviction.labels(*lab).inc(r.pte_eviction_tax)
        m.prompt_tokens.labels(*lab).inc(r.prompt_tokens)
        m.cached_tokens.labels(*lab).inc(r.cached_tokens)
        m.output_tokens.labels(*lab).inc(r.output_tokens)
        m.request_pte.labels(*lab).observe(r.pte_served)
        if r.pause_s is not None:
            m.tool_pause.labels(r.model).observe(r.pause_s)
        if r.engine_pte_served is not None:
            m.engine_served.labels(*lab).inc(r.engine_pte_served)
            m.engine_recompute.labels(*lab).inc(r.engine_recompute_tokens)
            m.engine_roofline.labels(*lab).inc(r.engine_pte_roofline)
            m.spec_drafts.labels(*lab).inc(r.engine_spec_tokens)
            m.spec_rejected.labels(*lab).inc(r.engine_rejected_tokens)
            m.engine_gap.labels(*lab).inc(r.engine_pte_served - r.pte_served)
