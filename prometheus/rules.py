"""The Prometheus rules shipped with pte-instrument, as plain data: recording rules a
dashboard reuses and the alerts, each with its threshold and what it means.

``python -m deploy.generate`` writes them to ``prometheus/pte-rules.yml`` (a plain rule file)
and into the ``PrometheusRule`` of ``deploy/kubernetes/``; the tests run ``promtool check
rules`` and ``promtool test rules`` (``prometheus/pte-rules.test.yml``) on the file, check
every metric an expression reads against the plugin's metric table, and load the file into
a real Prometheus scraping a real server.

Recorded series follow Prometheus's ``level:metric:operations`` naming: the level is the
labels kept (``model_name``, ``model_name_phase``, …), the metric drops a counter's
``_total`` once rated, and a ratio is ``<numerator>_per_<denominator>:ratio_…``. Rates are
over ``WINDOW``, per second, summed over the scrape targets (``job``, ``instance``) of a
model: one series per model (and phase, engine or reason where the name says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pte_instrument.server.pricer import MAX_CONSECUTIVE_FAULTS, MAX_RETRY_S

WINDOW = "5m"  # 20 scrapes at the usual 15 s, 5 at 1 min

# Why a recorded series may have no data on a healthy server (the end-to-end test
# server has the step hook and no price), as in the dashboard's queries.
UNPRICED = "unpriced"  # money: needs PTE_GPU_HOURLY_PRICE
EmptyReason = Literal["unpriced"]

Severity = Literal["critical", "warning", "info"]

# --- thresholds (docs/deployment.md, "Recording rules and alerts", says what each means and what to do) ---
# Faults counted over this window; any fault there, for FAULTS_FOR, alerts.
FAULTS_WINDOW = "10m"
FAULTS_FOR = "5m"
# Share of served PTE spent re-prefilling context a session's previous turn had paid for.
# Near 0 when the KV cache holds sessions across their tool pauses; a fifth of the work
# done twice, for half an hour, is a cache too small for the traffic.
EVICTION_TAX_SHARE = 0.2
ROUTING_TAX_SHARE = 0.1  # of served PTE re-prefilled because a turn left its cache's replica
# |engine exact − request-level estimate| as a share of the engine's served PTE. Without
# speculative decoding the two agree to rounding; a tenth apart means they price different work.
ENGINE_GAP_SHARE = 0.1
# γ measured by the step-time model over γ from theory, outside [1/GAMMA_FACTOR, GAMMA_FACTOR]:
# the device profile does not describe the hardware.
GAMMA_FACTOR = 2.0
# Mean absolute percentage error of the step-time model (as a ratio) above which its split of
# step time into per-request GPU seconds is unreliable (the CPU development build fits to 0.07–0.20).
STEP_MODEL_MAPE = 0.5


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str
    empty_on_test_server: EmptyReason | None = None  # why a healthy server may give it no data

    def as_dict(self) -> dict[str, Any]:
        return {"record": self.record, "expr": self.expr}


@dataclass(frozen=True)
class Alert:
    alert: str
    expr: str
    for_: str  # how long the condition holds before the alert fires
    severity: Severity
    summary: str
    description: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "alert": self.alert,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description},
        }


@dataclass(frozen=True)
class Group:
    name: str
    rules: tuple[Recording, ...] | tuple[Alert, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rules": [r.as_dict() for r in self.rules]}


def _rate(metric: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}[{WINDOW}]))"


RECORDING: tuple[Recording, ...] = (
    # --- PTE ---
    Recording("model_name:pte_requests:rate5m", _rate("pte_requests_total", "model_name")),
    Recording("model_name:pte_served_pte:rate5m", _rate("pte_served_pte_total", "model_name")),
    Recording("model_name_phase:pte_served_pte:rate5m", _rate("pte_served_pte_total", "model_name, phase")),
    Recording("model_name_engine:pte_served_pte:rate5m", _rate("pte_served_pte_total", "model_name, engine")),
    Recording("model_name:pte_reference_pte:rate5m", _rate("pte_reference_pte_total", "model_name")),
    Recording("model_name:pte_ideal_pte:rate5m", _rate("pte_ideal_pte_total", "model_name")),
    Recording("model_name:pte_recompute_tax_pte:rate5m", _rate("pte_recompute_tax_pte_total", "model_name")),
    Recording("model_name:pte_eviction_tax_pte:rate5m", _rate("pte_eviction_tax_pte_total", "model_name")),
    Recording(
        "model_name_engine:pte_eviction_tax_pte:rate5m",
        _rate("pte_eviction_tax_pte_total", "model_name, engine"),
    ),
    Recording(
        "model_name:pte_eviction_tax_pte_per_served_pte:ratio_rate5m",
        "model_name:pte_eviction_tax_pte:rate5m / model_name:pte_served_pte:rate5m",
    ),
    Recording(
        "model_name_engine:pte_eviction_tax_pte_per_served_pte:ratio_rate5m",
        "model_name_engine:pte_eviction_tax_pte:rate5m / model_name_engine:pte_served_pte:rate5m",
    ),
    Recording("model_name:pte_routing_tax_pte:rate5m", _rate("pte_routing_tax_pte_total", "model_name")),
    Recording(
        "model_name:pte_routing_tax_pte_per_served_pte:ratio_rate5m",
        "model_name:pte_routing_tax_pte:rate5m / model_name:pte_served_pte:rate5m",
    ),
    Recording(
        "model_name:pte_routing_tax_gpu_seconds:rate5m",
        _rate("pte_routing_tax_gpu_seconds_total", "model_name"),
    ),
    Recording(
        "model_name:pte_cached_tokens_per_prompt_tokens:ratio_rate5m",
        f"{_rate('pte_cached_tokens_total', 'model_name')} / {_rate('pte_prompt_tokens_total', 'model_name')}",
    ),
    Recording("model_name_reason:pte_wasted_pte:rate5m", _rate("pte_wasted_pte_total", "model_name, reason")),
    # --- the engine's exact accounting (step hook) ---
    Recording("model_name:pte_engine_served_pte:rate5m", _rate("pte_engine_served_pte_total", "model_name")),
    # The gap is a running sum (a gauge that may go down): its slope, per second.
    Recording(
        "model_name:pte_engine_estimate_gap_pte:deriv5m",
        f"sum by (model_name) (deriv(pte_engine_estimate_gap_pte[{WINDOW}]))",
    ),
    Recording(
        "model_name:pte_engine_estimate_gap_pte_per_engine_served_pte:ratio_rate5m",
        "model_name:pte_engine_estimate_gap_pte:deriv5m / model_name:pte_engine_served_pte:rate5m",
    ),
    # Per target: each engine's γ, its own device profile.
    Recording(
        "instance_model_name_engine:pte_gamma_measured_per_gamma:ratio",
        "pte_gamma_measured / ignoring (device) pte_gamma",
    ),
    # --- seconds and money (step hook) ---
    Recording("model_name:pte_gpu_seconds:rate5m", _rate("pte_gpu_seconds_total", "model_name")),
    Recording("model_name_phase:pte_gpu_seconds:rate5m", _rate("pte_gpu_seconds_total", "model_name, phase")),
    Recording(
        "model_name:pte_interference_seconds:rate5m", _rate("pte_interference_seconds_total", "model_name")
    ),
    Recording(
        "model_name:pte_interference_seconds_per_latency_seconds:ratio_rate5m",
        "model_name:pte_interference_seconds:rate5m"
        " / (model_name:pte_gpu_seconds:rate5m + model_name:pte_interference_seconds:rate5m)",
    ),
    Recording(
        "model_name:pte_cost_usd_per_hour:rate5m",
        f"3600 * {_rate('pte_cost_usd_total', 'model_name')}",
        empty_on_test_server=UNPRICED,
    ),
)

ALERTS: tuple[Alert, ...] = (
    Alert(
        "PteInstrumentFaults",
        f"sum by (job, instance, stage) (increase(pte_plugin_faults_total[{FAULTS_WINDOW}])) > 0",
        FAULTS_FOR,
        "warning",
        "pte-instrument counts faults in stage {{ $labels.stage }} on {{ $labels.instance }}",
        "{{ $value | humanize }} faults in stage {{ $labels.stage }} in the last " + FAULTS_WINDOW + ". "
        "Serving continues; what that stage does is lost for the requests it failed on. The server's "
        "log names the first fault with its traceback ('pte-instrument: fault in stage …').",
    ),
    Alert(
        "PteInstrumentExporterSuspended",
        "pte_exporter_enabled == 0",
        "1m",
        "critical",
        "pte-instrument suspended its {{ $labels.stage }} exporter on {{ $labels.instance }}",
        "The {{ $labels.stage }} exporter of {{ $labels.model_name }} (engine {{ $labels.engine }}) failed "
        f"{MAX_CONSECUTIVE_FAULTS} times in a row. It is retried with a back-off of up to {MAX_RETRY_S:g} s and "
        "resumes by itself once a retry succeeds; every record it misses is counted in "
        "pte_exporter_records_lost_total, and the other exporters continue. Fix the cause (the log line "
        "'… is suspended' and the faults of that stage).",
    ),
    Alert(
        "PteInstrumentInactive",
        "group by (job, instance) (pte_plugin_faults_total)"
        " unless on (job, instance) group by (job, instance) (pte_gamma)",
        "10m",
        "warning",
        "pte-instrument is loaded but prices nothing on {{ $labels.instance }}",
        "The plugin is installed (it exports its fault counters) but has no cost model: "
        "PTE_ENABLED=0, or the model's architecture could not be read (one log line "
        "'pte-instrument could not build its cost model and is inactive: …' names the missing "
        "fields). Requests are served and not priced.",
    ),
    Alert(
        "PteEvictionTaxHigh",
        f"model_name:pte_eviction_tax_pte_per_served_pte:ratio_rate5m > {EVICTION_TAX_SHARE:g}",
        "30m",
        "warning",
        "{{ $labels.model_name }}: {{ $value | humanizePercentage }} of served PTE is eviction tax",
        "Agent sessions re-prefill context their previous turn had already computed: the prefix "
        "cache lost it during the tool pause. Compare vllm:kv_cache_usage_perc; give the KV cache more "
        "memory or fewer concurrent sessions per replica, and route each session to one replica.",
    ),
    Alert(
        "PteRoutingTaxHigh",
        f"model_name:pte_routing_tax_pte_per_served_pte:ratio_rate5m > {ROUTING_TAX_SHARE:g}",
        "30m",
        "warning",
        "{{ $labels.model_name }}: {{ $value | humanizePercentage }} of served PTE is routing tax",
        "Agent turns reach another replica than their session's previous turn and prefill again the "
        "context cached there: the router breaks session affinity (replica restarts, scale-in, load "
        "shedding, or a cache-aware router's choice). Route by the session header; see which replicas "
        "the turns alternate between in /pte/sessions/<id> (each turn row's replica).",
    ),
    Alert(
        "PteEngineEstimateGap",
        "abs(model_name:pte_engine_estimate_gap_pte_per_engine_served_pte:ratio_rate5m)"
        f" > {ENGINE_GAP_SHARE:g}",
        "30m",
        "warning",
        "{{ $labels.model_name }}: engine and request-level PTE differ by {{ $value | humanizePercentage }}",
        "The step hook's exact served PTE and the stat logger's estimate of the same requests "
        "disagree. The engine's is higher by the work it threw away: rejected speculative drafts, and "
        "what it ran past a stop string the API server saw or past max_tokens "
        '(pte_wasted_pte_total{reason=~"rejected_drafts|past_end"}); otherwise check that the vLLM '
        "release passes scripts/vllm_contract.py.",
    ),
    Alert(
        "PteGammaDrift",
        f"instance_model_name_engine:pte_gamma_measured_per_gamma:ratio > {GAMMA_FACTOR:g}"
        f" or instance_model_name_engine:pte_gamma_measured_per_gamma:ratio < {1 / GAMMA_FACTOR:g}",
        "1h",
        "info",
        '{{ $labels.model_name }} engine {{ $labels.engine }}: γ measured is {{ printf "%.2g" $value }}× γ '
        "from theory",
        "The engine's step-time model measures a decode-vs-prefill price (γ) far from the device "
        "profile's: PTE weighs decode against prefill as the profile says, not as this hardware "
        "does. Check the device (pte_gamma's device label, PTE_DEVICE, PTE_HOI).",
    ),
    Alert(
        "PteStepModelFitPoor",
        f"pte_step_model_mape_ratio > {STEP_MODEL_MAPE:g}",
        "1h",
        "info",
        "{{ $labels.model_name }} engine {{ $labels.engine }}: step-time model MAPE {{ $value | humanizePercentage }}",
        "The step-time model explains the engine's recent step times poorly, so the split of "
        "each step into per-request GPU seconds (and money) is unreliable. Record a step log "
        "(PTE_STEP_LOG) and fit it with pte calibrate.",
    ),
)

GROUPS: tuple[Group, ...] = (
    Group("pte-instrument.rules", RECORDING),
    Group("pte-instrument.alerts", ALERTS),
)


def rule_groups() -> list[dict[str, Any]]:
    """The groups as a rule file (and a PrometheusRule's ``spec``) holds them."""
    return [g.as_dict() for g in GROUPS]
