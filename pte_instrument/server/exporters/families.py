"""The plugin's metric families as data: one row per family. ``PteMetrics`` creates its
Prometheus families from this table, and the metric catalog (metrics reference, dashboard
checks, Prometheus test) reads it, so none of them can drift from the others.

Names follow the Prometheus conventions (``pte_`` prefix, base units; prometheus_client
adds a counter's ``_total``). Labels are bounded: model_name, engine, tenant, lora_name,
phase, finish_reason, stage, device, benchmark, reason; never a request or session id.
``model_name`` and ``engine`` are vLLM's own label names and values, so ``on(model_name,
engine)`` joins with ``vllm:*``: a LoRA adapter's requests keep their base model's
``model_name`` (as in vLLM's own series) and carry the adapter in ``lora_name``.

``tenant`` and ``lora_name`` are on the families that say who used what (requests, tokens,
PTE, GPU seconds, cost). Empty when they do not apply (tenants off; the base model), which
Prometheus stores as no label at all: a server without tenants or adapters keeps the series
it had.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]
Source = Literal["request", "ledger"]
# How prometheus_client's multiprocess mode merges a gauge across processes.
GaugeMode = Literal[
    "all", "liveall", "min", "livemin", "max", "livemax", "sum", "livesum", "mostrecent", "livemostrecent"
]

INF = float("inf")

# 1 PTE … 100M PTE, a factor ~3.16 apart: a short chat to a 100k-token agent turn.
PTE_BUCKETS = (*(float(f"{m}e{e}") for e in range(8) for m in (1, 3.16)), 1e8)

# 1 ms … 1,000 s: a decode step to a long agent turn.
SECONDS_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)

# 10 ms … 10,000 s of GPU time: one short turn to a long agent session.
SESSION_SECONDS_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0)

# $0.00001 … $100: a short turn on a cheap GPU to a long session on an expensive node.
USD_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)

REQ = ("model_name", "engine")
ATTRIBUTED = (*REQ, "tenant", "lora_name")  # the families that attribute usage to a tenant and an adapter
EVAL = ("model_name", "benchmark")


@dataclass(frozen=True)
class FamilySpec:
    """One metric family: what prometheus_client is given to create it, and where it is fed."""

    attr: str  # attribute of PteMetrics holding the family
    name: str  # family name, a counter's without `_total`
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # histograms only, as given to prometheus_client
    multiprocess_mode: GaugeMode | None = None  # gauges only: every gauge declares how it merges
    source: Source = "request"  # "request": per request, session, engine; "ledger": session-ledger state

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ValueError(f"metric family {self.name!r}: {'; '.join(problems)}")

    @property
    def upper_bounds(self) -> tuple[float, ...]:
        """A histogram's bucket bounds as a scrape shows them: floats, ``+Inf`` last
        (prometheus_client appends it when the table leaves it out)."""
        if self.kind != "histogram":
            return ()
        bounds = tuple(float(b) for b in self.buckets)
        return bounds if bounds[-1] == INF else (*bounds, INF)


def _problems(f: FamilySpec) -> list[str]:
    """What makes a row invalid; caught at import rather than at the first scrape."""
    out = []
    if not f.name.startswith("pte_"):
        out.append("name lacks the pte_ prefix")
    if f.kind == "counter" and f.name.endswith("_total"):
        out.append("counter name ends in _total (prometheus_client adds it)")
    if (f.kind == "histogram") != bool(f.buckets):
        out.append("buckets are for histograms, and every histogram needs them")
    if list(f.buckets) != sorted(set(f.buckets)):
        out.append("buckets not strictly increasing")
    if (f.kind == "gauge") != (f.multiprocess_mode is not None):
        out.append("multiprocess_mode is for gauges, and every gauge needs one")
    if f.source == "ledger" and f.labels:
        out.append("ledger state is process-wide: no labels")
    if not f.help:
        out.append("no help text")
    return out


# fmt: off
FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("requests", "pte_requests", "counter",
               "Finished requests priced by pte-instrument.", (*ATTRIBUTED, "finish_reason")),
    FamilySpec("served", "pte_served_pte", "counter",
               "Served PTE: the work the server really did (prefix-cache hits free, recompute included), by phase.",
               (*ATTRIBUTED, "phase")),
    FamilySpec("reference", "pte_reference_pte", "counter",
               "Reference PTE: the published definition, full prompt re-prefilled every turn, by phase.",
               (*ATTRIBUTED, "phase")),
    FamilySpec("ideal", "pte_ideal_pte", "counter",
               "Ideal PTE: cost had the KV cache survived every tool pause.", REQ),
    FamilySpec("recompute", "pte_recompute_tax_pte", "counter",
               "PTE spent re-prefilling tokens already computed once (preemption, KV loss).", REQ),
    FamilySpec("eviction", "pte_eviction_tax_pte", "counter",
               "PTE spent re-prefilling context a session's previous turn had already paid for.", REQ),
    FamilySpec("routing", "pte_routing_tax_pte", "counter",
               "PTE spent re-prefilling context a session's previous turn had already paid for on another "
               "replica: the turn was routed away from its cache (not part of pte_eviction_tax_pte).", REQ),
    FamilySpec("prompt_tokens", "pte_prompt_tokens", "counter", "Prompt tokens of finished requests.",
               ATTRIBUTED),
    FamilySpec("cached_tokens", "pte_cached_tokens", "counter", "Prompt tokens served from the prefix cache.",
               ATTRIBUTED),
    FamilySpec("output_tokens", "pte_output_tokens", "counter", "Generated tokens of finished requests.",
               ATTRIBUTED),
    FamilySpec("request_pte", "pte_request_served_pte", "histogram",
               "Served PTE per finished request.", REQ, buckets=PTE_BUCKETS),
    # --- the cost model, once per engine; equal in every process: "mostrecent" keeps one
    # series with no pid label ---
    FamilySpec("gamma", "pte_gamma", "gauge",
               "Decode-vs-prefill price of one context token (gamma), from theory.",
               (*REQ, "device"), multiprocess_mode="mostrecent"),
    FamilySpec("hoi", "pte_hardware_operational_intensity_flops_per_byte", "gauge",
               "Peak FLOP/s divided by memory bandwidth (FLOP per byte) of the device profile.",
               (*REQ, "device"), multiprocess_mode="mostrecent"),
    FamilySpec("n_active", "pte_active_parameters", "gauge",
               "Matmul weights used per token (N_active).", REQ, multiprocess_mode="mostrecent"),
    FamilySpec("kv_bytes", "pte_kv_cache_bytes_per_token", "gauge",
               "KV-cache bytes read per context token per decoded token.", REQ, multiprocess_mode="mostrecent"),
    # --- exact engine-side accounting (scheduler hook) ---
    FamilySpec("engine_served", "pte_engine_served_pte", "counter",
               "Served PTE priced step by step in the engine (exact).", REQ),
    FamilySpec("engine_recompute", "pte_engine_recompute_tax_pte", "counter",
               "PTE of tokens recomputed after preemption or KV loss, seen by the engine.", REQ),
    FamilySpec("engine_roofline", "pte_engine_roofline_pte", "counter",
               "Roofline-attributed cost (docs/cost-model.md §5), in prefill-token units.", REQ),
    FamilySpec("spec_drafts", "pte_spec_draft_tokens", "counter", "Speculative draft tokens scheduled.", REQ),
    FamilySpec("spec_rejected", "pte_spec_rejected_tokens", "counter",
               "Speculative draft tokens rejected: wasted work.", REQ),
    FamilySpec("wasted", "pte_wasted_pte", "counter",
               "PTE of work done and thrown away, by reason (rejected_drafts: speculative tokens "
               "rejected; aborted: work of an aborted request its client never received; past_end: work past "
               "the end of what a finished request's client received). Not part of served PTE.",
               (*REQ, "reason")),
    # --- seconds and money (docs/cost-model.md §5b; with the scheduler hook) ---
    FamilySpec("gpu_seconds", "pte_gpu_seconds", "counter",
               "Engine busy time charged to finished requests, by term of the step-time model (prefill, "
               "kv_read, weights, overhead): each step's measured time split over its requests.",
               (*ATTRIBUTED, "phase")),
    FamilySpec("request_gpu_seconds", "pte_request_gpu_seconds", "histogram",
               "GPU seconds per finished request.", REQ, buckets=SECONDS_BUCKETS),
    FamilySpec("routing_seconds", "pte_routing_tax_gpu_seconds", "counter",
               "GPU seconds of the routing tax: the share of each such turn's prefill seconds it spent "
               "re-prefilling context left on another replica.", REQ),
    FamilySpec("interference", "pte_interference_seconds", "counter",
               "Latency of finished requests spent on other requests' work (queue included).", REQ),
    FamilySpec("cost_usd", "pte_cost_usd", "counter",
               "Cost of finished requests in USD: GPU seconds × GPUs per engine × PTE_GPU_HOURLY_PRICE.",
               ATTRIBUTED),
    # Only grows: the largest any API server published is the engine's latest report, whichever
    # server published last (a report reaches only the server that owns its request).
    FamilySpec("engine_busy", "pte_engine_busy_seconds", "gauge",
               "Σ measured step durations of the engine so far.", REQ, multiprocess_mode="max"),
    # Not monotone, so "mostrecent", stamped with the report's busy time (the newest report
    # has the most), not with when an API server published it.
    FamilySpec("busy_gap", "pte_gpu_seconds_unattributed", "gauge",
               "Engine busy time not (yet) charged to a finished request: in flight, or of requests that "
               "finished mid-step, as the engine reported it with its latest totals (to any API server).",
               REQ, multiprocess_mode="mostrecent"),
    FamilySpec("step_model", "pte_step_model_coefficient", "gauge",
               "The engine's step-time model now, by term: a (s per prefill token), b (s per context "
               "token), w (s per memory-bound step), o (s per step).", (*REQ, "term", "source"),
               multiprocess_mode="mostrecent"),
    FamilySpec("gamma_measured", "pte_gamma_measured", "gauge",
               "Gamma as measured by the step-time model (b / a), beside pte_gamma from theory.", REQ,
               multiprocess_mode="mostrecent"),
    FamilySpec("step_model_r2", "pte_step_model_r2", "gauge",
               "R² of the step-time model over the engine's recent steps.", REQ, multiprocess_mode="mostrecent"),
    FamilySpec("step_model_mape", "pte_step_model_mape_ratio", "gauge",
               "Mean absolute percentage error of the step-time model over recent steps, as a ratio.", REQ,
               multiprocess_mode="mostrecent"),
    FamilySpec("step_model_speed", "pte_step_model_speed_ratio", "gauge",
               "The host's speed against the step-time model: measured / modelled time of the engine's "
               "last steps (1: as fitted; 2: steps take twice as long). Predicted seconds are priced at it.",
               REQ, multiprocess_mode="mostrecent"),
    # A running sum that may go negative: a gauge, not a counter; summed across processes.
    FamilySpec("engine_gap", "pte_engine_estimate_gap_pte", "gauge",
               "Σ (engine exact served PTE − stat-logger estimate) over finished requests.",
               REQ, multiprocess_mode="sum"),
    # --- live efficiency (docs/efficiency-model.md §1), by model and allow-listed benchmark label ---
    FamilySpec("eval_requests", "pte_eval_requests", "counter", "Finished requests by benchmark label.", EVAL),
    FamilySpec("eval_truncated", "pte_eval_truncated", "counter",
               "Requests that hit their output budget (finish_reason length).", EVAL),
    FamilySpec("eval_output_tokens", "pte_eval_output_tokens", "counter",
               "Generated tokens by benchmark label (E[T] = this / requests).", EVAL),
    FamilySpec("eval_labeled", "pte_eval_labeled", "counter",
               "Instances (requests or sessions) with a correctness label (POST /pte/feedback).", EVAL),
    FamilySpec("eval_labeled_truncated", "pte_eval_labeled_truncated", "counter",
               "Labeled instances that were truncated.", EVAL),
    FamilySpec("eval_labeled_output_tokens", "pte_eval_labeled_output_tokens", "counter",
               "Generated tokens of labeled instances (E0's denominator).", EVAL),
    FamilySpec("correct_answers", "pte_correct_answers", "counter",
               "Labeled instances answered correctly (never a truncated one).", EVAL),
    # --- sessions (observed when a session closes: idle TTL or the live-session cap) ---
    FamilySpec("session_turns", "pte_session_turns", "histogram", "Turns per closed agent session.",
               ("model_name",), buckets=(1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233)),
    FamilySpec("session_pte", "pte_session_served_pte", "histogram", "Served PTE per closed agent session.",
               ("model_name",), buckets=PTE_BUCKETS),
    FamilySpec("session_eviction", "pte_session_eviction_tax_pte", "histogram",
               "Eviction tax (PTE) per closed agent session.", ("model_name",), buckets=(0.0, *PTE_BUCKETS)),
    # Observed only for sessions that have them (> 0): without the step hook a session has no
    # GPU seconds, without PTE_GPU_HOURLY_PRICE no cost; a 0 there would be a guess.
    FamilySpec("session_gpu_seconds", "pte_session_gpu_seconds", "histogram",
               "GPU seconds per closed agent session (sessions with step-hook seconds only).", ("model_name",),
               buckets=SESSION_SECONDS_BUCKETS),
    FamilySpec("session_cost_usd", "pte_session_cost_usd", "histogram",
               "Cost in USD per closed agent session (sessions with a price only: PTE_GPU_HOURLY_PRICE).",
               ("model_name",), buckets=USD_BUCKETS),
    FamilySpec("tool_pause", "pte_tool_pause_seconds", "histogram",
               "Pause between a session's turn ending and its next turn arriving.",
               ("model_name",), buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600)),
    FamilySpec("sessions_closed", "pte_sessions_closed", "counter",
               "Agent sessions closed, by reason (idle: TTL; evicted: live-session cap).", ("model_name", "reason")),
    FamilySpec("session_ids_rejected", "pte_session_ids_rejected", "counter",
               "Requests whose session id was unusable (served, not tracked), by reason.", ("reason",)),
    FamilySpec("faults", "pte_plugin_faults", "counter",
               "Faults inside pte-instrument, by stage; serving continued.", ("stage",)),
    # An alert needs a series: the suspension is otherwise one log line. "min": 0 when any
    # API server has suspended the exporter.
    FamilySpec("exporter_enabled", "pte_exporter_enabled", "gauge",
               "1 while the exporter (stage) receives every priced record; 0 while it is suspended, after it "
               "failed 100 times in a row: it is retried after 1 s, then with a back-off doubling up to 60 s, "
               "and back to 1 once a retry succeeds (the other exporters continue).",
               (*REQ, "stage"), multiprocess_mode="min"),
    FamilySpec("exporter_records_lost", "pte_exporter_records_lost", "counter",
               "Priced records the exporter (stage) did not take: its export failed, or it was suspended. "
               "Delivered + lost = pte_requests_total for each exporter.",
               (*REQ, "stage")),
    # --- session-ledger state (no labels), published by LedgerMetrics ---
    # "mostrecent": every API server reads the one store of the host.
    FamilySpec("sessions_live", "pte_sessions_live", "gauge", "Agent sessions currently tracked (host-wide).",
               multiprocess_mode="mostrecent", source="ledger"),
    FamilySpec("sessions_opened", "pte_sessions_opened", "counter", "Agent sessions opened.", source="ledger"),
    FamilySpec("turn_rows_dropped", "pte_session_turn_rows_dropped", "counter",
               "Turn rows not kept past the per-session cap (totals still count).", source="ledger"),
    FamilySpec("tags_dropped", "pte_session_tags_dropped", "counter",
               "Session tags of requests that never finished, dropped: no complete successful answer "
               "(after 15 s), older than an hour, or past the cap.", source="ledger"),
    FamilySpec("session_records_lost", "pte_session_records_lost", "counter",
               "Priced records the session store did not take (its write queue was full, or a batch "
               "failed): their turns are missing from the sessions; each loss is also a fault "
               '(stage "sessions").', source="ledger"),
)
# fmt: on
