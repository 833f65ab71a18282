"""What the dashboard shows, as plain data: rows of panels, each with its PromQL queries.

No Grafana import here, so the tests can check every query (metric names, a real
Prometheus evaluating it) without the SDK; ``generate.py`` turns this into the dashboard.

Queries use Grafana's template variables ``$job``, ``$instance``, ``$model_name`` and ``$engine``
(vLLM's label names, so PTE joins with ``vllm:*`` series; regexes: "All" is
``.*``) and the range ``$__rate_interval``. A query marked *optional* may return nothing:
either it reads a metric the plugin does not export yet (its panel stays empty until the
metric lands), or it reads exported metrics that have no data on the end-to-end test server
(the step hook on, no ``PTE_GPU_HOURLY_PRICE``, a few hundred steps): ``empty_on_test_server``
then says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from prometheus.rules import ROUTING_TAX_SHARE

RATE = "$__rate_interval"
# vLLM's own series the dashboard joins with (by model_name and engine), as vLLM names them;
# tests check each against the installed vLLM.
VLLM_SERIES = ("vllm:generation_tokens", "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds")

# Every series carries the scrape's target labels.
SEL_HOST = 'job=~"$job", instance=~"$instance"'
# Series with model and engine labels (request-level metrics and the cost model).
SEL = SEL_HOST + ', model_name=~"$model_name", engine=~"$engine"'
# Session-level series carry the model only (a session may span engines).
SEL_MODEL = SEL_HOST + ', model_name=~"$model_name"'


# Why a query over exported metrics may be empty on the end-to-end test server.
UNPRICED = "unpriced"  # money: needs PTE_GPU_HOURLY_PRICE
UNFITTED = "unfitted"  # fit quality: needs the engine's online step-time fit (256 steps and more)
EmptyReason = Literal["unpriced", "unfitted"]


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str
    optional: bool = False  # may be empty: the metric does not exist yet, or see empty_on_test_server
    heatmap: bool = False  # Prometheus "heatmap" format (buckets as a heatmap)
    # The metrics exist, but the test server gives them no data (and so the query is optional).
    empty_on_test_server: EmptyReason | None = None

    def __post_init__(self) -> None:
        if self.empty_on_test_server is not None and not self.optional:
            raise ValueError(f"{self.expr!r}: empty_on_test_server needs optional=True")


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or "heatmap"
    min_zero: bool = True
    stacked: bool = False  # a timeseries whose series add up (stacked areas)


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Variable:
    name: str
    label: str
    query: str  # Grafana's label_values(<series selector>, <label>)
    metric: str  # the series it reads (checked like the panel queries)
    label_name: str


def _rate(metric: str, by: str, sel: str = SEL) -> str:
    return f"sum by ({by}) (rate({metric}{{{sel}}}[{RATE}]))"


def _quantile(q: float, metric: str, by: str, sel: str = SEL) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{sel}}}[{RATE}])))"


def _quantiles(
    metric: str,
    by: str,
    qs: tuple[float, ...],
    sel: str = SEL,
    empty_on_test_server: EmptyReason | None = None,
) -> tuple[Query, ...]:
    optional = empty_on_test_server is not None
    return tuple(
        Query(
            _quantile(q, metric, by, sel),
            f"p{round(q * 100)} {{{{{by}}}}}",
            optional=optional,
            empty_on_test_server=empty_on_test_server,
        )
        for q in qs
    )


def _rates_by_model(**metrics: str) -> tuple[Query, ...]:
    """Counters side by side, one rate per model each, the legend led by its keyword."""
    return tuple(
        Query(_rate(metric, "model_name"), f"{name} {{{{model_name}}}}") for name, metric in metrics.items()
    )


def _session_quantiles(
    title: str,
    description: str,
    metric: str,
    unit: str = "short",
    empty_on_test_server: EmptyReason | None = None,
) -> Panel:
    """A closed-session histogram's p50 and p95 by model (session series carry the model only)."""
    return Panel(
        title,
        description,
        _quantiles(metric, "model_name", (0.5, 0.95), SEL_MODEL, empty_on_test_server),
        unit=unit,
    )


# Chained like vLLM's own dashboards: each variable lists the values under the ones before it.
VARIABLES: tuple[Variable, ...] = (
    Variable("job", "Job", "label_values(pte_requests_total, job)", "pte_requests_total", "job"),
    Variable(
        "instance",
        "Instance",
        'label_values(pte_requests_total{job=~"$job"}, instance)',
        "pte_requests_total",
        "instance",
    ),
    Variable(
        "model_name",
        "Model",
        'label_values(pte_requests_total{job=~"$job", instance=~"$instance"}, model_name)',
        "pte_requests_total",
        "model_name",
    ),
    Variable(
        "engine",
        "Engine",
        'label_values(pte_requests_total{job=~"$job", instance=~"$instance", model_name=~"$model_name"}, engine)',
        "pte_requests_total",
        "engine",
    ),
)

ROWS: tuple[Row, ...] = (
    Row(
        "Cost (PTE)",
        (
            Panel(
                "PTE rate by model and phase",
                "Served PTE per second (prefix-cache hits free, recompute included), prefill vs decode.",
                (Query(_rate("pte_served_pte_total", "model_name, phase"), "{{model_name}} {{phase}}"),),
            ),
            Panel(
                "Per-request served PTE (p50 / p95 / p99)",
                "Quantiles of served PTE per finished request.",
                _quantiles("pte_request_served_pte", "model_name", (0.5, 0.95, 0.99)),
            ),
            Panel(
                "Prefill vs decode share of served PTE",
                "Each phase's fraction of the served PTE rate.",
                (
                    Query(
                        f"{_rate('pte_served_pte_total', 'model_name, phase')}"
                        f" / ignoring (phase) group_left () {_rate('pte_served_pte_total', 'model_name')}",
                        "{{model_name}} {{phase}}",
                    ),
                ),
                unit="percentunit",
            ),
            Panel(
                "Reference vs served vs ideal PTE rate",
                "Reference: the published definition (full prompt every turn). Served: what the "
                "server did. Ideal: had the KV cache survived every tool pause.",
                _rates_by_model(
                    reference="pte_reference_pte_total",
                    served="pte_served_pte_total",
                    ideal="pte_ideal_pte_total",
                ),
            ),
            Panel(
                "Eviction tax and recompute tax",
                "PTE per second spent prefilling again: context a session's previous turn had "
                "paid for (eviction), tokens lost to preemption or KV loss (recompute).",
                _rates_by_model(
                    eviction="pte_eviction_tax_pte_total", recompute="pte_recompute_tax_pte_total"
                ),
            ),
            Panel(
                "PTE rate by tenant and LoRA adapter",
                "Served PTE per second by tenant (allow-listed, else other; PTE_TENANTS) and LoRA "
                "adapter (one series with neither label: tenants off, the base model).",
                (
                    Query(
                        _rate("pte_served_pte_total", "model_name, tenant, lora_name"),
                        "{{model_name}} {{tenant}} {{lora_name}}",
                    ),
                ),
            ),
            Panel(
                "Prefix-cache hit ratio",
                "Prompt tokens served from the prefix cache over all prompt tokens.",
                (
                    Query(
                        f"{_rate('pte_cached_tokens_total', 'model_name')} / {_rate('pte_prompt_tokens_total', 'model_name')}",
                        "{{model_name}}",
                    ),
                ),
                unit="percentunit",
            ),
        ),
    ),
    Row(
        "Cost model",
        (
            Panel(
                "γ: theory vs measured",
                "Decode price of one context token in prefill-token units. Theory from the "
                "architecture and the device profile; measured by the engine's step-time model "
                "(b / a, with the step hook).",
                (
                    Query(f"pte_gamma{{{SEL}}}", "theory {{model_name}} e{{engine}} {{device}}"),
                    Query(f"pte_gamma_measured{{{SEL}}}", "measured {{model_name}} e{{engine}}"),
                ),
                min_zero=False,
            ),
            Panel(
                "Hardware operational intensity (HOI)",
                "Peak FLOP/s over memory bandwidth of the device profile (FLOP per byte).",
                (
                    Query(
                        f"pte_hardware_operational_intensity_flops_per_byte{{{SEL}}}",
                        "{{model_name}} e{{engine}} {{device}}",
                    ),
                ),
            ),
        ),
    ),
    Row(
        "Seconds and money",
        (
            Panel(
                "Where the GPU time goes",
                "Engine busy time charged to finished requests, by term of the step-time model "
                "(docs/cost-model.md §5b), in GPU-seconds per second: 1 is one engine busy all the "
                "time. With the step hook.",
                (Query(_rate("pte_gpu_seconds_total", "model_name, phase"), "{{model_name}} {{phase}}"),),
                stacked=True,
            ),
            Panel(
                "Cost per hour by model",
                "USD per hour of finished requests: GPU seconds × GPUs per engine × "
                "PTE_GPU_HOURLY_PRICE. Without a price there is no money to show (0 or no data).",
                (
                    Query(
                        f"3600 * {_rate('pte_cost_usd_total', 'model_name')}",
                        "{{model_name}}",
                        optional=True,
                        empty_on_test_server=UNPRICED,
                    ),
                ),
                unit="currencyUSD",
            ),
            Panel(
                "Cost per hour by tenant",
                "USD per hour of finished requests by tenant (allow-listed, else other; one series "
                "without a tenant label when tenants are off) and LoRA adapter. Needs a price.",
                (
                    Query(
                        f"3600 * {_rate('pte_cost_usd_total', 'tenant, lora_name')}",
                        "{{tenant}} {{lora_name}}",
                        optional=True,
                        empty_on_test_server=UNPRICED,
                    ),
                ),
                unit="currencyUSD",
            ),
            _session_quantiles(
                "GPU seconds per session (p50 / p95)",
                "GPU seconds of closed sessions (observed when a session closes; with the step hook).",
                "pte_session_gpu_seconds",
                unit="s",
            ),
            _session_quantiles(
                "Cost per session (p50 / p95)",
                "USD of closed sessions (observed when a session closes; with a price).",
                "pte_session_cost_usd",
                unit="currencyUSD",
                empty_on_test_server=UNPRICED,
            ),
            Panel(
                "Interference share of latency",
                "Part of finished requests' latency spent on other requests' work, queue included: "
                "interference / (own GPU seconds + interference).",
                (
                    Query(
                        f"{_rate('pte_interference_seconds_total', 'model_name')}"
                        f" / ({_rate('pte_gpu_seconds_total', 'model_name')}"
                        f" + {_rate('pte_interference_seconds_total', 'model_name')})",
                        "{{model_name}}",
                    ),
                ),
                unit="percentunit",
            ),
            Panel(
                "Step-time model: calibration quality",
                "γ measured by the engine's step-time model over γ from theory (1: theory holds), "
                "how well the model fits the engine's recent steps (R², MAPE as a ratio; after "
                "the first online fit), and the host's speed against it (measured / modelled step "
                "time of the last steps; 1: as fitted).",
                (
                    Query(
                        f"pte_gamma_measured{{{SEL}}} / ignoring (device) pte_gamma{{{SEL}}}",
                        "γ measured / theory {{model_name}} e{{engine}}",
                    ),
                    Query(
                        f"pte_step_model_r2{{{SEL}}}",
                        "R² {{model_name}} e{{engine}}",
                        optional=True,
                        empty_on_test_server=UNFITTED,
                    ),
                    Query(
                        f"pte_step_model_mape_ratio{{{SEL}}}",
                        "MAPE {{model_name}} e{{engine}}",
                        optional=True,
                        empty_on_test_server=UNFITTED,
                    ),
                    Query(
                        f"pte_step_model_speed_ratio{{{SEL}}}",
                        "host speed {{model_name}} e{{engine}}",
                    ),
                ),
                min_zero=False,
            ),
        ),
    ),
    Row(
        "PTE beside vLLM's own metrics",
        (
            Panel(
                "GPU seconds per generated token",
                "Engine time charged to finished requests (pte_gpu_seconds_total) over vLLM's count of "
                "generated tokens (vllm:generation_tokens_total), joined on (model_name, engine): what one "
                "output token costs the GPU, prefill and KV reads included.",
                (
                    Query(
                        f"{_rate('pte_gpu_seconds_total', 'model_name, engine')}"
                        f" / on (model_name, engine) {_rate('vllm:generation_tokens_total', 'model_name, engine')}",
                        "{{model_name}} e{{engine}}",
                    ),
                ),
                unit="s",
            ),
            Panel(
                "KV-cache usage and eviction tax",
                "vLLM's KV-cache usage (vllm:kv_cache_usage_perc) beside the share of served PTE spent "
                "re-prefilling context a session had already paid for: a full cache evicts what the next "
                "turn needs.",
                (
                    Query(
                        f"max by (model_name, engine) (vllm:kv_cache_usage_perc{{{SEL}}})",
                        "KV usage {{model_name}} e{{engine}}",
                    ),
                    Query(
                        f"{_rate('pte_eviction_tax_pte_total', 'model_name, engine')}"
                        f" / on (model_name, engine) {_rate('pte_served_pte_total', 'model_name, engine')}",
                        "eviction tax share {{model_name}} e{{engine}}",
                    ),
                ),
                unit="percentunit",
            ),
            Panel(
                "Time to first token per 1,000 prefill PTE",
                "vLLM's mean time to first token (vllm:time_to_first_token_seconds) over the prefill PTE of "
                "the same requests, joined on (model_name, engine): rising while PTE stays flat means "
                "queueing or interference, not bigger prompts.",
                (
                    Query(
                        f"1000 * {_rate('vllm:time_to_first_token_seconds_sum', 'model_name, engine')}"
                        " / on (model_name, engine) "
                        + _rate("pte_served_pte_total", "model_name, engine", SEL + ', phase="prefill"'),
                        "{{model_name}} e{{engine}}",
                    ),
                    Query(
                        _quantile(0.95, "vllm:time_to_first_token_seconds", "model_name, engine"),
                        "TTFT p95 (vLLM) {{model_name}} e{{engine}}",
                    ),
                ),
                unit="s",
            ),
        ),
    ),
    Row(
        "What routing costs",
        (
            Panel(
                "Reuse lost to routing and to eviction",
                "PTE per second that agent turns prefilled again although their session's previous turn "
                "had computed it: routing tax, where the turn reached another replica than the previous "
                "one (the cache was on another GPU; needs a session store the replicas share), and "
                "eviction tax, where the same replica had dropped it.",
                _rates_by_model(routing="pte_routing_tax_pte_total", eviction="pte_eviction_tax_pte_total"),
                stacked=True,
            ),
            Panel(
                "Routing tax share of served PTE",
                "Routing tax as a share of served PTE (the PteRoutingTaxHigh alert fires above "
                f"{ROUTING_TAX_SHARE:.0%} for 30 minutes).",
                (
                    Query(
                        f"{_rate('pte_routing_tax_pte_total', 'model_name')}"
                        f" / {_rate('pte_served_pte_total', 'model_name')}",
                        "{{model_name}}",
                    ),
                ),
                unit="percentunit",
            ),
            Panel(
                "Routing tax in GPU seconds and USD per hour",
                "GPU seconds per second spent on the routing tax (its share of the prefill seconds of "
                "the turns that paid it; with the step hook), and what they cost per hour at the "
                "model's price per GPU second (with PTE_GPU_HOURLY_PRICE).",
                (
                    Query(_rate("pte_routing_tax_gpu_seconds_total", "model_name"), "GPU s/s {{model_name}}"),
                    Query(
                        f"3600 * {_rate('pte_routing_tax_gpu_seconds_total', 'model_name')}"
                        f" * on (model_name) ({_rate('pte_cost_usd_total', 'model_name')}"
                        f" / {_rate('pte_gpu_seconds_total', 'model_name')})",
                        "USD/h {{model_name}}",
                        optional=True,
                        empty_on_test_server=UNPRICED,
                    ),
                ),
            ),
        ),
    ),
    Row(
        "Agent sessions",
        (
            Panel(
                "Session served PTE distribution",
                "Served PTE per closed session (observed when a session closes).",
                (
                    Query(
                        f"sum by (le) (increase(pte_session_served_pte_bucket{{{SEL_MODEL}}}[{RATE}]))",
                        "{{le}}",
                        heatmap=True,
                    ),
                ),
                kind="heatmap",
            ),
            _session_quantiles(
                "Turns per session (p50 / p95)", "Turns of closed sessions.", "pte_session_turns"
            ),
            _session_quantiles(
                "Tool pause (p50 / p95)",
                "Time between a session's turn ending and its next turn arriving.",
                "pte_tool_pause_seconds",
                unit="s",
            ),
            _session_quantiles(
                "Eviction tax per session (p50 / p95)",
                "Eviction tax (PTE) of closed sessions.",
                "pte_session_eviction_tax_pte",
            ),
            Panel(
                "Sessions live and closed",
                "Sessions tracked now (all models), and sessions closed per interval by reason "
                "(idle: TTL, evicted: live-session cap).",
                (
                    Query("pte_sessions_live", "live"),
                    Query(
                        f"sum by (model_name, reason) (increase(pte_sessions_closed_total{{{SEL_MODEL}}}[{RATE}]))",
                        "closed {{reason}} {{model_name}}",
                    ),
                ),
            ),
            Panel(
                "Session tracking losses",
                "Requests served without session tracking (bad id), ledger rows dropped past "
                "their caps, and records the session store did not take, per interval.",
                (
                    Query(
                        f"sum by (reason) (increase(pte_session_ids_rejected_total[{RATE}]))",
                        "id rejected: {{reason}}",
                    ),
                    Query(f"increase(pte_session_turn_rows_dropped_total[{RATE}])", "turn rows dropped"),
                    Query(f"increase(pte_session_tags_dropped_total[{RATE}])", "session tags dropped"),
                    Query(f"increase(pte_session_records_lost_total[{RATE}])", "store records lost"),
                ),
            ),
        ),
    ),
    Row(
        "Quality and health",
        (
            Panel(
                "Truncation rate (finish_reason=length)",
                "Share of finished requests cut by max_tokens or the context length.",
                (
                    Query(
                        # `or … * 0` keeps a 0 line when no request was truncated.
                        f'(sum by (model_name) (rate(pte_requests_total{{{SEL}, finish_reason="length"}}[{RATE}]))'
                        f" or 0 * {_rate('pte_requests_total', 'model_name')})"
                        f" / {_rate('pte_requests_total', 'model_name')}",
                        "{{model_name}}",
                    ),
                ),
                unit="percentunit",
            ),
            Panel(
                "Efficiency E0 (correct answers per 1,000 generated tokens)",
                "Pooled ratio of sums over requests labeled through POST /pte/feedback (docs/efficiency-model.md §1).",
                (
                    Query(
                        f"1000 * sum by (model_name, benchmark) (rate(pte_correct_answers_total{{{SEL_MODEL}}}[{RATE}]))"
                        f" / sum by (model_name, benchmark) (rate(pte_eval_labeled_output_tokens_total{{{SEL_MODEL}}}[{RATE}]))",
                        "{{model_name}} {{benchmark}}",
                    ),
                ),
            ),
            Panel(
                "Plugin faults by stage",
                "Faults inside pte-instrument per interval; serving continued.",
                (
                    Query(
                        f"sum by (stage) (increase(pte_plugin_faults_total{{{SEL_HOST}}}[{RATE}]))",
                        "{{stage}}",
                    ),
                ),
            ),
        ),
    ),
)

PANELS: tuple[Panel, ...] = tuple(p for row in ROWS for p in row.panels)

# Every panel query, machine-readable: (panel title, PromQL, optional).
QUERIES: list[tuple[str, str, bool]] = [(p.title, q.expr, q.optional) for p in PANELS for q in p.queries]
OPTIONAL_QUERIES: list[tuple[str, str]] = [(t, e) for t, e, opt in QUERIES if opt]
